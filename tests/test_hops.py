"""``mopar bench --hops``: every transport hands real tensors between two real processes."""

from __future__ import annotations

import json
import shutil

from tests.conftest import mopar, needs_redis


def test_bench_hops_json_reports_every_transport_at_every_size():
    got = mopar(
        "bench",
        "--hops",
        "--hop-sizes",
        "1024,65536",
        "--hop-budget-s",
        "0.05",
        "--json",
        timeout=60,
    )
    assert got.returncode == 0, got.stderr
    rows = json.loads(got.stdout)["hops"]
    assert {(r["transport"], r["bytes"]) for r in rows} == {
        (t, b) for t in ("memcpy", "shm", "http", "redis") for b in (1024, 65536)
    }
    for r in rows:
        if r["transport"] == "redis" and shutil.which("redis-server") is None:
            assert r["p50_us"] is None and "not on PATH" in r["note"]
        elif r["transport"] != "redis":
            assert r["p50_us"] > 0 and r["handoffs"] >= 3


def test_bench_hops_refuses_sizes_that_are_not_numbers():
    got = mopar("bench", "--hops", "--hop-sizes", "1MB", timeout=60)
    assert got.returncode != 0
    assert "--hop-sizes" in got.stderr


def test_bench_hops_leaves_no_shm_folder(tmp_path):
    from mopar.runner.local import shm_root

    before = set(shm_root().glob("mopar-hops-*"))
    got = mopar(
        "bench", "--hops", "--hop-sizes", "4096", "--hop-budget-s", "0.02", "--json", timeout=60
    )
    assert got.returncode == 0, got.stderr
    assert set(shm_root().glob("mopar-hops-*")) <= before


@needs_redis
def test_bench_hops_measures_redis_through_a_private_redis_server():
    got = mopar(
        "bench", "--hops", "--hop-sizes", "4096", "--hop-budget-s", "0.05", "--json", timeout=60
    )
    assert got.returncode == 0, got.stderr
    rows = {r["transport"]: r for r in json.loads(got.stdout)["hops"]}
    assert rows["redis"]["p50_us"] > 0 and rows["redis"]["handoffs"] >= 3
    assert rows["redis"]["note"] == ""
