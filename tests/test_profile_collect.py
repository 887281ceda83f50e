"""mopar profile collect: operator builders, the measuring process, layers, the dataset file."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tests.conftest import mopar
from tools.profiler.collect import CollectConfig, collect
from tools.profiler.dataset import COLUMNS, Dataset
from tools.profiler.measure import MeasureConfig, Prober
from tools.profiler.ops import build_model, make_inputs, make_sample
from tools.profiler.sweep import QUICK, SWEEP, sweep

# Few, short timing loops: these tests check behaviour, never speed.
FAST = MeasureConfig(min_runs=2, max_runs=3, budget_s=0.01, memory_runs=2)


@pytest.fixture(scope="module")
def prober():
    with Prober(FAST) as p:
        yield p


def _measure(prober: Prober, sample, tmp_path: Path):
    path = tmp_path / f"{sample.sample_id}.onnx"
    onnx.save(build_model(sample), str(path))
    return prober.measure_arrays(path, make_inputs(sample))


# --- builders -------------------------------------------------------------------------------------


def test_every_quick_sample_is_valid_onnx_whose_outputs_have_the_declared_shapes():
    samples = list(sweep(limits=QUICK))
    assert {s.op_type for s in samples} == set(SWEEP)
    for s in samples:
        model = build_model(s)  # runs onnx.checker with shape inference
        session = ort.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        outputs = session.run(None, make_inputs(s))
        assert [o.shape for o in outputs] == [t.shape for t in s.outputs], s


def test_sweep_is_deterministic_unique_and_within_its_limits():
    first = [s.sample_id for s in sweep(limits=QUICK)]
    assert first == [s.sample_id for s in sweep(limits=QUICK)]
    assert len(set(first)) == len(first)
    for s in sweep(limits=QUICK):
        assert s.flops <= QUICK.max_flops and s.param_bytes <= QUICK.max_param_bytes
    assert [s.sample_id for s in sweep(["gemm"], limits=QUICK)] == [
        s.sample_id for s in sweep(limits=QUICK) if s.op_type == "gemm"
    ]


def test_sample_counts_follow_the_builder_formulas():
    conv = make_sample(
        "conv",
        "depthwise",
        {"batch": 1, "cin": 8, "cout": 8, "groups": 8, "size": 10, "kernel": 3, "stride": 1},
    )
    assert conv.family == "depthwise_conv" and conv.params == 8 * 9 + 8
    assert conv.flops == 2 * (8 * 10 * 10) * 9 and conv.bytes_in == conv.bytes_out == 8 * 100 * 4
    gemm = make_sample("gemm", "2d", {"batch": 2, "in_features": 3, "out_features": 5})
    assert (gemm.params, gemm.param_bytes, gemm.flops) == (20, 80, 2 * 2 * 5 * 3)


# --- measurement ----------------------------------------------------------------------------------


def test_the_probe_process_resets_its_peak_and_never_imports_torch(prober, tmp_path):
    relu = make_sample("elementwise", "relu", {"rank": 3, "batch": 1, "seq": 4, "channels": 16})
    _measure(prober, relu, tmp_path)
    assert prober.ready["torch"] is False
    assert prober.ready["clear_refs"] is True
    assert prober.method == "clear_refs"


@pytest.mark.parametrize(
    "op,variant,config",
    [
        (
            "conv",
            "regular",
            {"batch": 1, "cin": 16, "cout": 32, "groups": 1, "size": 32, "kernel": 3, "stride": 1},
        ),
        ("gemm", "2d", {"batch": 4, "in_features": 256, "out_features": 256}),
    ],
)
def test_a_tiny_conv_and_matmul_measure_positive_memory_and_time(
    prober, tmp_path, op, variant, config
):
    m = _measure(prober, make_sample(op, variant, config), tmp_path)
    assert m.memory_bytes > 0 and m.load_bytes > 0
    assert m.time_ms_nt > 0 and m.time_ms_1t > 0
    assert m.runs_nt >= FAST.memory_runs and m.runs_1t >= FAST.min_runs


def test_measured_memory_grows_with_the_weights(prober, tmp_path):
    small = make_sample("gemm", "2d", {"batch": 1, "in_features": 512, "out_features": 512})  # 1 MB
    large = make_sample("gemm", "2d", {"batch": 1, "in_features": 4096, "out_features": 4096})
    # 64 MB of weights against 1 MB
    assert large.param_bytes - small.param_bytes > 60 << 20
    got_small = _measure(prober, small, tmp_path)
    got_large = _measure(prober, large, tmp_path)
    assert got_large.memory_bytes - got_small.memory_bytes > 50 << 20


def test_a_model_that_fails_to_load_is_an_error_and_the_next_one_still_measures(prober, tmp_path):
    from tools.profiler.measure import MeasureError

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    with pytest.raises(MeasureError):
        prober.measure(bad, {})
    sample = make_sample("softmax", "last_axis", {"batch": 1, "rows": 4, "cols": 8})
    assert _measure(prober, sample, tmp_path).memory_bytes >= 0


# --- collect --------------------------------------------------------------------------------------


def test_collect_quick_writes_a_csv_and_a_second_run_skips_every_row(tmp_path):
    from mopar.profile.features import feature_vector

    out = tmp_path / "dataset.csv"
    args = (
        "profile",
        "collect",
        "--quick",
        "--ops",
        "conv,gemm,embedding",
        "--no-models",
        "--out",
        out,
        "--json",
    )
    first = mopar(*args)
    assert first.returncode == 0, first.stderr
    summary = json.loads(first.stdout)
    expected = len(list(sweep(["conv", "gemm", "embedding"], limits=QUICK)))
    assert (summary["written"], summary["skipped"], summary["failed"]) == (expected, 0, 0)
    assert set(summary["by_op"]) == {"conv", "gemm", "embedding"}
    with open(out, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == COLUMNS and len(rows) == expected
    for row in rows:
        assert int(row["memory_bytes"]) > 0 and float(row["time_ms_1t"]) > 0
        assert row["error"] == "" and row["ort_version"] == ort.__version__
        assert np.isfinite(feature_vector(row)).all()

    second = mopar(*args)
    assert second.returncode == 0, second.stderr
    again = json.loads(second.stdout)
    assert (again["written"], again["skipped"]) == (0, expected)
    assert out.read_text().count("\n") == expected + 1


def test_collect_measures_the_layers_of_a_tiny_example_and_stops_at_the_limit(tmp_path):
    out = tmp_path / "layers.csv"
    config = CollectConfig(out=out, quick=True, ops=(), models=("gcn",), limit=3, measure=FAST)
    summary = collect(config)
    assert summary.limited and summary.written == 3 and summary.failed == 0
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["layer_index"] for r in rows] == ["0", "1", "2"]
    for row in rows:
        assert (row["source"], row["op_type"], row["model"], row["model_family"]) == (
            "layer",
            "layer",
            "gcn",
            "gcn",
        )
        assert row["family"] and int(row["memory_bytes"]) > 0 and json.loads(row["onnx_ops"])
    assert any(r["family"] == "gemm" for r in rows)


def test_a_dataset_cut_mid_row_is_repaired_and_one_with_other_columns_is_refused(tmp_path):
    from mopar.errors import MoparError

    path = tmp_path / "d.csv"
    ds = Dataset(path)
    ds.append({"sample_id": "a", "source": "op", "op_type": "conv"})
    with open(path, "a") as f:
        f.write("b,op,con")  # a run killed while writing
    assert Dataset(path).done == {"a"}
    assert path.read_text().endswith("\n")

    other = tmp_path / "other.csv"
    other.write_text("x,y\n1,2\n")
    with pytest.raises(MoparError, match="new --out"):
        Dataset(other)


def test_an_unknown_op_is_a_one_line_user_error(tmp_path):
    proc = mopar("profile", "collect", "--ops", "convolution3000", "--out", tmp_path / "x.csv")
    assert proc.returncode == 1
    assert "unknown op 'convolution3000'" in proc.stderr and "Traceback" not in proc.stderr
