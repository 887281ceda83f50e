"""Serving with `mopar run` (shm): the open loop, the search for the highest rate, instances and
their autoscaler, scale to zero and cold starts, the memory limit, and instances that die or hang
mid-run -- each through the real CLI on the 3-slice SkipNet bundle, watching its processes and
its /dev/shm folder.

A misbehaving slice is the bundle's own handler wrapped (`_wrap_handler`): the real one still
computes every answer, so the requests it does serve are checked against the reference, and a
file in the function's folder numbers its calls across instances (the warm-up request is call 1),
so that exactly one request meets the misbehaviour.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
import time
from collections import Counter

import numpy as np
import pytest

from mopar.runner.load import poisson_arrivals
from tests.conftest import (
    HAVE_REDIS,
    REDIS_MISSING,
    faulty,
    mopar,
    new_shm_runs,
    nonblank_lines,
    pid_alive,
    run_watched,
    shm_runs,
)

LOAD_KEYS = {
    "rate_rps",
    "duration_s",
    "offered",
    "completed",
    "dropped",
    "throughput_rps",
    "series",
}
SERIES_KEYS = {"t_s", "requests", "errors", "p50_ms", "p95_ms"}
COLD_KEYS = {"cold_starts", "prewarmed", "prewarm_used", "start_ms_p50", "first_request_ms"}


def _json(watched) -> dict:
    assert "Traceback" not in watched.stderr, watched.stderr[-3000:]
    return json.loads(watched.stdout)


def _cleaned_up(watched, before: set[str]) -> None:
    """The run's shm folder is gone and no slice process outlived the run."""
    assert watched.shm_dirs and not any(os.path.exists(d) for d in watched.shm_dirs)
    assert new_shm_runs(before) == set()
    alive = [pid for pid in watched.workers if pid_alive(pid)]
    assert alive == [], f"slice processes outlived mopar run: {alive}"


def _processes_per_slice(watched) -> dict[str, int]:
    """How many processes with a worker's command line each function had over the run: at
    least its instances, possibly more, since a worker's short-lived fork (ctypes.util.find_library
    runs ldconfig while a slice loads) has that command line until it execs. Exact counts are
    the report's."""
    return dict(Counter(os.path.basename(d) for d in watched.function_dirs))


def _by_name(report: dict) -> dict[str, dict]:
    return {s["name"]: s for s in report["slices"]}


WRAPPER = '''
import os
import pathlib
import signal
import time

import numpy as np

from mopar.runtime.handler import SliceHandler as _Real

CALLS = pathlib.Path(__file__).with_suffix(".calls")


def call_number():
    """This call's number among all instances' calls of this function (from 1)."""
    fd = os.open(CALLS, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(fd, b".")
    os.close(fd)
    return CALLS.stat().st_size


class SliceHandler(_Real):
    def __init__(self, function_dir, *, intra_op_threads=0):
ON_INIT
        super().__init__(function_dir, intra_op_threads=intra_op_threads)

    def handle(self, inputs):
        n = call_number()
ON_CALL
        return super().handle(inputs)
'''


def _wrap_handler(
    bundle, names: tuple[str, ...], *, on_call: str = "pass", on_init: str = "pass"
) -> dict[str, str]:
    """The environment under which the slices ``names`` run mopar's handler wrapped: ``on_init``
    before it loads, ``on_call`` (with ``n``, the call's number) before each call."""
    code = WRAPPER.replace("ON_INIT", textwrap.indent(textwrap.dedent(on_init), " " * 8)).replace(
        "ON_CALL", textwrap.indent(textwrap.dedent(on_call), " " * 8)
    )
    return faulty(bundle.parent / "faults", dict.fromkeys(names, code))


# --- the open loop --------------------------------------------------------------------------------


