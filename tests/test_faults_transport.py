"""Fault injection on the transports, with real parts only: a real redis-server killed with SIGKILL
mid-run, a real tmpfs too small for the run (a private mount namespace, `unshare -rm`), a real
function server killed with kill -9, a slice that never answers.

Whatever the fault, `mopar run` ends by itself within a bound, exits 1 with one line that names
the fault and the fix (no traceback), and leaves no process and no /dev/shm folder behind; a
function server answers a 5xx with a one-line JSON error and keeps serving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from mopar.runner.processes import ServerProcess, free_port, start_redis
from mopar.runtime.frame import encode_frame
from mopar.runtime.transports import HttpClient
from tests.conftest import (
    MOPAR,
    ROOT,
    faulty,
    needs_redis,
    nonblank_lines,
    pid_alive,
    shm_dirs_of,
)

# --- running mopar with a fault -------------------------------------------------------------------


@dataclasses.dataclass
class Ended:
    """A finished command, and every process it started (its descendants seen while it ran)."""

    returncode: int
    stdout: str
    stderr: str
    seen: dict[int, str]  # pid -> command line
    shm_dirs: set[str]  # the run folders its processes were handed

    @property
    def line(self) -> str:
        """Its stderr, which must be exactly one line (and no traceback)."""
        assert "Traceback" not in self.stderr, self.stderr
        lines = nonblank_lines(self.stderr)
        assert len(lines) == 1, self.stderr
        return lines[0]

    def shm_left(self) -> set[str]:
        """The run's own /dev/shm folders that outlived it (other runs on the machine are not
        looked at)."""
        assert self.shm_dirs, f"no process of the run was seen with its folder: {self.seen}"
        return {d for d in self.shm_dirs if os.path.exists(d)}

    def assert_no_process_left(self) -> None:
        alive = {pid: cmd for pid, cmd in self.seen.items() if pid_alive(pid)}
        assert alive == {}, f"processes outlived the run: {alive}"


Servers = dict[str, psutil.Process]  # a running chain's function servers, by slice
Fault = Callable[[Servers], bool]  # strikes when it can; True once it has


def _servers(procs: list[psutil.Process]) -> Servers:
    found: Servers = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            function_dir = p.environ().get("MOPAR_FUNCTION_DIR")
            if function_dir:
                found[Path(function_dir).name] = p
    return found


def run(
    command: list[str],
    *,
    fault: Fault | None = None,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> Ended:
    """Run ``command`` (``env`` adds variables) to its end, at most ``timeout`` s; meanwhile
    record its descendants and offer ``fault`` the function servers until it strikes (and fail
    if it never did)."""
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    out: dict[str, str] = {}
    reader = threading.Thread(
        target=lambda: out.update(zip(("out", "err"), proc.communicate())), daemon=True
    )
    reader.start()
    seen: dict[int, str] = {}
    shm_dirs: set[str] = set()
    struck = fault is None
    deadline = time.monotonic() + timeout
    while reader.is_alive() and time.monotonic() < deadline:
        with contextlib.suppress(psutil.Error):
            children = psutil.Process(proc.pid).children(recursive=True)
            for child in children:
                with contextlib.suppress(psutil.Error):
                    seen.setdefault(child.pid, " ".join(child.cmdline()))
                shm_dirs.update(shm_dirs_of(child))
            if not struck:
                struck = fault(_servers(children))
        reader.join(0.02)
    if reader.is_alive():
        for pid in [*seen, proc.pid]:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        reader.join(10)
        pytest.fail(f"{' '.join(map(str, command))} did not end within {timeout} s")
    assert struck, f"the run ended before the fault could strike: {out['err'][-2000:]}"
    return Ended(proc.returncode, out["out"], out["err"], seen, shm_dirs)


def mopar_run(bundle: Path, *args: str) -> list[str]:
    return [MOPAR, "run", str(bundle), *args]


def serving(proc: psutil.Process) -> bool:
    """Whether requests reach this function server: no connection is made before the first."""
    return any(c.status == psutil.CONN_ESTABLISHED for c in proc.net_connections("tcp"))


def once_serving(slice_name: str, strike: Callable[[psutil.Process], None]) -> Fault:
    """A fault that strikes (given the slice's server) once requests reach that slice."""

    def fault(servers: Servers) -> bool:
        server = servers.get(slice_name)
        if server is None or not serving(server):
            return False
        strike(server)
        return True

    return fault


# --- a real redis-server the test owns ------------------------------------------------------------


@contextlib.contextmanager
def redis_server(port: int) -> Iterator[subprocess.Popen]:
    """redis-server on 127.0.0.1:``port``, no persistence, up when yielded; gone afterwards."""
    with tempfile.TemporaryDirectory(prefix="mopar-test-redis-") as work:
        proc = start_redis(port, Path(work))
        assert proc is not None, f"redis-server did not start on port {port}"
        try:
            yield proc
        finally:
            proc.kill()
            proc.wait()


def _server(bundle: Path, slice_name: str, **env: str) -> ServerProcess:
    base = dict(
        os.environ,
        PORT="0",
        MOPAR_HOST="127.0.0.1",
        MOPAR_THREADS="4",
        MOPAR_FUNCTION_DIR=str(bundle / "functions" / slice_name),
    )
    return ServerProcess(
        [sys.executable, "-m", "mopar.runtime.server"], {**base, **env}, slice_name, timeout_s=60
    )


def _frame() -> bytes:
    return encode_frame(
        {"x": np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)}
    )


