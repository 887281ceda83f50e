"""Train the shipped predictors from a measured dataset, and evaluate them honestly.

Read in this order: `load_dataset` (CSV rows -> usable samples), `fit_roofline` (the machine's
roofline, from the operator samples), `train_predictors` (fit memory and time on everything, with
a memory margin learned out-of-fold), then `evaluate` (the accuracy report: per-op
cross-validation and leave-one-model-family-out on example layers, for XGBoost and the two
baselines).

Time is learned as log(time / roofline time) over `TIME_FEATURE_NAMES`: the roofline carries
what FLOPs and bytes explain across families, the trees what it does not (per-family
efficiency, small-op overheads). Memory keeps `FEATURE_NAMES` and log1p(MB).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from mopar.profile.features import (
    Roofline,
    feature_matrix,
    roofline_inputs,
    row_family,
    time_features,
)
from mopar.profile.store import (
    TRANSIENT_FLOOR_MB,
    ProfileError,
    planned_transient_mb,
    transient_mb,
)
from tools.profiler.dataset import read_rows
from tools.profiler.predict import (
    TrainConfig,
    fit_linear,
    fit_rf,
    fit_xgb,
    learn_margin,
    predict_xgb,
)

__all__ = [
    "Samples",
    "Trained",
    "load_dataset",
    "fit_roofline",
    "train_predictors",
    "parallel_fractions",
    "evaluate",
    "MB",
]

MB = float(1 << 20)


@dataclass(frozen=True, kw_only=True)
class Samples:
    """A dataset as arrays.

    Attributes:
        rows: the CSV rows kept (measured, no error).
        x: features, one row per sample, columns `FEATURE_NAMES`.
        memory_mb: measured memory footprint, MB.
        weights_mb: parameter MB of each sample (known exactly, never predicted).
        time_ms: measured time at the default thread count, ms.
        family: op family of each sample (`row_family`).
        model_family: the example family ("cnn", ...) for layer rows, "" for operator sweeps.
    """

    rows: tuple[Mapping[str, Any], ...]
    x: np.ndarray
    memory_mb: np.ndarray
    weights_mb: np.ndarray
    time_ms: np.ndarray
    family: np.ndarray
    model_family: np.ndarray

    @property
    def is_layer(self) -> np.ndarray:
        return self.model_family != ""

    def take(self, mask: np.ndarray) -> Samples:
        return Samples(
            rows=tuple(r for r, m in zip(self.rows, mask) if m),
            x=self.x[mask],
            memory_mb=self.memory_mb[mask],
            weights_mb=self.weights_mb[mask],
            time_ms=self.time_ms[mask],
            family=self.family[mask],
            model_family=self.model_family[mask],
        )


def _float(row: Mapping[str, Any], key: str) -> float:
    try:
        return float(row.get(key) or "nan")
    except ValueError:
        return math.nan


def load_dataset(path: Path) -> Samples:
    """Read a ``mopar profile collect`` CSV; rows with an error or no measurement are dropped."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(
            f"dataset {str(path)!r} does not exist; run `mopar profile collect` first"
        )
    rows = [
        r
        for r in read_rows(path)
        if not r.get("error") and _float(r, "memory_bytes") > 0 and _float(r, "time_ms_nt") > 0
    ]
    if len(rows) < 10:
        raise ProfileError(f"dataset {str(path)!r} has {len(rows)} usable rows; collect more")
    return Samples(
        rows=tuple(rows),
        x=feature_matrix(rows),
        memory_mb=np.array([_float(r, "memory_bytes") / MB for r in rows]),
        weights_mb=np.array([(_float(r, "param_bytes") or 0.0) / MB for r in rows]),
        time_ms=np.array([_float(r, "time_ms_nt") for r in rows]),
        family=np.array([row_family(r) for r in rows]),
        model_family=np.array([r.get("model_family") or "" for r in rows]),
    )