def test_open_loop_serves_every_arrival_and_reports_the_load(skipnet_bundle):
    before = shm_runs()
    watched = run_watched(
        "load", skipnet_bundle, "--rate", "10", "--duration", "2", "--check", "--json", timeout=60
    )
    assert watched.returncode == 0, watched.stderr
    report = _json(watched)
    arrivals = list(poisson_arrivals(10.0, 2.0, seed=0))  # the CLI's arrivals (seed 0)
    load = report["load"]
    assert set(load) == LOAD_KEYS
    assert (load["rate_rps"], load["duration_s"]) == (10.0, 2.0)
    assert load["offered"] == load["completed"] == report["requests"] == len(arrivals) > 5
    assert report["errors"] == 0 and report["check"]["passed"]
    assert all(s["calls"] == len(arrivals) for s in report["slices"])
    assert 0 < load["throughput_rps"] <= len(arrivals) / 2.0
    p = report["latency_ms"]
    assert p["p99"] is not None and 0 < p["p50"] <= p["p95"] <= p["p99"]
    # one bucket per second of arrivals, covering the duration, each arrival in one of them
    series = load["series"]
    assert [b["t_s"] for b in series] == [0.0, 1.0]
    assert all(set(b) == SERIES_KEYS for b in series)
    assert [b["requests"] for b in series] == [
        sum(k <= t < k + 1 for t in arrivals) for k in range(2)
    ]
    assert all(b["errors"] == 0 for b in series)
    assert "cold" not in report  # nothing could be cold: no --cold, --idle-s or --cold-experts
    # the bill of what it served (openfaas, the plan's target: the instance-seconds reserved)
    assert report["cost_per_1m_usd"] == report["bill"]["cost_per_1m_usd"] > 0
    assert set(report["bill"]["functions"]) == {"s0", "s1", "s2"}
    assert all(len(s["samples_ms"]) == s["calls"] for s in report["slices"])
    assert all(s["instances"] == 1 and s["cold_starts"] == 0 for s in report["slices"])
    assert set(_processes_per_slice(watched)) == {"s0", "s1", "s2"}
    _cleaned_up(watched, before)


def test_arrivals_over_max_in_flight_are_throttled_and_counted_as_errors(skipnet_bundle):
    before = shm_runs()
    watched = run_watched(
        "load",
        skipnet_bundle,
        "--rate",
        "2000",
        "--duration",
        "0.5",
        "--max-in-flight",
        "1",
        "--json",
        timeout=60,
    )
    assert watched.returncode == 1
    report = _json(watched)
    load = report["load"]
    assert report["errors"] > 0 and load["completed"] > 0
    assert load["offered"] == report["requests"] == load["completed"] + report["errors"]
    assert sum(b["errors"] for b in load["series"]) == report["errors"]
    (line,) = nonblank_lines(watched.stderr)
    dropped = load["dropped"]
    assert 0 < dropped <= report["errors"]
    assert line == (
        f"error: {report['errors']} of {report['requests']} requests failed; first: "
        f"throttled: {dropped} arrivals dropped with 1 requests in flight (--max-in-flight)"
    )
    _cleaned_up(watched, before)


