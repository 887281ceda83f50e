"""Train the shipped predictors from a measured dataset, and evaluate them honestly.

Read in this order: `load_dataset` (CSV rows -> usable samples), `train_predictors` (fit memory
and time on everything, with a memory margin learned out-of-fold), then `evaluate` (the accuracy
report: per-op cross-validation and leave-one-model-family-out on example layers, for XGBoost
and the two baselines).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mopar.profile.dataset import read_rows
from mopar.profile.features import feature_matrix, row_family
from mopar.profile.predict import TrainConfig, fit_linear, fit_rf, fit_xgb, learn_margin, predict_xgb
from mopar.profile.store import ProfileError

__all__ = ["Samples", "load_dataset", "train_predictors", "parallel_fractions", "evaluate", "MB"]

MB = float(1 << 20)


@dataclass(frozen=True, kw_only=True)
class Samples:
    """A dataset as arrays.

    Attributes:
        rows: the CSV rows kept (measured, no error).
        x: features, one row per sample, columns `FEATURE_NAMES`.
        memory_mb: measured memory footprint, MB.
        time_ms: measured time at the default thread count, ms.
        family: op family of each sample (`row_family`).
        model_family: the example family ("cnn", ...) for layer rows, "" for operator sweeps.
    """

    rows: tuple[Mapping[str, Any], ...]
    x: np.ndarray
    memory_mb: np.ndarray
    time_ms: np.ndarray
    family: np.ndarray
    model_family: np.ndarray

    @property
    def is_layer(self) -> np.ndarray:
        return self.model_family != ""

    def take(self, mask: np.ndarray) -> Samples:
        return Samples(rows=tuple(r for r, m in zip(self.rows, mask) if m), x=self.x[mask],
                       memory_mb=self.memory_mb[mask], time_ms=self.time_ms[mask],
                       family=self.family[mask], model_family=self.model_family[mask])


def _float(row: Mapping[str, Any], key: str) -> float:
    try:
        return float(row.get(key) or "nan")
    except ValueError:
        return math.nan


def load_dataset(path: Path) -> Samples:
    """Read a ``mopar profile collect`` CSV; rows with an error or no measurement are dropped."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"dataset {str(path)!r} does not exist; run `mopar profile collect` first")
    rows = [r for r in read_rows(path)
            if not r.get("error") and _float(r, "memory_bytes") > 0 and _float(r, "time_ms_nt") > 0]
    if len(rows) < 10:
        raise ProfileError(f"dataset {str(path)!r} has {len(rows)} usable rows; collect more")
    return Samples(
        rows=tuple(rows),
        x=feature_matrix(rows),
        memory_mb=np.array([_float(r, "memory_bytes") / MB for r in rows]),
        time_ms=np.array([_float(r, "time_ms_nt") for r in rows]),
        family=np.array([row_family(r) for r in rows]),
        model_family=np.array([r.get("model_family") or "" for r in rows]),
    )


