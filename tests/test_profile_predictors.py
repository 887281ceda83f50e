"""Predictors: deterministic training and prediction, versioned storage, clear refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mopar.profile.features import (
    FEATURE_NAMES,
    TIME_FEATURE_NAMES,
    Roofline,
    param_mb,
    time_features,
)
from mopar.profile.store import (
    ProfileError,
    load_predictors,
    planned_transient_mb,
    save_predictors,
    transient_mb,
)
from tools.profiler.predict import TrainConfig, asymmetric_squared_log_error, fit_xgb, learn_margin

FAST = TrainConfig(rounds=30, max_depth=3)
ROOF = Roofline(flops_per_ms=1e8, bytes_per_ms=1e7, overhead_ms=0.01)


def _data(n: int = 200, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 5, size=(n, len(FEATURE_NAMES)))
    y = 0.5 * x[:, 0] + 0.2 * x[:, 1] + rng.normal(0, 0.05, n)
    return x, y


@pytest.fixture()
def saved(tmp_path):
    x, y = _data()
    memory, time = fit_xgb(x, y, FAST), fit_xgb(time_features(x, ROOF), 0.5 * y, FAST)
    save_predictors(
        tmp_path,
        memory,
        time,
        feature_names=FEATURE_NAMES,
        memory_margin=1.2,
        weight_copies=2.0,
        roofline=ROOF,
        extra={"samples": len(y)},
    )
    return tmp_path, x


def test_the_objective_penalises_under_estimates_more_than_over_estimates():
    import xgboost as xgb

    labels = np.array([1.0, 1.0])
    grad, hess = asymmetric_squared_log_error(4.0)(
        np.array([0.5, 1.5]), xgb.DMatrix(np.zeros((2, 1)), label=labels)
    )
    assert grad[0] == pytest.approx(-4.0) and grad[1] == pytest.approx(1.0)
    assert hess.tolist() == [8.0, 2.0]


def test_the_asymmetric_objective_under_estimates_less_often_than_plain_squared_error():
    x, y = _data(400)
    rng = np.random.default_rng(1)
    noisy = y + rng.normal(0, 0.3, len(y))
    import xgboost as xgb

    asym = fit_xgb(x, noisy, FAST).predict(xgb.DMatrix(x))
    plain = fit_xgb(x, noisy, TrainConfig(rounds=30, max_depth=3, under_weight=1.0)).predict(
        xgb.DMatrix(x)
    )
    assert np.mean(asym < noisy) < np.mean(plain < noisy)


def test_training_and_prediction_are_deterministic(saved):
    folder, x = saved
    a = load_predictors(folder, feature_names=FEATURE_NAMES)
    b = load_predictors(folder, feature_names=FEATURE_NAMES)
    np.testing.assert_array_equal(a.predict_memory_mb(x), b.predict_memory_mb(x))
    x2, y2 = _data()
    import xgboost as xgb

    again = fit_xgb(x2, y2, FAST).predict(xgb.DMatrix(x))
    # the weights exactly, twice (weight_copies); the margin only on the predicted transient
    planned = 2.0 * param_mb(x) + np.maximum(1.2 * (np.expm1(again) + 1.0) - 1.0, 0.0)
    np.testing.assert_allclose(a.predict_memory_mb(x), planned, rtol=1e-6)


def test_the_margin_does_not_scale_the_weights():
    assert planned_transient_mb(np.array([0.0, 10.0]), 3.0).tolist() == [2.0, 32.0]
    assert transient_mb(np.array([300.0, 100.0]), np.array([131.0, 60.0]), 2.0).tolist() == [
        38.0,
        0.0,
    ]


def test_time_is_the_roofline_times_the_learned_ratio(saved):
    folder, x = saved
    loaded = load_predictors(folder, feature_names=FEATURE_NAMES)
    assert loaded.roofline == ROOF
    import xgboost as xgb

    z = time_features(x, ROOF)
    ratio = loaded.time.predict(xgb.DMatrix(z))
    np.testing.assert_allclose(
        loaded.predict_time_ms(x),
        np.exp(ratio)
        * ROOF.time_ms(
            np.expm1(x[:, FEATURE_NAMES.index("log1p_flops")]),
            sum(
                np.expm1(x[:, FEATURE_NAMES.index(f"log1p_{k}")])
                for k in ("bytes_in", "bytes_out", "param_bytes")
            ),
        ),
        rtol=1e-6,
    )


def test_the_margin_covers_the_chosen_quantile():
    measured = np.linspace(1, 100, 100)
    predicted = measured / np.linspace(0.8, 1.3, 100)
    margin = learn_margin(measured, predicted, 0.9)
    assert np.mean(predicted * margin >= measured) >= 0.9
    assert learn_margin(measured, measured * 2, 0.99) == 1.0


def _other_version(meta):
    meta["format_version"] = 99


def _version_1(meta):
    meta["format_version"] = 1
    del meta["roofline"], meta["time_feature_names"]


def _no_roofline(meta):
    del meta["roofline"]


def _other_time_features(meta):
    meta["time_feature_names"] = list(TIME_FEATURE_NAMES[:-1])


@pytest.mark.parametrize(
    "edit, message",
    [
        (_other_version, "format version 99.*mopar profile collect"),
        (_version_1, "format version 1, this mopar reads 3.*profile train"),
        (_no_roofline, "no usable roofline"),
        (_other_time_features, "other features"),
    ],
    ids=[
        "another format version",
        "version 1 without a roofline",
        "no roofline",
        "other time features",
    ],
)
def test_stale_or_edited_predictors_are_refused_naming_the_fix(saved, edit, message):
    folder, _ = saved
    meta = json.loads((folder / "predictors.json").read_text())
    edit(meta)
    (folder / "predictors.json").write_text(json.dumps(meta))
    with pytest.raises(ProfileError, match=message):
        load_predictors(folder, feature_names=FEATURE_NAMES)


def test_another_xgboost_major_version_is_refused(saved):
    folder, _ = saved
    meta = json.loads((folder / "predictors.json").read_text())
    meta["machine"]["xgboost"] = "1.7.6"
    (folder / "predictors.json").write_text(json.dumps(meta))
    with pytest.raises(ProfileError, match="xgboost 1.7.6"):
        load_predictors(folder, feature_names=FEATURE_NAMES)


def test_other_features_are_refused(saved):
    folder, _ = saved
    with pytest.raises(ProfileError, match="other features"):
        load_predictors(folder, feature_names=FEATURE_NAMES[:-1])


@pytest.mark.parametrize("victim", ["predictors.json", "memory.json"])
def test_a_corrupt_profile_gets_a_clear_error(saved, victim):
    folder, _ = saved
    (folder / victim).write_text("{ not json")
    with pytest.raises(ProfileError, match="corrupt"):
        load_predictors(folder, feature_names=FEATURE_NAMES)


def test_a_folder_without_predictors_says_how_to_build_them(tmp_path):
    with pytest.raises(ProfileError, match="mopar profile train"):
        load_predictors(tmp_path, feature_names=FEATURE_NAMES)