@pytest.mark.parametrize("transport", ["http", "redis"])
def test_open_loop_over_the_function_servers(skipnet_bundle, transport):
    if transport == "redis" and not HAVE_REDIS:
        pytest.skip(REDIS_MISSING)
    proc = mopar(
        "load",
        skipnet_bundle,
        "--transport",
        transport,
        "--rate",
        "10",
        "--duration",
        "1.5",
        "--check",
        "--json",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    arrivals = list(poisson_arrivals(10.0, 1.5, seed=0))
    load = report["load"]
    assert load["offered"] == load["completed"] == report["requests"] == len(arrivals)
    assert report["errors"] == 0 and report["check"]["passed"]
    assert [b["requests"] for b in load["series"]] == [
        sum(k <= t < k + 1 for t in arrivals) for k in range(2)
    ]


def test_find_max_rate_over_http(skipnet_bundle):
    proc = mopar(
        "max-rate",
        skipnet_bundle,
        "--transport",
        "http",
        "--slo-ms",
        "5000",
        "--rate",
        "20",
        "--duration",
        "0.3",
        "--max-in-flight",
        "4",
        "--json",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["max_rate_rps"] is not None and out["max_rate_rps"] >= 20
    assert out["report"]["transport"] == "http" and out["report"]["errors"] == 0


# --- the highest rate within an SLO --------------------------------------------------------------


@pytest.mark.slow  # find_max_rate over http covers the search
def test_find_max_rate_with_a_generous_slo_finds_at_least_the_start(skipnet_bundle):
    before = shm_runs()
    # --max-in-flight 4 makes high rates fail by throttling, so the search ends soon
    watched = run_watched(
        "max-rate",
        skipnet_bundle,
        "--slo-ms",
        "5000",
        "--rate",
        "20",
        "--duration",
        "0.3",
        "--max-in-flight",
        "4",
        "--check",
        "--json",
        timeout=120,
    )
    assert watched.returncode == 0, watched.stderr
    out = _json(watched)
    assert set(out) == {"slo_ms", "max_rate_rps", "steps", "report"}
    assert out["slo_ms"] == 5000
    steps = out["steps"]
    assert steps[0]["rate_rps"] == 20 and steps[0]["met"]
    assert steps[1]["rate_rps"] == 40  # doubling first
    for step in steps:
        assert set(step) == {"rate_rps", "p95_ms", "errors", "met"}
        assert step["met"] == (
            step["errors"] == 0 and step["p95_ms"] is not None and step["p95_ms"] <= 5000
        )
    best = out["max_rate_rps"]
    assert best is not None and best >= 20
    assert best == max(s["rate_rps"] for s in steps if s["met"])
    report = out["report"]  # the best step's
    assert report["load"]["rate_rps"] == best
    assert report["errors"] == 0 and report["check"]["passed"]
    assert report["latency_ms"]["p95"] <= 5000
    # one session serves every step: the best step started no instance
    assert all(s["cold_starts"] == 0 for s in report["slices"])
    _cleaned_up(watched, before)


def test_find_max_rate_with_an_impossible_slo_reports_none_and_exits_0(skipnet_bundle):
    watched = run_watched(
        "max-rate",
        skipnet_bundle,
        "--slo-ms",
        "0.001",
        "--rate",
        "5",
        "--duration",
        "0.3",
        "--json",
        timeout=60,
    )
    assert watched.returncode == 0, watched.stderr
    out = _json(watched)
    assert out["max_rate_rps"] is None and out["report"] is None
    steps = out["steps"]
    assert steps[0]["rate_rps"] == 5 and not any(s["met"] for s in steps)
    assert all(s["rate_rps"] < 5 for s in steps[1:])  # bisection below the start, not doubling


# --- instances and the autoscaler -----------------------------------------------------------------


@pytest.mark.parametrize("instances", [3, 1])
def test_the_autoscaler_starts_instances_under_load_up_to_the_cap(skipnet_bundle, instances):
    before = shm_runs()
    # ~100 arrivals, under --max-in-flight's 256 even while new instances start
    watched = run_watched(
        "load",
        skipnet_bundle,
        "--rate",
        "100",
        "--duration",
        "1",
        "--instances",
        str(instances),
        "--check",
        "--json",
        timeout=90,
    )
    assert watched.returncode == 0, watched.stderr
    report = _json(watched)
    assert report["errors"] == 0 and report["check"]["passed"]
    seen = _processes_per_slice(watched)
    most = {s["name"]: s["instances"] for s in report["slices"]}
    assert all(seen[name] >= n for name, n in most.items()), (seen, most)
    if instances == 1:
        assert most == {"s0": 1, "s1": 1, "s2": 1}
    else:
        assert all(1 <= n <= instances for n in most.values()), most
        assert max(most.values()) > 1, most
    # no instance stops without --idle-s, so every one started is counted in the most at once
    # (never over the cap), and each past the first is a cold start, timed
    for s in report["slices"]:
        assert s["cold_starts"] == s["instances"] - 1
        assert (s["cold_start_ms"] is None) == (s["cold_starts"] == 0)
        assert s["instance_s"] > 0
    _cleaned_up(watched, before)


def test_idle_instances_scale_to_zero_and_the_next_request_cold_starts(skipnet_bundle):
    before = shm_runs()
    # arrivals 0.5 s apart on average: instances idle past 0.2 s and are stopped
    watched = run_watched(
        "load",
        skipnet_bundle,
        "--rate",
        "2",
        "--duration",
        "2",
        "--idle-s",
        "0.2",
        "--check",
        "--json",
        timeout=90,
    )
    assert watched.returncode == 0, watched.stderr
    report = _json(watched)
    assert report["errors"] == 0 and report["check"]["passed"]
    assert report["requests"] == len(list(poisson_arrivals(2.0, 2.0, seed=0)))
    cold = report["cold"]
    assert set(cold) == COLD_KEYS
    assert cold["cold_starts"] > 0
    started = sum(s["cold_starts"] for s in report["slices"])
    assert started == cold["cold_starts"] + cold["prewarmed"]  # by a request or a pre-warm-up
    assert cold["first_request_ms"] is None  # not --cold: the first request found it warm
    # the three warm instances, then every instance a request or a pre-warm-up started again
    assert len(watched.workers) >= 3 + cold["cold_starts"] + cold["prewarmed"]
    _cleaned_up(watched, before)


# --- cold starts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prewarm", [True, False], ids=["prewarm", "no-prewarm"])
def test_cold_first_request_with_and_without_prewarm(skipnet_bundle, prewarm):
    before = shm_runs()
    watched = run_watched(
        "run",
        skipnet_bundle,
        "--cold",
        "--prewarm" if prewarm else "--no-prewarm",
        "--requests",
        "3",
        "--check",
        "--json",
        timeout=60,
    )
    assert watched.returncode == 0, watched.stderr
    report = _json(watched)
    assert (report["requests"], report["errors"]) == (3, 0)  # the first is measured: no warm-up
    assert report["check"]["passed"]
    cold = report["cold"]
    assert set(cold) == COLD_KEYS
    assert cold["first_request_ms"] is not None and cold["first_request_ms"] > 0
    # prewarm: the entry s0 is started by the request, s1 and s2 at once beside it
    assert cold["prewarmed"] == (2 if prewarm else 0)
    assert cold["prewarm_used"] == cold["prewarmed"]
    assert cold["cold_starts"] == (1 if prewarm else 3)
    for s in report["slices"]:
        assert (s["cold_starts"], s["instances"], s["calls"]) == (1, 1, 3)
    _cleaned_up(watched, before)


def test_a_prewarmed_instance_slower_to_start_than_idle_s_is_kept_for_its_request(bundle_copy):
    """Its idle time counts from when it is ready, not from its spawn: every slice takes 1.5 s to
    load here, longer than --idle-s 1, and the pre-warmed s1 and s2 still serve the request that
    started them."""
    env = _wrap_handler(bundle_copy, ("s0", "s1", "s2"), on_init="time.sleep(1.5)")
    watched = run_watched(
        "run",
        bundle_copy,
        "--cold",
        "--idle-s",
        "1",
        "--requests",
        "2",
        "--check",
        "--json",
        timeout=60,
        env=env,
    )
    assert watched.returncode == 0, watched.stderr
    report = _json(watched)
    assert report["errors"] == 0 and report["check"]["passed"]
    cold = report["cold"]
    assert (cold["prewarmed"], cold["prewarm_used"], cold["cold_starts"]) == (2, 2, 1)
    # none was stopped and started again
    assert [s["cold_starts"] for s in report["slices"]] == [1, 1, 1]


# --- instances that die ---------------------------------------------------------------------------


def test_enforce_memory_kills_an_instance_over_its_allocation_and_serving_goes_on(bundle_copy):
    # s1's 3rd call (the 2nd measured request) allocates 300 MB and holds it
    env = _wrap_handler(
        bundle_copy,
        ("s1",),
        on_call="""
        if n == 3:
            ballast = np.ones(300 << 20, np.uint8)
            time.sleep(10)
        """,
    )
    before = shm_runs()
    start = time.monotonic()
    watched = run_watched(
        "run",
        bundle_copy,
        "--enforce-memory",
        "--requests",
        "6",
        "--check",
        "--json",
        timeout=90,
        env=env,
    )
    assert time.monotonic() - start < 60
    assert watched.returncode == 1
    report = _json(watched)
    s1 = _by_name(report)["s1"]
    (line,) = nonblank_lines(watched.stderr)
    m = re.match(
        r"error: 1 of 6 requests failed; first: s1: killed for memory: peak ([\d.]+) MB "
        rf"over its {s1['allocated_mb']} MB allocation; ",
        line,
    )
    assert m, line
    assert float(m.group(1)) > s1["allocated_mb"]  # killed once over, however little
    assert (report["requests"], report["errors"]) == (6, 1)
    assert report["oom_kills"] == s1["oom_kills"] == 1
    assert [s["oom_kills"] for s in report["slices"]] == [0, 1, 0]
    # the next request started a new instance, and the other five were served right
    assert (
        report["check"]["worst_ratio"] <= 1
    )  # the answered requests match (the run, with a failure, did not pass)
    assert (s1["calls"], s1["cold_starts"]) == (5, 1)
    assert _by_name(report)["s2"]["calls"] == 5
    assert [s["cold_starts"] for s in report["slices"]] == [0, 1, 0]  # s1's new instance
    assert _processes_per_slice(watched)["s1"] >= 2
    _cleaned_up(watched, before)


def test_an_instance_killed_mid_request_fails_only_that_request(bundle_copy):
    env = _wrap_handler(
        bundle_copy,
        ("s1",),
        on_call="""
        if n == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        """,
    )
    before = shm_runs()
    watched = run_watched(
        "run", bundle_copy, "--requests", "6", "--check", "--json", timeout=60, env=env
    )
    assert watched.returncode == 1
    report = _json(watched)
    (line,) = nonblank_lines(watched.stderr)
    assert line.startswith(
        "error: 1 of 6 requests failed; first: s1: its instance exited with code -9"
    ), line
    assert (report["requests"], report["errors"]) == (6, 1)
    assert (
        report["check"]["worst_ratio"] <= 1
    )  # the answered requests match (the run, with a failure, did not pass)
    assert _by_name(report)["s1"]["calls"] == 5 and _by_name(report)["s2"]["calls"] == 5
    assert report["oom_kills"] == 0
    assert [s["cold_starts"] for s in report["slices"]] == [0, 1, 0]  # s1's new instance
    assert _processes_per_slice(watched)["s1"] >= 2
    _cleaned_up(watched, before)


def test_a_hung_instance_is_killed_at_the_timeout_and_a_new_one_serves_the_rest(bundle_copy):
    env = _wrap_handler(
        bundle_copy,
        ("s1",),
        on_call="""
        if n == 3:
            time.sleep(120)
        """,
    )
    before = shm_runs()
    start = time.monotonic()
    watched = run_watched(
        "run",
        bundle_copy,
        "--requests",
        "5",
        "--timeout",
        "2",
        "--check",
        "--json",
        timeout=60,
        env=env,
    )
    assert time.monotonic() - start < 45  # the hang is 120 s: it was not waited out
    assert watched.returncode == 1
    report = _json(watched)
    (line,) = nonblank_lines(watched.stderr)
    assert line.startswith(
        "error: 1 of 5 requests failed; first: s1: no answer within 2 s, so its instance was killed"
    ), line
    assert (report["requests"], report["errors"]) == (5, 1)
    assert (
        report["check"]["worst_ratio"] <= 1
    )  # the answered requests match (the run, with a failure, did not pass)
    s1 = _by_name(report)["s1"]
    assert (s1["calls"], s1["cold_starts"]) == (4, 1)
    assert [s["cold_starts"] for s in report["slices"]] == [0, 1, 0]  # s1's new instance
    assert _processes_per_slice(watched)["s1"] >= 2
    _cleaned_up(watched, before)


# --- options refused ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--transport", "http", "--instances", "2"],
            "error: --instances runs with --transport shm only, without --containers (where the kernel "
            "enforces memory); drop one of them",
        ),
        (
            ["--containers", "--enforce-memory"],
            "error: --enforce-memory runs with --transport shm only, without --containers (where the "
            "kernel enforces memory); drop one of them",
        ),
    ],
    ids=["instances-over-http", "enforce-memory-in-containers"],
)
def test_serving_options_that_cannot_run_are_refused_in_one_line(skipnet_bundle, args, message):
    proc = mopar("run", skipnet_bundle, *args, timeout=60)
    assert proc.returncode == 1
    assert nonblank_lines(proc.stderr) == [message]
    assert proc.stdout == ""