def _folds(n: int, k: int, seed: int) -> list[np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    return [order[i::k] for i in range(k)]


def train_predictors(data: Samples, config: TrainConfig) -> tuple[Any, Any, float]:
    """Fit memory and time boosters on all of ``data``; learn the memory margin out-of-fold.

    Returns (memory booster, time booster, memory margin).
    """
    y_mem, y_time = np.log1p(data.memory_mb), np.log1p(data.time_ms)
    oof = np.empty_like(y_mem)
    for test in _folds(len(y_mem), 5, config.seed):
        train = np.setdiff1d(np.arange(len(y_mem)), test)
        oof[test] = predict_xgb(fit_xgb(data.x[train], y_mem[train], config), data.x[test])
    margin = learn_margin(data.memory_mb, np.expm1(oof), config.margin_quantile)
    time = fit_xgb(data.x, y_time, config, under_weight=config.time_under_weight)
    return fit_xgb(data.x, y_mem, config), time, margin


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


def _metrics(mem: np.ndarray, mem_hat: np.ndarray, t: np.ndarray, t_hat: np.ndarray, *,
             margin: float) -> dict[str, float]:
    """RMSLE of the raw prediction; the under-estimate rate of what is planned (x margin)."""
    rel = np.abs(t_hat - t) / np.maximum(t, 1e-9)
    return {
        "memory_rmsle": _rmsle(mem, mem_hat),
        "memory_underestimate_rate": float(np.mean(mem_hat * margin < mem)) if len(mem) else math.nan,
        "time_mape": float(np.mean(rel)) if len(t) else math.nan,
        "time_within_10pct": float(np.mean(rel <= 0.10)) if len(t) else math.nan,
        "samples": int(len(mem)),
    }


# Log-space predictions are clipped before expm1: the linear baseline extrapolates wildly, and
# an infinite prediction would only make the report unreadable (e**30 MB is absurd enough).
_LOG_MAX = 30.0


def _predict_pair(fit: tuple[Fitter, Fitter], train: Samples, test: Samples) -> tuple[np.ndarray, np.ndarray]:
    mem = fit[0](train.x, np.log1p(train.memory_mb))(test.x)
    time = fit[1](train.x, np.log1p(train.time_ms))(test.x)
    return np.expm1(np.clip(mem, 0, _LOG_MAX)), np.expm1(np.clip(time, 0, _LOG_MAX))


def evaluate(data: Samples, config: TrainConfig, *, margin: float) -> dict[str, Any]:
    """The accuracy report (see ``mopar profile report``).

    Operator samples: 5-fold cross-validation, RMSLE per op family. Example layers:
    leave-one-model-family-out -- train on every operator sample and on the layers of the other
    families, test on this family's layers. RMSLE is of the raw predictions; the under-estimate
    rate is of the planned memory (prediction x ``margin``), as the planner uses it.
    """
    report: dict[str, Any] = {"baselines": {}}
    for name, fit in _fitters(config).items():
        section = _evaluate_one(data, fit, config, margin=margin if name == "xgb" else 1.0)
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


def _evaluate_one(data: Samples, fit: tuple[Fitter, Fitter], config: TrainConfig, *,
                  margin: float) -> dict[str, Any]:
    ops = data.take(~data.is_layer)
    mem_hat = np.empty(len(ops.memory_mb))
    time_hat = np.empty(len(ops.time_ms))
    for test in _folds(len(ops.memory_mb), 5, config.seed):
        mask = np.zeros(len(ops.memory_mb), bool)
        mask[test] = True
        mem_hat[mask], time_hat[mask] = _predict_pair(fit, ops.take(~mask), ops.take(mask))
    per_op = {
        fam: _rmsle(ops.memory_mb[ops.family == fam], mem_hat[ops.family == fam])
        for fam in sorted(set(ops.family))
    }
    overall = _metrics(ops.memory_mb, mem_hat, ops.time_ms, time_hat, margin=margin)
    models: dict[str, Any] = {}
    all_mem, all_mem_hat, all_t, all_t_hat = [], [], [], []
    for fam in sorted(set(data.model_family[data.is_layer])):
        held = data.model_family == fam
        m_hat, t_hat = _predict_pair(fit, data.take(~held), data.take(held))
        models[fam] = _metrics(data.memory_mb[held], m_hat, data.time_ms[held], t_hat, margin=margin)
        all_mem.append(data.memory_mb[held])
        all_mem_hat.append(m_hat)
        all_t.append(data.time_ms[held])
        all_t_hat.append(t_hat)
    layers = (_metrics(np.concatenate(all_mem), np.concatenate(all_mem_hat),
                       np.concatenate(all_t), np.concatenate(all_t_hat), margin=margin)
              if models else {})
    return {
        "memory_rmsle": per_op,
        "memory_underestimate_rate": layers.get("memory_underestimate_rate", overall["memory_underestimate_rate"]),
        "layer_memory_rmsle": layers.get("memory_rmsle", math.nan),
        "time_mape": layers.get("time_mape", overall["time_mape"]),
        "time_within_10pct": layers.get("time_within_10pct", overall["time_within_10pct"]),
        "operators": overall,
        "models": models,
    }
