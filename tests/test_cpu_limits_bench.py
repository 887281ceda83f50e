"""The arithmetic of the CPU-limit benchmark (`benchmarks.cpu_limits`): threads, the time model
it checks against, its rows and its table. No container starts and no time is measured here."""

from __future__ import annotations

import pytest

from benchmarks.cpu_limits import GOAL, _throttled, intra_op, markdown, modelled_ms, rows


def test_threads_follow_the_whole_vcpus_and_never_fall_below_one():
    assert [intra_op(c) for c in (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.9)] == [1, 1, 1, 1, 1, 2, 3]


def test_the_model_slows_everything_below_one_vcpu_and_only_the_parallel_share_above():
    assert modelled_ms(100.0, 0.8, 1.0) == pytest.approx(100.0)
    assert modelled_ms(100.0, 0.8, 0.25) == pytest.approx(400.0)  # the quota slows it all
    assert modelled_ms(100.0, 0.8, 0.5) == pytest.approx(200.0)
    assert modelled_ms(100.0, 0.8, 2.0) == pytest.approx(20.0 + 40.0)  # Amdahl
    assert modelled_ms(100.0, 0.0, 2.0) == pytest.approx(100.0)


def _run(vcpus: float, median: float, requests: int = 10) -> dict:
    return {
        "vcpus": vcpus,
        "intra_op": intra_op(vcpus),
        "requests": requests,
        "median_ms": median,
        "mean_ms": median + 1.0,
        "throttled": {"periods": 20, "throttled_periods": 5, "throttled_ms": 3.0, "cpu_ms": 900.0},
    }


def _model(*runs: dict, share: float = 0.5) -> dict:
    return {
        "model": "m",
        "load_before": [0.3, 0.2, 0.1],
        "predicted": {"t1_ms": 90.0, "par_ms": 90.0 * share, "share": share},
        "runs": list(runs),
    }


def test_rows_anchor_the_model_at_the_measured_one_vcpu_median():
    got = rows(_model(_run(0.5, 228.0), _run(1.0, 100.0), _run(2.0, 60.0)))
    assert [r["modelled_ms"] for r in got] == [200.0, 100.0, 75.0]
    assert [r["ratio"] for r in got] == [1.14, 1.0, 0.8]
    assert [r["mean_ratio"] for r in got] == [1.145, 1.01, 0.813]
    assert [r["within"] for r in got] == [True, True, False]  # 0.8 is outside 1 - GOAL
    assert got[0]["cpu_ms"] == 90.0  # per request
    assert GOAL == 0.15


def test_without_a_one_vcpu_run_nothing_is_modelled_and_the_table_says_so():
    (row,) = rows(_model(_run(0.5, 230.0)))
    assert "modelled_ms" not in row and "within" not in row
    table = markdown(
        {
            "trial": True,
            "date": "2026-12-01 23:40 UTC",
            "cpu": "cpu",
            "cores": 2,
            "podman": "podman version 4.3.1",
            "requests": 10,
            "warmup": 2,
            "gap_ms": 0.0,
            "models": [_model(_run(0.5, 230.0)), {"model": "x", "error": "compile: boom"}],
        }
    )
    assert table.startswith("TRIAL run, not a measurement")
    lines = table.splitlines()
    assert lines[4].startswith("| m | 0.500 | 0.5 | 1 | 230.0 | 231.0 | 90.0 | - | - | - | - |")
    assert lines[5].startswith("| x | compile: boom |")
    assert {line.count("|") for line in lines[2:]} == {lines[2].count("|")}


def test_throttling_and_cpu_time_are_the_differences_of_two_readings():
    v1 = {"nr_periods": "10", "nr_throttled": "2", "throttled_time": "5000000"}
    after = {"nr_periods": "30", "nr_throttled": "12", "throttled_time": "25000000"}
    got = _throttled(
        {"stat": {**v1, "cpuacct_usage_ns": "1000000000"}},
        {"stat": {**after, "cpuacct_usage_ns": "1500000000"}},
    )
    assert got == {"periods": 20, "throttled_periods": 10, "throttled_ms": 20.0, "cpu_ms": 500.0}
    v2 = _throttled(
        {"stat": {"usage_usec": "1000", "throttled_usec": "0"}},
        {"stat": {"usage_usec": "3000", "throttled_usec": "500"}},
    )
    assert v2["cpu_ms"] == 2.0 and v2["throttled_ms"] == 0.5