@pytest.mark.parametrize(
    "args, where",
    [
        (["--find-max-rate", "--slo-ms", "200"], "--find-max-rate moved from `mopar run`: use "
         "`mopar max-rate BUNDLE --slo-ms MS`"),
        (["--rate", "5", "--find-max-rate"], "--find-max-rate moved from `mopar run`: use "
         "`mopar max-rate BUNDLE --slo-ms MS`"),
        (["--slo-ms", "200"], "--slo-ms moved from `mopar run`: use `mopar max-rate BUNDLE --slo-ms MS`"),
        (["--rate", "nan"], "--rate moved from `mopar run`: use `mopar load BUNDLE --rate RPS` (an "
         "open loop)"),
        (["--duration", "5"], "--duration moved from `mopar run`: use `mopar load BUNDLE --rate RPS "
         "--duration S`"),
        (["--max-in-flight", "5"], "--max-in-flight moved from `mopar run`: use `mopar load BUNDLE "
         "--rate RPS --max-in-flight N`"),
        (["--seed", "1"], "--seed moved from `mopar run`: use `mopar load BUNDLE --rate RPS --seed N`"),
        (["--target", "lambda"], "--target moved from `mopar run`: use `mopar load BUNDLE --rate RPS "
         "--target T` (the bill of an open loop)"),
    ],
    ids=["find-max-rate", "find-max-rate-after-rate", "slo-ms", "rate", "duration", "max-in-flight",
         "seed", "target"],
)  # fmt: skip
def test_run_refuses_an_option_that_moved_in_one_line_naming_where(tmp_path, args, where):
    from click.testing import CliRunner

    from mopar.cli import cli

    result = CliRunner().invoke(cli, ["run", str(tmp_path / "nowhere"), *args])
    assert result.exit_code == 1
    assert result.output == f"error: {where}\n"


