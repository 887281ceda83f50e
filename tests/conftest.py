"""Shared fixtures: tiny models, compiled bundles (built once per session), and helpers that run
the real ``mopar`` command as a subprocess and watch its slice processes and /dev/shm folders.

The tiny nn.Modules themselves live in `tests.models`, so that ``mopar compile tests.models:fn``
(run from the repository root) and unpickling can import them; the fixtures here hand them out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import psutil
import pytest

if TYPE_CHECKING:  # torch is imported where a fixture needs it: CLI-only tests never pay for it
    import torch

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MOPAR = str(BIN / "mopar")

SKIPNET_INPUT = "x=1x3x8x8:float32"

# --- running the CLI ------------------------------------------------------------------------------


def mopar(
    *args: str, timeout: float = 300, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``mopar ARGS`` as a real subprocess from the repository root (``env`` adds variables)."""
    return subprocess.run(
        [MOPAR, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def mopar_in_process(*args: str) -> subprocess.CompletedProcess:
    """``mopar ARGS`` through click's CliRunner, in this process, as `mopar` gives it back: for
    a test of what a command does, not of its process (each ``mopar`` subprocess imports torch
    and mopar afresh, 2-4 s). What the executable itself does with an error (one line, exit 1,
    no traceback) is tests/test_cli.py's. An exception the command let out is on stderr."""
    import traceback

    from click.testing import CliRunner

    from mopar.cli import cli

    result = CliRunner().invoke(cli, [str(a) for a in args])
    stderr = result.stderr
    if result.exc_info is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info))
    return subprocess.CompletedProcess(["mopar", *args], result.exit_code, result.stdout, stderr)


def nonblank_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@dataclasses.dataclass
class Watched:
    """A finished ``mopar run`` subprocess and the slice processes seen while it ran."""

    returncode: int
    stdout: str
    stderr: str
    workers: dict[int, list[str]]  # pid -> command line of every slice process seen

    def _args(self, offset: int) -> list[str]:
        # Worker command line: python -m mopar.runner.worker FUNCTION_DIR SHM_DIR THREADS
        return [cmd[cmd.index("mopar.runner.worker") + offset] for cmd in self.workers.values()]

    @property
    def shm_dirs(self) -> set[str]:
        return set(self._args(2))

    @property
    def function_dirs(self) -> list[str]:
        return sorted(self._args(1))


def _worker_children(pid: int) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for child in children:
        try:
            cmd = child.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if "mopar.runner.worker" in cmd:
            found[child.pid] = cmd
    return found