def _one_line_json_error(body: bytes) -> str:
    assert b"\n" not in body
    return json.loads(body)["error"]


# --- 1. Redis stops mid-run -----------------------------------------------------------------------


@needs_redis
def test_redis_killed_mid_run_fails_the_requests_in_one_line_and_leaves_nothing(skipnet_bundle):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    with redis_server(port) as redis_proc:
        kill_redis = once_serving("s2", lambda _: redis_proc.send_signal(signal.SIGKILL))
        ended = run(
            mopar_run(
                skipnet_bundle,
                "--transport",
                "redis",
                "--redis-url",
                url,
                "--requests",
                "300",
                "--json",
            ),
            fault=kill_redis,
        )
    assert ended.returncode == 1
    assert ended.line.startswith("error: ")
    assert f"redis at {url} is unreachable" in ended.line
    assert "check REDIS_URL and that the server is up" in ended.line
    report = json.loads(ended.stdout)
    assert report["requests"] == 300 and report["errors"] > 0
    ended.assert_no_process_left()
    assert ended.shm_left() == set()


@needs_redis
def test_a_server_whose_redis_goes_away_answers_503_then_serves_again_when_it_is_back(
    skipnet_bundle,
):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    receiver = _server(skipnet_bundle, "s1", REDIS_URL=url)  # answers with its outgoing frame
    sender = _server(
        skipnet_bundle, "s0", MOPAR_NEXT=receiver.url, MOPAR_TRANSPORT="redis", REDIS_URL=url
    )
    try:
        client = HttpClient(sender.url, timeout_s=30)
        with redis_server(port):
            assert client.post(_frame(), {}).status == 200
        gone = client.post(_frame(), {})  # redis-server was SIGKILLed on leaving the block
        assert gone.status == 503
        assert f"redis at {url} is unreachable" in _one_line_json_error(gone.body)
        with redis_server(port):
            back = client.post(_frame(), {})
        assert back.status == 200, back.error()
        assert sender.proc.poll() is None and receiver.proc.poll() is None
    finally:
        sender.stop()
        receiver.stop()


# --- 2. /dev/shm fills up -------------------------------------------------------------------------


PAGE = os.sysconf("SC_PAGE_SIZE")
TMPFS_BYTES = 16 * PAGE