def test_max_rate_needs_its_objective(tmp_path):
    from click.testing import CliRunner

    from mopar.cli import cli

    result = CliRunner().invoke(cli, ["max-rate", str(tmp_path)], prog_name="mopar")
    assert result.exit_code == 1
    assert result.output == ("error: Missing option '--slo-ms'. (see `mopar max-rate --help`)\n")


# --- the pieces, without processes -----------------------------------------------------------


def test_poisson_arrivals_have_the_rate_and_stay_within_the_duration():
    from mopar.runner.load import poisson_arrivals

    times = list(poisson_arrivals(200.0, 50.0, seed=3))
    assert times == sorted(times) and 0 < times[0] and times[-1] < 50.0
    assert len(times) / 50.0 == pytest.approx(200.0, rel=0.03)  # 10,000 expected, sd 1 %
    gaps = np.diff(times)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: CV 1


def _steps_for(capacity: float, slo_ms: float, start: float):
    """find_max_rate against a made-up server whose p95 is low below ``capacity`` and high
    above it."""
    from mopar.runner.load import find_max_rate

    return find_max_rate(
        lambda rate: (10.0 if rate <= capacity else 900.0, 0), slo_ms=slo_ms, start=start
    )


def test_find_max_rate_doubles_then_bisects_to_the_capacity():
    best, steps = _steps_for(capacity=70.0, slo_ms=100.0, start=5.0)
    assert [s.rate for s in steps[:6]] == [5, 10, 20, 40, 80, 60]  # doubling, then halving
    assert best <= 70.0 and best >= 70.0 - 80.0 / 2**6  # within the last bisection step
    assert all(s.met == (s.rate <= 70.0) for s in steps)