def run_watched(
    *args: str,
    timeout: float = 120,
    interrupt: signal.Signals | None = None,
    slices: int = 3,
    env: dict[str, str] | None = None,
) -> Watched:
    """Run ``mopar ARGS`` (``env`` adds variables), recording its slice processes while it runs.

    With ``interrupt``, wait until all ``slices`` slice processes are up, then send that signal to
    the ``mopar`` process alone (as a terminal's Ctrl-C would reach it) and wait for it to end.
    """
    proc = subprocess.Popen(
        [MOPAR, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    result: dict[str, str] = {}

    def drain() -> None:
        result["out"], result["err"] = proc.communicate()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    workers: dict[int, list[str]] = {}
    deadline = time.monotonic() + timeout
    sent = False
    while reader.is_alive() and time.monotonic() < deadline:
        workers.update(_worker_children(proc.pid))
        if interrupt is not None and not sent and len(workers) >= slices:
            time.sleep(1.0)  # let the slices load and requests flow
            proc.send_signal(interrupt)
            sent = True
        reader.join(0.02)
    if reader.is_alive():
        proc.kill()
        reader.join(10)
        pytest.fail(f"mopar {' '.join(map(str, args))} did not finish within {timeout} s")
    if interrupt is not None:
        assert sent, f"the slice processes never came up: {result.get('err', '')[-2000:]}"
    return Watched(
        returncode=proc.returncode, stdout=result["out"], stderr=result["err"], workers=workers
    )


def pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --- /dev/shm bookkeeping -------------------------------------------------------------------------
#
# Other people run mopar on this machine while the suite runs: a test asserts only about the
# folders of its own runs. `Watched.shm_dirs` and `shm_dirs_of` name a run's folders from its own
# processes; `new_shm_runs` leaves out every folder some other live process is handed.


def shm_runs() -> set[str]:
    from mopar.runner.local import shm_root

    return {str(p) for p in shm_root().glob("mopar-run-*")}


def shm_dirs_of(proc: psutil.Process) -> set[str]:
    """The run folders a slice process is handed: a shm worker's argument (``python -m
    mopar.runner.worker FUNCTION_DIR SHM_DIR THREADS``) or a function server's MOPAR_SHM_DIR."""
    named: set[str] = set()
    with contextlib.suppress(psutil.Error, OSError, IndexError):
        cmd = proc.cmdline()
        if "mopar.runner.worker" in cmd:
            named.add(cmd[cmd.index("mopar.runner.worker") + 2])
    with contextlib.suppress(psutil.Error, OSError):
        if folder := proc.environ().get("MOPAR_SHM_DIR"):
            named.add(folder)
    return named


def foreign_in_use(paths: set[str]) -> set[str]:
    """The paths some live process (e.g. another engineer's `mopar run`) names on its command
    line or is handed as its MOPAR_SHM_DIR."""
    used: set[str] = set()
    for proc in psutil.process_iter():
        if not paths - used:
            break
        with contextlib.suppress(psutil.Error, OSError):
            used.update(p for p in paths if p in proc.cmdline())
        used.update(shm_dirs_of(proc) & paths)
    return used


def new_shm_runs(before: set[str], grace_s: float = 5.0) -> set[str]:
    """mopar-run-* folders that appeared since ``before`` and stay, used by no live process.

    A folder that, within ``grace_s``, disappears or is handed to a process belongs to a run
    elsewhere on the machine that was making or removing it; a folder our finished run left
    behind does neither.
    """
    deadline = time.monotonic() + grace_s
    left = shm_runs() - before
    left -= foreign_in_use(left)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left &= shm_runs()
        left -= foreign_in_use(left)
    return left


@contextlib.contextmanager
def served(bundle: Path, *args: str):
    """``mopar serve BUNDLE ARGS`` on a free port of 127.0.0.1, until the block ends: its
    address (``127.0.0.1:PORT``) and its process, once its banner says it serves."""
    from mopar.runner.processes import free_port

    port = free_port()
    proc = subprocess.Popen(
        [MOPAR, "serve", str(bundle), "--port", str(port), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first: list[str] = []
        reader = threading.Thread(target=lambda: first.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(120)
        assert first and f"127.0.0.1:{port}" in first[0], (first, proc.poll())
        yield f"127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# --- bundles --------------------------------------------------------------------------------------


SHARED_BUNDLES: dict[str, tuple[str, ...]] = {
    # SkipNet compiled into 3 slices (factory source).
    "skipnet_bundle": (
        "tests.models:skipnet",
        "--input",
        SKIPNET_INPUT,
        "--slices",
        "3",
        "--strategy",
        "uniform",
    ),
    # The same, planned and sized for Lambda: a bundle holds its own target's files alone.
    "skipnet_lambda_bundle": (
        "tests.models:skipnet",
        "--input",
        SKIPNET_INPUT,
        "--slices",
        "3",
        "--strategy",
        "uniform",
        "--target",
        "lambda",
    ),
    # The Mixtral-style example with the Zipf router, with two experts per expert function (s0,
    # s1.e0-e3, dispatch s1, s2, s3.e0-e3, dispatch s3, s4), its activation trace measured on
    # the shipped calibration tokens.
    "moe_bundle": (
        "examples.moe:mixtral_tiny_zipf",
        "--input",
        "input_ids=1x16:int64:0..256",
        "--input",
        "attention_mask=1x16:int64:1..2",
        "--expert-group",
        "2",
        "--hot-experts",
        "none",
        "--calibration",
        str(ROOT / "examples" / "data" / "moe_calibration.npz"),
    ),
}
"""The bundles of ``mopar compile ARGS``, by fixture name, that every test of a run shares."""


def made_once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder ``name``, made by ``make(folder)`` once per test run: whoever asks first (a
    pytest-xdist worker, or `_prebuild`) makes it under a lock, the others wait for it and read
    it. The folder is read-only for tests: copy it before changing anything."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # popen-gwN: the run's folder is shared
        root = root.parent
    shared = root / "made-once"
    shared.mkdir(exist_ok=True)
    out, done = shared / name, shared / f"{name}.done"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # a worker that failed before left it
            make(out)
            done.touch()
    return out


def compiled_once(tmp_path_factory, fixture: str) -> Path:
    """The bundle of `SHARED_BUNDLES` [``fixture``], compiled once per test run (`made_once`)."""

    def compile_it(folder: Path) -> None:
        proc = mopar("compile", *SHARED_BUNDLES[fixture], "--out", folder / "bundle")
        assert proc.returncode == 0, proc.stderr[-4000:]

    return made_once(tmp_path_factory, fixture, compile_it) / "bundle"


@pytest.fixture(scope="session", autouse=True)
def _prebuild(request, tmp_path_factory):
    """Start compiling the shared bundles this run's tests use, in the background of one
    process (the first xdist worker), so that no worker sits idle waiting for one later."""
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        yield
        return
    used = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    names = [name for name in SHARED_BUNDLES if name in used]

    def build() -> None:
        for name in names:
            with contextlib.suppress(AssertionError):  # the fixture itself reports a failure
                compiled_once(tmp_path_factory, name)

    tmp_path_factory.getbasetemp()  # made here: the thread and a test making it at once race
    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    yield
    thread.join()


@pytest.fixture(scope="session")
def skipnet_bundle(tmp_path_factory) -> Path:
    """`SHARED_BUNDLES`' SkipNet in 3 slices, compiled by the real ``mopar compile`` subprocess.

    Read-only for tests: copy it (`bundle_copy`) before changing anything.
    """
    return compiled_once(tmp_path_factory, "skipnet_bundle")


@pytest.fixture(scope="session")
def skipnet_lambda_bundle(tmp_path_factory) -> Path:
    """`SHARED_BUNDLES`' SkipNet in 3 slices for ``--target lambda``: template.yaml and
    Dockerfile.lambda, no stack.yml. Read-only."""
    return compiled_once(tmp_path_factory, "skipnet_lambda_bundle")


@pytest.fixture(scope="session")
def moe_bundle(tmp_path_factory) -> Path:
    """`SHARED_BUNDLES`' Mixtral-style MoE bundle, compiled by the real CLI. Read-only."""
    return compiled_once(tmp_path_factory, "moe_bundle")


@pytest.fixture(scope="session")
def zoo_files(request, tmp_path_factory) -> Path:
    """A folder holding the saved zoo models (`examples.zoo`) of every test this session runs,
    written by one ``python -m examples.zoo --save`` subprocess, so no test process ever imported
    what the models' modules register. Saved once per test run (`made_once`): every xdist
    worker's session holds the same tests, so each would save the same models.

    A test names its models by its ``name`` parameter (a key of `zoo.ZOO`) or by its module's
    ``ZOO_MODELS``. A model that failed to save has a ``NAME.error`` file (`zoo.saved_error`):
    each test reports its own. Read-only for tests.
    """
    from examples import zoo

    names: set[str] = set()
    for item in request.session.items:
        if "zoo_files" not in getattr(item, "fixturenames", ()):
            continue
        names.update(getattr(item.module, "ZOO_MODELS", ()))
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("name") in zoo.ZOO:
            names.add(callspec.params["name"])

    def save(folder: Path) -> None:
        proc = zoo.save_in_subprocess(folder, sorted(names))
        # Exit status 1 means some models failed to save: each test reports its own.
        assert proc.returncode in (0, 1), proc.stderr[-3000:]

    return made_once(tmp_path_factory, "zoo_files", save)


@pytest.fixture
def bundle_copy(skipnet_bundle, tmp_path) -> Path:
    dst = tmp_path / "bundle"
    shutil.copytree(skipnet_bundle, dst)
    return dst


# --- faulty slices --------------------------------------------------------------------------------

_DISPATCH = """
import importlib.util
import pathlib

from mopar.runtime.handler import SliceHandler as _Mopar

_HERE = pathlib.Path(__file__).resolve().parent


class SliceHandler:
    \"\"\"The named slices' faulty handlers; mopar's own for every other.\"\"\"

    def __new__(cls, function_dir, **kw):
        fault = _HERE / f"fault_{pathlib.Path(function_dir).name}.py"
        if not fault.is_file():
            return _Mopar(function_dir, **kw)
        spec = importlib.util.spec_from_file_location(fault.stem, fault)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.SliceHandler(function_dir, **kw)
"""


def faulty(folder: Path, faults: dict[str, str]) -> dict[str, str]:
    """The environment under which each slice named in ``faults`` runs the ``SliceHandler`` its
    code defines, and every other slice mopar's own: ``MOPAR_HANDLER``, mopar's hook for fault
    injection (a bundle's own ``handler.py`` never runs under `mopar run`). Each slice's code is
    a module of its own, ``fault_<slice>.py`` in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, code in faults.items():
        (folder / f"fault_{name}.py").write_text(textwrap.dedent(code))
    (folder / "handlers.py").write_text(_DISPATCH)
    return {"MOPAR_HANDLER": str(folder / "handlers.py")}


# --- tiny models ---------------------------------------------------------------------------------


@pytest.fixture
def skipnet() -> torch.nn.Module:
    from tests import models

    return models.skipnet()


@pytest.fixture
def skipnet_input() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)}


@pytest.fixture(scope="session")
def skipnet_analysis():
    from mopar import api

    return api.analyze("tests.models:skipnet", [SKIPNET_INPUT])


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Run torch on one thread in the test process, once something has imported it.

    The tests' models are small: many tiny operators, which one thread runs faster than two that
    wait on each other, and on a busy 2-core machine the two threads spin against every other
    process (the autoencoder training of tests/test_compress.py: 10 s on one thread against 61 s
    on two at a load of 15). The ``mopar`` subprocesses keep their own settings.
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_stray_env(monkeypatch):
    # Keep Hugging Face offline and quiet in every test that builds a transformer.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")


def eager(model: torch.nn.Module, inputs: dict[str, np.ndarray]) -> torch.Tensor:
    import torch

    with torch.no_grad():
        return model(**{k: torch.from_numpy(v) for k, v in inputs.items()})


def plan_of(groups: list[list[str]], model: str = "test"):
    """A hand-made Plan whose slices are these groups of layer names (rewrites never decide)."""
    from mopar.plan import Function, Plan

    return Plan(
        model=model,
        strategy="hand",
        memory_source="test",
        functions=tuple(
            Function(name=f"s{i}", layers=tuple(g), memory_mb=128) for i, g in enumerate(groups)
        ),
    )


def chain_plan(functions, *, model: str = "m", transport="http", nbytes: int = 1000, **fields):
    """A hand-made Plan of ``functions`` (`mopar.plan.Function`) in a chain: tensor ``t{i}``
    from each to the next, ``x`` in and ``y`` out; ``transport``: one for every cut, or one
    per function."""
    from mopar.plan import REQUEST, RESPONSE, Edge, Plan

    names = [f.name for f in functions]
    edges = [Edge(src=REQUEST, dst=names[0], tensors=("x",), bytes=nbytes, transport="request")]
    transports = [transport] * len(names) if isinstance(transport, str) else list(transport)
    edges += [
        Edge(src=a, dst=b, tensors=(f"t{i}",), bytes=nbytes, transport=transports[i])
        for i, (a, b) in enumerate(zip(names, names[1:]))
    ]
    edges.append(
        Edge(src=names[-1], dst=RESPONSE, tensors=("y",), bytes=nbytes, transport="response")
    )
    return Plan(
        model=model,
        strategy=fields.pop("strategy", "mopar"),
        memory_source=fields.pop("memory_source", "test"),
        functions=tuple(functions),
        edges=tuple(edges),
        **fields,
    )


def groups_at(names: list[str], cuts: tuple[int, ...]) -> list[list[str]]:
    bounds = list(zip((0, *cuts), (*cuts, len(names))))
    return [names[lo:hi] for lo, hi in bounds]


HAVE_REDIS = bool(shutil.which("redis-server")) and importlib.util.find_spec("redis") is not None
REDIS_MISSING = (
    "redis-server is not on PATH (make setup installs it from Debian where it runs as root with "
    "apt-get; elsewhere install redis-server yourself)"
)
needs_redis = pytest.mark.skipif(not HAVE_REDIS, reason=REDIS_MISSING)
"""For a test that needs a real redis-server: without one it skips, saying what is missing."""


@pytest.fixture(scope="module")
def redis_url():
    """A private redis-server on 127.0.0.1 for the module's tests (make setup installs it)."""
    from mopar.runner.processes import local_redis

    if not HAVE_REDIS:
        pytest.skip(REDIS_MISSING)
    with local_redis() as url:
        yield url
