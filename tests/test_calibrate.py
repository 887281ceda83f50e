"""mopar profile calibrate: real transports measured end to end (`tools.profiler.calibrate`), the
fit, the profile file and its reader (`mopar.profile.calibrate`).

These tests check behaviour, never speed: no figure is compared with a number of milliseconds.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from mopar.config import PROFILES_DIR
from mopar.profile.calibrate import (
    CalibrationError,
    load_transports,
    measured_transports,
    transfer_ms,
)
from tests.conftest import HAVE_REDIS, MOPAR, REDIS_MISSING, ROOT, mopar, pid_alive
from tools.profiler import calibrate as calibrate_module
from tools.profiler.calibrate import QUICK, calibrate, fit_transfer

KEYS = {"format_version", "transports", "hop_ms", "runtime_baseline_mb", "measured", "notes"}


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """``mopar profile calibrate --quick --json --out P``, run once: what it printed, and P."""
    out = tmp_path_factory.mktemp("calibrate") / "p"
    return mopar("profile", "calibrate", "--quick", "--json", "--out", out), out


@pytest.fixture(scope="module")
def profile(cli_run) -> dict:
    result, out = cli_run
    assert result.returncode == 0, result.stderr
    return load_transports(out)


@pytest.fixture
def work_dirs(monkeypatch):
    """The /dev/shm folders calibrations make while the test runs."""
    made: list[Path] = []
    real = calibrate_module.tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):
        made.append(Path(real(*args, **kwargs)))
        return str(made[-1])

    monkeypatch.setattr(calibrate_module.tempfile, "mkdtemp", mkdtemp)
    return made


def _no_children() -> list[str]:
    return [
        " ".join(p.cmdline())
        for p in psutil.Process().children(recursive=True)
        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    ]


# --- measuring ------------------------------------------------------------------------------------


@pytest.mark.slow  # a calibration; the failure-midway, shipped-profile and fit tests cover it
def test_quick_calibration_gives_positive_finite_figures_for_shm_and_http(profile):
    assert set(profile) == KEYS
    for name in ("shm", "http"):
        entry = profile["transports"][name]
        assert entry["measured"] is True
        assert math.isfinite(entry["latency_ms"]) and entry["latency_ms"] > 0
        assert math.isfinite(entry["mb_per_s"]) and entry["mb_per_s"] > 0
        assert [n for n, _ in entry["points"]] == list(QUICK.sizes_bytes)
        assert all(math.isfinite(ms) and ms > 0 for _, ms in entry["points"])
    assert profile["hop_ms"] > 0 and profile["runtime_baseline_mb"] > 0
    assert profile["measured"]["command"] == "mopar profile calibrate --quick"


@pytest.mark.slow  # a calibration; the failure-midway, shipped-profile and fit tests cover it
def test_redis_is_measured_when_redis_server_is_installed(profile):
    if not HAVE_REDIS:
        pytest.skip(REDIS_MISSING)
    entry = profile["transports"]["redis"]
    assert entry["measured"] is True
    assert math.isfinite(entry["mb_per_s"]) and entry["mb_per_s"] > 0
    assert measured_transports(profile) == ("shm", "http", "redis")


def test_without_redis_server_the_profile_says_why_instead_of_guessing(monkeypatch, work_dirs):
    monkeypatch.setenv("PATH", "/nonexistent")  # children run sys.executable, an absolute path
    got = calibrate(replace(QUICK, transports=("redis",), hop_requests=1, baseline_runs=1))
    assert got["transports"]["redis"]["measured"] is False
    assert "redis-server" in got["transports"]["redis"]["reason"]
    assert measured_transports(got) == ()
    with pytest.raises(CalibrationError, match="redis-server is not on PATH"):
        transfer_ms(got, "redis", 1024)


def test_a_failure_midway_leaves_no_child_process_and_no_shm_folder(work_dirs):
    def fail_at_http(phase: str, done: int, total: int) -> None:
        if phase == "http":  # the HTTP server and the worker are up by now
            raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        calibrate(replace(QUICK, baseline_runs=1), progress=fail_at_http)
    assert _no_children() == []
    assert work_dirs and not any(d.exists() for d in work_dirs)


def test_a_calibration_past_its_time_limit_stops_with_a_clear_error(work_dirs):
    with pytest.raises(CalibrationError, match=r"ran past its 0.2 s limit; rerun with --quick"):
        calibrate(replace(QUICK, timeout_s=0.2))
    assert _no_children() == []
    assert not any(d.exists() for d in work_dirs)


@pytest.mark.slow  # the failure-midway test covers the children
@pytest.mark.skipif(not HAVE_REDIS, reason=REDIS_MISSING)
def test_a_killed_calibration_leaves_no_redis_server_behind(tmp_path):
    err = tmp_path / "stderr"
    with open(err, "w") as f:
        proc = subprocess.Popen(
            [MOPAR, "profile", "calibrate", "--quick", "--out", tmp_path],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=f,
        )
    seen: dict[int, list[str]] = {}
    deadline = time.monotonic() + 60
    while not any(cmd and "redis-server" in cmd[0] for cmd in seen.values()):
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            children = []
        for child in children:
            try:
                seen[child.pid] = child.cmdline()
            except psutil.Error:  # a finished baseline process is a zombie until reaped
                pass
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"redis-server never started: {err.read_text()[-1000:]}")
        time.sleep(0.02)
    proc.kill()  # SIGKILL: no finally: block runs, so only PR_SET_PDEATHSIG can stop redis-server
    proc.wait()
    try:
        end = time.monotonic() + 10
        while time.monotonic() < end and any(pid_alive(p) for p in seen):
            time.sleep(0.05)
        assert [seen[p][0] for p in seen if pid_alive(p)] == []
    finally:  # a SIGKILLed parent removes nothing: its /dev/shm folder is ours to remove
        for arg in (a for cmd in seen.values() for a in cmd if a.startswith("/dev/shm/mopar-cal")):
            shutil.rmtree(Path("/dev/shm", Path(arg).parts[3]), ignore_errors=True)


# --- the fit and the planner's reader -------------------------------------------------------------


def test_fit_recovers_the_latency_and_bandwidth_of_an_exact_line():
    points = [(n, 0.5 + n / (800 * 2**20) * 1e3) for n in (1024 << k for k in range(0, 17, 2))]
    fit = fit_transfer(points)
    assert fit.latency_ms == pytest.approx(0.5)
    assert fit.mb_per_s == pytest.approx(800)
    assert fit.max_rel_err == pytest.approx(0, abs=1e-9)


def test_fit_refuses_fewer_than_two_sizes():
    with pytest.raises(CalibrationError, match="two or more sizes"):
        fit_transfer([(1024, 1.0), (1024, 1.1)], "shm")


@pytest.mark.slow  # a calibration; the failure-midway, shipped-profile and fit tests cover it
def test_transfer_ms_is_monotone_in_bytes(profile):
    sizes = [0, 1, 1000, 1 << 20, 5 << 20, 1 << 30, 1 << 34]
    for name in measured_transports(profile):
        times = [transfer_ms(profile, name, n) for n in sizes]
        assert times == sorted(times) and times[0] == profile["transports"][name]["latency_ms"]


def test_the_shipped_profile_loads_and_has_shm_and_http():
    shipped = load_transports(PROFILES_DIR)
    assert {"shm", "http"} <= set(measured_transports(shipped))
    assert shipped["measured"]["command"] == "mopar profile calibrate"


# --- the file and the command -------------------------------------------------------------------


@pytest.mark.slow  # a calibration; the failure-midway, shipped-profile and fit tests cover it
def test_cli_writes_the_profile_file_and_prints_the_same_json(cli_run, profile):
    result, out = cli_run
    assert json.loads(result.stdout) == profile
    assert set(profile) == KEYS
    assert {"machine", "date", "onnxruntime", "command"} <= set(profile["measured"])
    assert [p.name for p in out.iterdir()] == ["transports.json"]  # no temp file


def test_cli_refuses_an_unwritable_out_folder_before_measuring():
    result = mopar("profile", "calibrate", "--quick", "--out", "/proc/no-such-folder")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: cannot create --out '/proc/no-such-folder' (No such "
        "file or directory); pass a writable folder"
    )


@pytest.mark.parametrize(
    "content, problem",
    [
        ("{not json", "cannot be read"),
        ("[]", "format version None"),
        ('{"format_version": 2}', "format version 2"),
        (
            '{"format_version": 1, "transports": {"shm": {"measured": true, "latency_ms": 0.1, '
            '"mb_per_s": -5}}, "hop_ms": 0.1, "runtime_baseline_mb": 40}',
            "mb_per_s -5",
        ),
        ('{"format_version": 1, "transports": {"shm": 3}}', "expected an object of objects"),
        (
            '{"format_version": 1, "transports": {}, "hop_ms": "fast", "runtime_baseline_mb": 1}',
            "'hop_ms' is 'fast'",
        ),
    ],
)
def test_a_corrupt_transports_file_is_refused_naming_the_file_and_the_fix(
    tmp_path, content, problem
):
    path = tmp_path / "transports.json"
    path.write_text(content)
    with pytest.raises(CalibrationError) as info:
        load_transports(tmp_path)
    message = str(info.value)
    assert problem in message and str(path) in message
    assert "rerun `mopar profile calibrate --out DIR`" in message and "\n" not in message


def test_a_missing_transports_file_is_refused(tmp_path):
    with pytest.raises(CalibrationError, match="cannot be read"):
        load_transports(tmp_path / "nowhere.json")