def test_find_max_rate_counts_a_failed_request_as_a_miss():
    from mopar.runner.load import find_max_rate

    best, steps = find_max_rate(lambda rate: (1.0, 1 if rate > 8 else 0), slo_ms=5.0, start=1.0)
    assert 4.0 <= best <= 8.0 and not any(s.met for s in steps if s.rate > 8)


def test_find_max_rate_below_the_start_bisects_down_and_may_find_none():
    best, steps = _steps_for(capacity=3.0, slo_ms=100.0, start=10.0)
    assert steps[0].rate == 10.0 and not steps[0].met and 2.0 <= best <= 3.0
    assert _steps_for(capacity=-1.0, slo_ms=100.0, start=10.0)[0] is None


def test_load_summary_windows_requests_by_arrival():
    from mopar.config import RunConfig
    from mopar.runner.load import load_summary

    records = [(0.1, 5.0), (0.5, 7.0), (1.2, None), (1.9, 9.0), (2.5, 11.0)]
    summary = load_summary(records, RunConfig(rate=2.0, duration_s=3.0), span_s=3.2)
    assert (summary["offered"], summary["completed"]) == (5, 4)
    assert summary["throughput_rps"] == pytest.approx(4 / 3.2, abs=1e-3)
    assert [(w["requests"], w["errors"]) for w in summary["series"]] == [(2, 0), (2, 1), (1, 0)]
    assert summary["series"][0]["p50_ms"] == 6.0 and summary["series"][1]["p95_ms"] == 9.0


def test_a_worker_keeps_only_its_current_requests_buffers(tmp_path):
    from mopar.runner.shmbuf import BufferPool

    writer, worker = BufferPool(tmp_path), BufferPool(tmp_path)
    for slot in range(4):
        writer.write(f"r0x{slot}-v0.t", np.full(1000, slot, dtype=np.float32))
        assert worker.read(f"r0x{slot}-v0.t")[0] == slot
        worker.keep_only({f"r0x{slot}-v0.t"})
        assert list(worker._files) == [f"r0x{slot}-v0.t"]  # one slot mapped, not four
