"""Train and report on a tiny real sweep; compile then plans with the trained predictors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mopar.profile.features import Roofline, feature_matrix
from tests.conftest import mopar, mopar_in_process
from tools.profiler.train import Samples, fit_roofline

REPORT_KEYS = {
    "memory_rmsle",
    "memory_underestimate_rate",
    "layer_memory_rmsle",
    "time_mape",
    "time_within_10pct",
    "time_mape_by_op",
    "slice_memory_rel_err",
    "slice_time_rel_err",
    "models",
    "baselines",
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profiles")
    collect = mopar(
        "profile",
        "collect",
        "--quick",
        "--ops",
        "conv,gemm,softmax,elementwise",
        "--models",
        "gcn",
        "--out",
        folder / "dataset.csv",
        "--json",
    )
    assert collect.returncode == 0, collect.stderr
    train = mopar(
        "profile", "train", "--dataset", folder / "dataset.csv", "--out", folder, "--json"
    )
    assert train.returncode == 0, train.stderr
    return folder, json.loads(train.stdout)


@pytest.mark.slow  # the lab's collect -> train -> plan; the shipped predictors plan every default test
def test_training_writes_versioned_predictors_with_a_margin_of_at_least_one(trained):
    folder, summary = trained
    meta = json.loads((folder / "predictors.json").read_text())
    assert meta["format_version"] == 3 and meta["weight_copies"] > 0
    assert all(meta["roofline"][k] > 0 for k in ("flops_per_ms", "bytes_per_ms"))
    assert summary["roofline"] == meta["roofline"]
    assert meta["samples"] == summary["samples"] > 10
    assert summary["memory_margin"] >= 1.0
    assert {"cpu", "cores", "onnxruntime", "torch", "xgboost", "date"} <= set(meta["machine"])
    assert (folder / "memory.json").is_file() and (folder / "time.json").is_file()


@pytest.mark.slow  # the lab's collect -> train -> plan; the shipped predictors plan every default test
def test_report_json_has_the_documented_keys(trained, skipnet_bundle):
    folder, _ = trained
    run = mopar("profile", "report", "--profiles", folder, "--bundle", skipnet_bundle, "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert REPORT_KEYS <= set(report)
    assert set(report["baselines"]) == {"lr", "rf"}
    assert set(report["models"]) == {"gcn"}
    assert report["models"]["gcn"]["time_mape"] >= 0
    assert report["time_mape_by_op"] and all(v >= 0 for v in report["time_mape_by_op"].values())
    assert {"conv", "gemm", "softmax"} <= set(report["memory_rmsle"])
    assert 0.0 <= report["memory_underestimate_rate"] <= 1.0
    assert report["slices"] == 3
    assert report["slice_memory_rel_err"] >= 0


def _samples(rows):
    return Samples(
        rows=tuple({} for _ in rows),
        x=feature_matrix([r for r, _ in rows]),
        memory_mb=np.ones(len(rows)),
        weights_mb=np.zeros(len(rows)),
        time_ms=np.array([t for _, t in rows]),
        family=np.array(["gemm"] * len(rows)),
        model_family=np.array([""] * len(rows)),
    )


def test_the_roofline_fit_recovers_a_machine_that_follows_one():
    truth = Roofline(flops_per_ms=5e7, bytes_per_ms=2e6, overhead_ms=0.01)
    rng = np.random.default_rng(0)
    rows = []
    for flops, moved in zip(10 ** rng.uniform(4, 9, 200), 10 ** rng.uniform(3, 8, 200)):
        row = {"op_type": "gemm", "flops": flops, "bytes_in": moved}
        rows.append((row, float(truth.time_ms(flops, moved))))
    fitted = fit_roofline(_samples(rows))
    assert fitted.flops_per_ms == pytest.approx(truth.flops_per_ms, rel=0.05)
    assert fitted.bytes_per_ms == pytest.approx(truth.bytes_per_ms, rel=0.05)
    assert fitted.overhead_ms == truth.overhead_ms


@pytest.mark.slow  # the lab's collect -> train -> plan; the shipped predictors plan every default test
def test_plan_uses_the_trained_predictors(trained):
    folder, _ = trained
    run = mopar(
        "plan",
        "tests.models:skipnet",
        "--input",
        "x=1x3x8x8:float32",
        "--profiles",
        folder,
        "--json",
    )
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    assert plan["memory_source"].startswith("predicted")
    assert all(s["time_ms"] > 0 for s in plan["functions"])


def test_a_report_without_predictors_says_how_to_train_them(tmp_path):
    run = mopar_in_process("profile", "report", "--profiles", tmp_path)
    assert run.returncode == 1
    assert "mopar profile train" in run.stderr