def _folds(n: int, k: int, seed: int) -> list[np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    return [order[i::k] for i in range(k)]


# The roofline search: ln(FLOP/ms) and ln(bytes/ms) from 1e3 (1 MFLOP/s, 1 MB/s) to 1e10 (10
# TFLOP/s, 10 TB/s), a coarse grid then a fine one around its best; overheads in ms.
_LN_RANGE = (math.log(1e3), math.log(1e10))
_OVERHEADS_MS = (0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)


def _roofline_error(
    flops, moved, log_t, ln_p: np.ndarray, ln_b: float, overhead: float
) -> np.ndarray:
    """Median |ln roofline - ln measured| for each peak in ``ln_p`` at one bandwidth."""
    work = np.maximum(flops[None, :] / np.exp(ln_p)[:, None], moved[None, :] / math.exp(ln_b))
    return np.median(np.abs(np.log(np.maximum(overhead + work, 1e-6)) - log_t[None, :]), axis=1)


def fit_roofline(data: Samples) -> Roofline:
    """The roofline that best fits ``data``'s operator samples (all samples when it has none).

    Peak FLOP/ms, bandwidth and overhead minimise the median absolute log error of the
    roofline's time against the measured one: a grid search, robust to the timing noise.
    """
    ops = data.take(~data.is_layer) if (~data.is_layer).any() else data
    flops, moved = roofline_inputs(ops.x)
    log_t = np.log(ops.time_ms)
    best = (math.inf, 0.0, 0.0, 0.0)
    for step, span in ((0.25, None), (0.02, 0.3)):
        if span is None:
            p_grid = b_grid = np.arange(*_LN_RANGE, step)
        else:
            p_grid = np.arange(best[1] - span, best[1] + span, step)
            b_grid = np.arange(best[2] - span, best[2] + span, step)
        for overhead in _OVERHEADS_MS:
            for ln_b in b_grid:
                err = _roofline_error(flops, moved, log_t, p_grid, float(ln_b), overhead)
                i = int(np.argmin(err))
                if err[i] < best[0]:
                    best = (float(err[i]), float(p_grid[i]), float(ln_b), overhead)
    _, ln_p, ln_b, overhead = best
    return Roofline(flops_per_ms=math.exp(ln_p), bytes_per_ms=math.exp(ln_b), overhead_ms=overhead)


def _time_target(data: Samples, roofline: Roofline) -> tuple[np.ndarray, np.ndarray]:
    """The time predictor's features and target: ln(measured time / roofline time)."""
    x = time_features(data.x, roofline)
    return x, np.log(data.time_ms) - x[:, -1]


@dataclass(frozen=True, kw_only=True)
class Trained:
    """What `train_predictors` fits.

    Attributes:
        memory: booster predicting log1p(transient MB) from `FEATURE_NAMES`: the memory beyond
            ``weight_copies`` x the weights (`mopar.profile.store.transient_mb`).
        time: booster predicting ln(time / roofline time) from `TIME_FEATURE_NAMES`.
        memory_margin: factor (>= 1) on the predicted transient, learned out-of-fold
            (`mopar.profile.store.planned_transient_mb`).
        weight_copies: the copies of its weights a layer was taken to hold.
        roofline: the machine's roofline, fitted to the operator samples.
    """

    memory: Any
    time: Any
    memory_margin: float
    weight_copies: float
    roofline: Roofline


def train_predictors(data: Samples, config: TrainConfig, *, weight_copies: float) -> Trained:
    """Fit memory and time boosters on all of ``data``; learn the memory margin out-of-fold.

    Memory is learned as the transient: what a layer measured beyond ``weight_copies`` x its
    weights (``profiles/runtime.json``), which the planner counts exactly. The margin covers
    ``margin_quantile`` of the held-out transients (plus `TRANSIENT_FLOOR_MB`), so it scales
    only what is predicted."""
    transient = transient_mb(data.memory_mb, data.weights_mb, weight_copies)
    y_mem = np.log1p(transient)
    oof = np.empty_like(y_mem)
    for test in _folds(len(y_mem), 5, config.seed):
        train = np.setdiff1d(np.arange(len(y_mem)), test)
        oof[test] = predict_xgb(fit_xgb(data.x[train], y_mem[train], config), data.x[test])
    margin = learn_margin(
        transient + TRANSIENT_FLOOR_MB, np.expm1(oof) + TRANSIENT_FLOOR_MB, config.margin_quantile
    )
    roofline = fit_roofline(data)
    x_time, y_time = _time_target(data, roofline)
    time = fit_xgb(x_time, y_time, config, under_weight=config.time_under_weight)
    return Trained(
        memory=fit_xgb(data.x, y_mem, config),
        time=time,
        memory_margin=margin,
        weight_copies=weight_copies,
        roofline=roofline,
    )


def parallel_fractions(data: Samples, *, min_ms: float = 1.0) -> tuple[dict[str, float], float]:
    """The share of each op family's time that runs in parallel (Amdahl), and the thread count.

    From every sample of at least ``min_ms`` timed at 1 and at n threads: speed-up
    s = t1 / tn gives p = (1 - 1/s) / (1 - 1/n), clipped to [0, 1]; the median per family,
    and over all samples under ``"default"``. The planner's CPU-share model uses them.
    """
    per: dict[str, list[float]] = {}
    threads = []
    for row, family in zip(data.rows, data.family):
        t1, tn, n = _float(row, "time_ms_1t"), _float(row, "time_ms_nt"), _float(row, "threads_nt")
        if not (t1 >= min_ms and tn > 0 and n > 1):
            continue
        p = (1.0 - tn / t1) / (1.0 - 1.0 / n)
        per.setdefault(str(family), []).append(min(max(p, 0.0), 1.0))
        threads.append(n)
    every = [p for ps in per.values() for p in ps]
    fractions = {fam: round(float(np.median(ps)), 4) for fam, ps in sorted(per.items())}
    fractions["default"] = round(float(np.median(every)), 4) if every else 0.0
    return fractions, float(np.median(threads)) if threads else 1.0


# --- evaluation -------------------------------------------------------------------------------

Fitter = Callable[[np.ndarray, np.ndarray], Callable[[np.ndarray], np.ndarray]]


def _fitters(config: TrainConfig) -> dict[str, tuple[Fitter, Fitter]]:
    """(memory fitter, time fitter) per predictor kind."""

    def xgb_fit(under_weight: float) -> Fitter:
        def fit(x, y):
            booster = fit_xgb(x, y, config, under_weight=under_weight)
            return lambda z: predict_xgb(booster, z)

        return fit

    rf = lambda x, y: fit_rf(x, y, config)  # noqa: E731
    return {
        "xgb": (xgb_fit(config.under_weight), xgb_fit(config.time_under_weight)),
        "lr": (fit_linear, fit_linear),
        "rf": (rf, rf),
    }


def _rmsle(measured: np.ndarray, predicted: np.ndarray) -> float:
    d = np.log1p(np.maximum(predicted, 0)) - np.log1p(measured)
    return float(np.sqrt(np.mean(d * d))) if len(d) else math.nan


def _metrics(
    mem: np.ndarray, mem_hat: np.ndarray, t: np.ndarray, t_hat: np.ndarray, *, margin: float
) -> dict[str, float]:
    """RMSLE of the raw prediction; the under-estimate rate of what is planned (with the
    margin: `planned_transient_mb`)."""
    rel = np.abs(t_hat - t) / np.maximum(t, 1e-9)
    return {
        "memory_rmsle": _rmsle(mem, mem_hat),
        "memory_underestimate_rate": float(np.mean(planned_transient_mb(mem_hat, margin) < mem))
        if len(mem)
        else math.nan,
        "time_mape": float(np.mean(rel)) if len(t) else math.nan,
        "time_within_10pct": float(np.mean(rel <= 0.10)) if len(t) else math.nan,
        "samples": int(len(mem)),
    }


# Log-space predictions are clipped before expm1: the linear baseline extrapolates wildly, and
# an infinite prediction would only make the report unreadable (e**30 MB is absurd enough).
_LOG_MAX = 30.0


RooflineOf = Callable[[Samples], Roofline]


def _predict_pair(
    fit: tuple[Fitter, Fitter], train: Samples, test: Samples, roofline_of: RooflineOf
) -> tuple[np.ndarray, np.ndarray]:
    """Memory (MB) and time (ms) of ``test`` from models fitted to ``train`` alone: the roofline
    too is fitted to ``train``'s operator samples, as `train_predictors` does."""
    mem = fit[0](train.x, np.log1p(train.memory_mb))(test.x)
    roofline = roofline_of(train)
    x_train, y_train = _time_target(train, roofline)
    x_test = time_features(test.x, roofline)
    ratio = fit[1](x_train, y_train)(x_test)
    time = np.exp(np.clip(ratio + x_test[:, -1], -_LOG_MAX, _LOG_MAX))
    return np.expm1(np.clip(mem, 0, _LOG_MAX)), time


def _roofline_cache() -> RooflineOf:
    """`fit_roofline`, remembered per set of operator samples: every leave-one-family-out split
    trains on all operators, so they share one fit (it takes seconds)."""
    fitted: dict[bytes, Roofline] = {}

    def roofline_of(train: Samples) -> Roofline:
        ops = train.take(~train.is_layer)
        key = ops.x.tobytes() + ops.time_ms.tobytes()
        if key not in fitted:
            fitted[key] = fit_roofline(train)
        return fitted[key]

    return roofline_of


def evaluate(
    data: Samples, config: TrainConfig, *, margin: float, weight_copies: float
) -> dict[str, Any]:
    """The accuracy report (see ``mopar profile report``).

    Operator samples: 5-fold cross-validation, RMSLE per op family. Example layers:
    leave-one-model-family-out -- train on every operator sample and on the layers of the other
    families, test on this family's layers. Memory is judged on the transient, the part that is
    predicted (the weights' copies are exact): RMSLE of the raw predictions, and the
    under-estimate rate of the planned transient (with ``margin``), as the planner uses it. Time MAPE
    is mean |predicted - measured| / measured of the held-out layers, overall, per model family
    (``models``) and per dominant op family (``time_mape_by_op``).
    """
    # memory is judged where it is predicted: the transient beyond the weights' copies
    data = replace(data, memory_mb=transient_mb(data.memory_mb, data.weights_mb, weight_copies))
    report: dict[str, Any] = {"baselines": {}}
    roofline_of = _roofline_cache()
    for name, fit in _fitters(config).items():
        section = _evaluate_one(
            data, fit, config, roofline_of, margin=margin if name == "xgb" else 1.0
        )
        if name == "xgb":
            report.update(section)
        else:
            report["baselines"][name] = section
    return _no_nan(report)


def _no_nan(value: Any) -> Any:
    """NaN (a metric over no samples) becomes None, which JSON can carry."""
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _mape(measured: np.ndarray, predicted: np.ndarray) -> float:
    return float(np.mean(np.abs(predicted - measured) / measured)) if len(measured) else math.nan


def _evaluate_one(
    data: Samples,
    fit: tuple[Fitter, Fitter],
    config: TrainConfig,
    roofline_of: RooflineOf,
    *,
    margin: float,
) -> dict[str, Any]:
    ops = data.take(~data.is_layer)
    mem_hat = np.empty(len(ops.memory_mb))
    time_hat = np.empty(len(ops.time_ms))
    for test in _folds(len(ops.memory_mb), 5, config.seed):
        mask = np.zeros(len(ops.memory_mb), bool)
        mask[test] = True
        mem_hat[mask], time_hat[mask] = _predict_pair(
            fit, ops.take(~mask), ops.take(mask), roofline_of
        )
    per_op = {
        fam: _rmsle(ops.memory_mb[ops.family == fam], mem_hat[ops.family == fam])
        for fam in sorted(set(ops.family))
    }
    overall = _metrics(ops.memory_mb, mem_hat, ops.time_ms, time_hat, margin=margin)
    models: dict[str, Any] = {}
    held_out = np.zeros(0, dtype=int)
    layer_mem_hat, layer_time_hat = np.zeros(0), np.zeros(0)
    for fam in sorted(set(data.model_family[data.is_layer])):
        held = data.model_family == fam
        m_hat, t_hat = _predict_pair(fit, data.take(~held), data.take(held), roofline_of)
        models[fam] = _metrics(
            data.memory_mb[held], m_hat, data.time_ms[held], t_hat, margin=margin
        )
        held_out = np.concatenate([held_out, np.flatnonzero(held)])
        layer_mem_hat = np.concatenate([layer_mem_hat, m_hat])
        layer_time_hat = np.concatenate([layer_time_hat, t_hat])
    layers = (
        _metrics(
            data.memory_mb[held_out],
            layer_mem_hat,
            data.time_ms[held_out],
            layer_time_hat,
            margin=margin,
        )
        if models
        else {}
    )
    op_family = data.family[held_out]
    by_op = {
        fam: _mape(data.time_ms[held_out][op_family == fam], layer_time_hat[op_family == fam])
        for fam in sorted(set(op_family))
    }
    return {
        "memory_rmsle": per_op,
        "memory_underestimate_rate": layers.get(
            "memory_underestimate_rate", overall["memory_underestimate_rate"]
        ),
        "layer_memory_rmsle": layers.get("memory_rmsle", math.nan),
        "time_mape": layers.get("time_mape", overall["time_mape"]),
        "time_within_10pct": layers.get("time_within_10pct", overall["time_within_10pct"]),
        "time_mape_by_op": by_op,
        "operators": overall,
        "models": models,
    }
