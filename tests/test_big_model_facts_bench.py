"""The big-model facts benches (`benchmarks.threads`, `benchmarks.cold_start`,
`benchmarks.cold_chain`) compute what they say from what they time; their figures are
docs/big-model-facts.md's, not asserted."""

from __future__ import annotations

import shutil

import pytest

from benchmarks import cold_chain, cold_start, session_memory, threads


def test_the_parallel_fraction_is_amdahls_at_two_threads_clipped():
    assert threads.fraction(10.0, 5.0) == pytest.approx(1.0)
    assert threads.fraction(10.0, 7.5) == pytest.approx(0.5)
    assert threads.fraction(10.0, 12.0) == 0.0  # slower at 2: nothing parallel
    assert threads.fraction(10.0, 4.0) == 1.0  # faster than linear: clipped


def test_a_family_model_runs_at_each_thread_count_in_a_pinned_child(tmp_path):
    path = threads.FAMILIES["layer_norm"][1](tmp_path)
    for n in (1, 2):
        got = threads.measure(path, n, seconds=0.05, cpus="0", max_others=99.0, quiet_s=0)
        assert got["ms"] > 0 and got["runs"] >= 5 and got["tries"] == 1


def test_a_line_is_fitted_exactly():
    base, slope = cold_start.fit([(100.0, 350.0), (200.0, 450.0), (400.0, 650.0)])
    assert base == pytest.approx(250.0) and slope == pytest.approx(1.0)


@pytest.mark.skipif(shutil.which("fincore") is None, reason="needs fincore (util-linux)")
def test_eviction_empties_the_page_cache_of_the_weights(tmp_path):
    session_memory.build(tmp_path, mb=8, layers=2)
    data = tmp_path / "model.onnx.data"
    cold_start.read_ms(data)
    assert cold_start.resident_bytes(data) > 0
    cold_start.evict(tmp_path)
    assert cold_start.resident_bytes(data) < data.stat().st_size / 4


def test_a_start_is_timed_by_phase_up_to_its_first_answer(tmp_path):
    session_memory.build(tmp_path, mb=4, layers=2)
    got = cold_start.measure(tmp_path, threads=1, entries=cold_start.SETTINGS["no-prepack"])
    phases = ("interpreter_ms", "import_ms", "session_ms", "first_run_ms")
    assert all(got[k] >= 0 for k in phases)
    assert got["init_ms"] == pytest.approx(
        sum(got[k] for k in phases) - got["warm_run_ms"], abs=0.5
    )
    assert 0 < got["init_cpu_ms"]


def test_the_chain_table_gives_the_ratio_of_the_two_cold_requests():
    def row(mode, first, starts):
        return {
            "mode": mode,
            "load": 0.1,
            "first_request_ms": first,
            "warm_p50_ms": 50.0,
            "start_ms": starts,
            "together_rule_ms": 50.0 + max(starts),
            "sum_rule_ms": 50.0 + sum(starts),
        }

    rows = [
        row("together", 400.0, [300, 350, 200]),
        row("one after another", 900.0, [250, 300, 200]),
    ]
    text = cold_chain.markdown({"date": "d", "cores": 2, "bundle": "B", "rows": rows})
    assert "2.25x" in text and "| together | 400 | 50 | 300, 350, 200 | 400 | 900 |" in text
