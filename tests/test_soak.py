"""Soak: 10,000 requests at concurrency 32 through each transport, as ``mopar run --requests
10000 --concurrency 32 --check`` serves them (`run_bundles`), on the 3-slice SkipNet bundle.

Every answer must match the reference and none may fail; the slice processes' resident memory
must stay flat (read from /proc after each 1,000 requests, the same processes throughout); the
handoff must not pile up (shm: the run folder's buffers are reused, a fixed count; redis: no key
outlives its request); and nothing may be left afterwards: no /dev/shm folder, no slice process,
no redis key. The figures are printed (``pytest -s``) for the docs.
"""

from __future__ import annotations

import os

import psutil
import pytest

from mopar._files import OWNER_FILE
from mopar.config import RunConfig
from mopar.runner.bundle import read_manifest, read_reference
from mopar.runner.local import run_bundles
from tests.conftest import new_shm_runs, pid_alive, shm_runs

pytestmark = pytest.mark.slow

REQUESTS = 10_000
CONCURRENCY = 32
CHUNK = 1_000
RSS_DRIFT = 0.05  # the last chunk's total RSS within 5% of the first's


def _rss_mb(pid: int) -> float:
    """The current resident set (VmRSS, not the peak VmHWM) of process ``pid``, MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise AssertionError(f"/proc/{pid}/status has no VmRSS")


def _slice_processes() -> list[psutil.Process]:
    """This process's slice processes: shm workers, or the function servers of the chain."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = child.cmdline()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if (
            "mopar.runner.worker" in cmd
            or "mopar.runtime.server" in cmd
            or any(arg.endswith(os.path.join("mopar-onnx", "index.py")) for arg in cmd)
        ):
            found.append(child)
    return found


def _run_folder(procs: list[psutil.Process]) -> str:
    """The run's /dev/shm folder: a worker's third argument, or a server's MOPAR_SHM_DIR."""
    folders = set()
    for p in procs:
        cmd = p.cmdline()
        if "mopar.runner.worker" in cmd:
            folders.add(cmd[cmd.index("mopar.runner.worker") + 2])
        else:
            folders.add(p.environ()["MOPAR_SHM_DIR"])
    (folder,) = folders
    return folder


def _soak(bundle, transport: str, *, redis_url: str = "", on_chunk=None) -> dict:
    """Serve the soak; return the report and what was read after each chunk of requests."""
    manifest = read_manifest(bundle)
    inputs, expected = read_reference(bundle / "reference.npz")
    samples: list[dict] = []

    def after_batch(done: int) -> None:
        if done < (len(samples) + 1) * CHUNK and done < REQUESTS:
            return
        procs = _slice_processes()
        folder = _run_folder(procs)
        samples.append(
            {
                "done": done,
                "pids": sorted(p.pid for p in procs),
                "rss_mb": sum(_rss_mb(p.pid) for p in procs),
                "folder": folder,
                "files": len([n for n in os.listdir(folder) if n != OWNER_FILE]),  # buffers
                **(on_chunk() if on_chunk else {}),
            }
        )

    before = shm_runs()
    (report,) = run_bundles(
        [manifest],
        inputs,
        config=RunConfig(requests=REQUESTS, concurrency=CONCURRENCY),
        expected=expected,
        on_request=after_batch,
        transport=transport,
        redis_url=redis_url,
    )
    values = len(manifest.inputs) + sum(len(s.outputs) for s in manifest.slices)
    return {"report": report, "samples": samples, "before": before, "values": values}


def _check(soak: dict, transport: str) -> None:
    report, samples = soak["report"], soak["samples"]
    served = report.requests - report.errors
    first, last = samples[0]["rss_mb"], samples[-1]["rss_mb"]
    print(
        f"\nsoak {transport}: {served} of {report.requests} requests served at concurrency "
        f"{CONCURRENCY}, {report.errors} failed, mismatches "
        f"{0 if report.comparison.passed else 'some'} (max abs err "
        f"{report.max_abs_err:.3g}); slice RSS after the first {samples[0]['done']} requests "
        f"{first:.1f} MB, after all {samples[-1]['done']} {last:.1f} MB "
        f"({(last - first) / first:+.2%}); per chunk: "
        + ", ".join(f"{s['rss_mb']:.1f}" for s in samples)
    )
    assert (report.requests, report.errors) == (REQUESTS, 0), report.error_messages
    assert report.comparison.passed, report.comparison
    assert len(samples) == REQUESTS // CHUNK
    assert all(len(s["pids"]) == 3 for s in samples)
    assert len({tuple(s["pids"]) for s in samples}) == 1  # the same processes: none restarted
    assert abs(last - first) <= RSS_DRIFT * first, [s["rss_mb"] for s in samples]
    # afterwards: no slice process, no run folder
    assert not any(pid_alive(pid) for pid in samples[0]["pids"])
    assert not os.path.exists(samples[0]["folder"])
    assert new_shm_runs(soak["before"]) == set()


def test_soak_shm(skipnet_bundle):
    soak = _soak(skipnet_bundle, "shm")
    _check(soak, "shm")
    assert all(s.calls == REQUESTS for s in soak["report"].slices)
    files = [s["files"] for s in soak["samples"]]
    # one reusable buffer per request slot and value, not a file per request
    assert len(set(files)) == 1 and 0 < files[0] <= CONCURRENCY * soak["values"], files


def test_soak_http(skipnet_bundle):
    soak = _soak(skipnet_bundle, "http")
    _check(soak, "http")
    assert all(s.calls == REQUESTS for s in soak["report"].slices)
    assert all(s["files"] == 0 for s in soak["samples"])  # http hands nothing over in /dev/shm


def test_soak_redis_leaves_no_key(skipnet_bundle, redis_url):
    import redis

    client = redis.Redis.from_url(redis_url)
    assert client.dbsize() == 0
    try:
        soak = _soak(
            skipnet_bundle, "redis", redis_url=redis_url, on_chunk=lambda: {"keys": client.dbsize()}
        )
        _check(soak, "redis")
        keys = [s["keys"] for s in soak["samples"]]
        print(f"soak redis: keys after each chunk {keys}, after the run {client.dbsize()}")
        assert keys == [0] * len(keys)  # each frame is deleted by the hop that reads it
        assert client.dbsize() == 0
    finally:
        client.close()
