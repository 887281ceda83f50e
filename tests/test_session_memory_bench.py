"""The session-memory benchmark (`benchmarks.session_memory`) builds the model it says and reads
a child's memory the way it says; its figures are docs/session-memory.md's, not asserted."""

from __future__ import annotations

import pytest

from benchmarks import session_memory


@pytest.mark.parametrize("op", ["matmul", "conv"])
def test_the_model_holds_the_weights_asked_for_as_external_data(tmp_path, op):
    path = session_memory.build(tmp_path, mb=8, layers=2, op=op)
    weights = (tmp_path / "model.onnx.data").stat().st_size / session_memory.MB
    assert 6 <= weights <= 8  # square layers, channels rounded down to blocks of 16
    assert path.stat().st_size < 64 << 10  # the graph alone: every weight is external


def test_each_setting_loads_and_runs_in_a_child_that_reports_its_memory(tmp_path):
    path = session_memory.build(tmp_path, mb=4, layers=2)
    for entries in session_memory.SETTINGS.values():
        got = session_memory.measure(path, entries, runs=2)
        assert got["peak_mb"] >= got["peak_after_load_mb"] >= got["baseline_mb"] > 0
        assert got["run_ms"] > 0 and got["first_run_ms"] > 0 and got["load_ms"] > 0


def test_a_bundles_function_runs_on_its_example_inputs(tmp_path):
    import numpy as np

    path = session_memory.build(tmp_path, mb=4, layers=2, rows=3)
    d = int(((4 << 20) / 4 / 2) ** 0.5) // 16 * 16
    np.savez(tmp_path / "reference.npz", **{"input.x": np.ones((3, d), np.float32)})
    got = session_memory.measure(path, {}, runs=2, inputs=tmp_path / "reference.npz")
    assert got["peak_mb"] >= got["baseline_mb"] > 0 and got["run_ms"] > 0