@pytest.fixture(scope="session")
def private_mounts() -> None:
    """Skip unless this user may mount a tmpfs in a private user and mount namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is missing: cannot make a private tmpfs")
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=4k none /mnt"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"unprivileged mount namespaces are not permitted here: {probe.stderr.strip()}")


def in_private_tmpfs(folder: str, free_bytes: int, script: str) -> list[str]:
    """``unshare -rm sh -c``: mount a fresh tmpfs of `TMPFS_BYTES` on ``folder`` (private to this
    command and its children) with all but ``free_bytes`` taken by the file ``filler``, then run
    the shell ``script``; its stdout is followed by a line ``--`` and ``ls -A folder``, and its
    exit status is the command's."""
    return [
        "unshare",
        "-rm",
        "sh",
        "-c",
        f"mount -t tmpfs -o size={TMPFS_BYTES} none {folder}\n"
        f"head -c {TMPFS_BYTES - free_bytes} /dev/zero > {folder}/filler\n"
        f"{script}\nstatus=$?\necho --\nls -A {folder}\nexit $status",
    ]


@pytest.mark.parametrize("free_bytes", [0, PAGE], ids=["runner-fails", "slice-fails"])
def test_a_full_dev_shm_is_one_line_naming_the_room_needed_not_a_sigbus(
    skipnet_bundle, private_mounts, free_bytes
):
    # 0 bytes free: the runner cannot write the request's input; one page: the input fits, and
    # slice s0 cannot write its output. Either used to die of SIGBUS.
    ended = run(
        in_private_tmpfs(
            "/dev/shm", free_bytes, f"{MOPAR} run {skipnet_bundle} --requests 2 >/dev/null"
        )
    )
    assert ended.returncode == 1, ended.stderr
    assert ended.line.startswith("error: ")
    assert (
        "no room in /dev/shm/mopar-run-" in ended.line
        and "(0 bytes free on /dev/shm); free space on /dev/shm or make it larger" in ended.line
        and "--shm-size" in ended.line
    )
    assert ended.stdout.split("--\n")[1].split() == ["filler"]  # the run's folder is gone
    ended.assert_no_process_left()


SHM_SERVERS = """\
    import json, os, sys
    import numpy as np
    from mopar.runner.processes import ServerProcess
    from mopar.runtime.frame import encode_frame
    from mopar.runtime.transports import HttpClient

    bundle, folder = sys.argv[1:]
    def server(name, **env):
        env = dict(os.environ, PORT="0", MOPAR_FUNCTION_DIR=f"{bundle}/functions/{name}",
                   MOPAR_SHM_DIR=folder, **env)
        return ServerProcess([sys.executable, "-m", "mopar.runtime.server"], env, name, 60)
    frame = encode_frame({"x": np.zeros((1, 3, 8, 8), np.float32)})
    receiver = server("s1")
    sender = server("s0", MOPAR_NEXT=receiver.url, MOPAR_TRANSPORT="shm")
    client = HttpClient(sender.url, timeout_s=30)
    answers = []
    try:
        for full in (False, True, False):  # room, no room, room again
            os.truncate(f"{folder}/filler", 0)
            if full:
                stat = os.statvfs(folder)
                with open(f"{folder}/filler", "wb") as f:
                    f.write(bytes(stat.f_bavail * stat.f_frsize))
            a = client.post(frame, {})
            answers.append({"status": a.status, "body": a.body.decode(errors="replace")
                            if a.status != 200 else "", "files": sorted(os.listdir(folder))})
        answers.append({"alive": sender.proc.poll() is None})
    finally:
        sender.stop()
        receiver.stop()
    print(json.dumps(answers))
"""


def test_a_function_server_with_a_full_shm_folder_answers_507_and_serves_again(
    skipnet_bundle, private_mounts, tmp_path
):
    folder = tmp_path / "shm"
    folder.mkdir()
    scenario = tmp_path / "scenario.py"
    scenario.write_text(textwrap.dedent(SHM_SERVERS))
    ended = run(
        in_private_tmpfs(str(folder), 0, f"{sys.executable} {scenario} {skipnet_bundle} {folder}")
    )
    assert ended.returncode == 0, ended.stderr[-3000:]
    room, full, again, alive = json.loads(ended.stdout.split("--\n")[0])
    assert room["status"] == 200 and room["files"] == ["filler"]
    assert full["status"] == 507
    error = _one_line_json_error(full["body"].encode())
    assert error.startswith(f"no room in {folder} for a frame of ")
    assert "(0 bytes free); free space there or make its tmpfs larger" in error
    assert full["files"] == ["filler"]  # no half-written frame left
    assert again["status"] == 200 and alive == {"alive": True}
    ended.assert_no_process_left()


# --- 3. a function server killed with kill -9 mid-run ---------------------------------------------


def test_a_function_server_killed_mid_run_ends_the_run_naming_its_slice(skipnet_bundle):
    ended = run(
        mopar_run(skipnet_bundle, "--transport", "http", "--requests", "100000"),
        fault=once_serving("s1", lambda s1: s1.send_signal(signal.SIGKILL)),
    )
    assert ended.returncode == 1
    assert ended.line.startswith("error: the function server of slice s1 was killed by signal 9")
    ended.assert_no_process_left()
    assert ended.shm_left() == set()


# --- 4. a slice that never answers ----------------------------------------------------------------


NEVER_ANSWERS = """
import time

from mopar.runtime.handler import SliceHandler as _Real


class SliceHandler(_Real):
    def handle(self, inputs):
        time.sleep(600)
"""


def test_a_slice_that_never_answers_times_out_naming_it_and_is_stopped(bundle_copy, tmp_path):
    # s2 hangs: s1 waits for it, s0 for s1, the runner for s0: the error must name s2, not the
    # first to wait.
    env = faulty(tmp_path / "faults", {"s2": NEVER_ANSWERS})
    ended = run(
        mopar_run(bundle_copy, "--transport", "http", "--requests", "2", "--timeout", "3"),
        env=env,
    )
    assert ended.returncode == 1
    assert ended.line == (
        "error: slice s2 did not answer within 3 s; raise --timeout or check "
        "the slice's memory and CPU"
    )
    ended.assert_no_process_left()
    assert ended.shm_left() == set()


FULL_TMPFS = """\
import os, sys
from pathlib import Path
import numpy as np
from mopar.errors import ShmFullError
from mopar.runner.shmbuf import BufferPool

folder = Path(sys.argv[1])
writer, reader = BufferPool(folder), BufferPool(folder)
small, big = np.ones(4, np.float32), np.arange(3 * os.sysconf("SC_PAGE_SIZE"), dtype=np.float32)
writer.write("r0x0-v0.t", small)  # the one free page
try:
    writer.write("r0x0-v0.t", big)
    sys.exit("a tensor larger than the free space was written")
except ShmFullError as exc:
    print(exc)
np.testing.assert_array_equal(reader.read("r0x0-v0.t"), small)  # the buffer is as it was
(folder / "filler").unlink()
writer.write("r0x0-v0.t", big)
np.testing.assert_array_equal(reader.read("r0x0-v0.t"), big)
"""


def test_a_full_tmpfs_is_a_shm_full_error_in_the_buffer_pool_not_a_sigbus_and_the_buffer_survives(
    private_mounts, tmp_path
):
    folder, script = tmp_path / "shm", tmp_path / "full.py"
    folder.mkdir()
    script.write_text(FULL_TMPFS)
    ended = run(in_private_tmpfs(str(folder), PAGE, f"{sys.executable} {script} {folder}"))
    assert ended.returncode == 0, ended.stderr
    message, listing = ended.stdout.split("--\n")
    assert message.startswith(f"no room in {folder} for a tensor buffer of ")
    assert f"(0 bytes free on {folder}); free space on {folder} or make it larger" in message
    assert listing.split() == ["r0x0-v0.t"]
