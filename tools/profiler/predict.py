"""Predictors of memory and time: XGBoost trained to avoid under-estimates, plus baselines.

Targets are learned in log space (``log1p`` of MB or ms), so squared error there is the paper's
RMSLE. mopar's objective is asymmetric: a prediction below the measurement -- which on a
serverless platform is an out-of-memory kill -- costs `TrainConfig.under_weight` times more than an
over-estimate of the same size. A multiplicative safety margin, learned from held-out residuals,
then lifts memory predictions so that they cover the measurement at a chosen quantile.

Baselines for the accuracy report: ordinary least squares (`fit_linear`) and a random forest
(`xgboost.XGBRFRegressor`), both on the same features and log targets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xgboost as xgb

__all__ = [
    "TrainConfig",
    "asymmetric_squared_log_error",
    "fit_xgb",
    "fit_linear",
    "fit_rf",
    "learn_margin",
    "Regressor",
]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How predictors are trained.

    Attributes:
        rounds: boosting rounds.
        max_depth: tree depth.
        learning_rate: shrinkage per round.
        under_weight: memory loss weight of an under-estimate relative to an over-estimate
            (>= 1): an under-sized function is killed.
        time_under_weight: the same for time, where an error either way costs only money: 1.
        margin_quantile: the share of held-out samples the memory margin must cover (0..1).
        seed: random seed (training is deterministic for a seed).
    """

    rounds: int = 400
    max_depth: int = 6
    learning_rate: float = 0.05
    under_weight: float = 4.0
    time_under_weight: float = 1.0
    margin_quantile: float = 0.99
    seed: int = 0


def asymmetric_squared_log_error(under_weight: float) -> Callable:
    """An xgboost objective on log targets: w * r**2 with w = under_weight where r < 0."""

    def objective(predt: np.ndarray, dtrain: xgb.DMatrix) -> tuple[np.ndarray, np.ndarray]:
        residual = predt - dtrain.get_label()
        weight = np.where(residual < 0, under_weight, 1.0)
        return 2.0 * weight * residual, 2.0 * weight

    return objective


Regressor = Callable[[np.ndarray], np.ndarray]
"""A fitted model: features (n x d) -> log-space predictions (n,)."""


def fit_xgb(
    x: np.ndarray, y_log: np.ndarray, config: TrainConfig, *, under_weight: float | None = None
) -> xgb.Booster:
    """Gradient-boosted trees with the asymmetric objective (``config.under_weight`` unless
    ``under_weight`` is given)."""
    params = {
        "max_depth": config.max_depth,
        "eta": config.learning_rate,
        "seed": config.seed,
        "nthread": 1,  # deterministic and fair to the 2-core machines we train on
        "base_score": float(np.mean(y_log)) if len(y_log) else 0.0,
    }
    dtrain = xgb.DMatrix(x, label=y_log)
    return xgb.train(
        params,
        dtrain,
        num_boost_round=config.rounds,
        obj=asymmetric_squared_log_error(
            config.under_weight if under_weight is None else under_weight
        ),
    )


def predict_xgb(booster: xgb.Booster, x: np.ndarray) -> np.ndarray:
    return booster.predict(xgb.DMatrix(x))


def fit_linear(x: np.ndarray, y_log: np.ndarray) -> Regressor:
    """Ordinary least squares with an intercept (the report's linear baseline)."""
    design = np.hstack([x, np.ones((len(x), 1))])
    coef, *_ = np.linalg.lstsq(design, y_log, rcond=None)
    return lambda z: np.hstack([z, np.ones((len(z), 1))]) @ coef


def fit_rf(x: np.ndarray, y_log: np.ndarray, config: TrainConfig) -> Regressor:
    """A random forest (the report's second baseline)."""
    model = xgb.XGBRFRegressor(
        n_estimators=200, max_depth=config.max_depth, random_state=config.seed, n_jobs=1
    )
    model.fit(x, y_log)
    return model.predict


def learn_margin(measured: np.ndarray, predicted: np.ndarray, quantile: float) -> float:
    """The factor (>= 1) by which predictions must be multiplied to cover ``quantile`` of the
    held-out measurements."""
    ok = predicted > 0
    if not ok.any():
        return 1.0
    ratios = measured[ok] / predicted[ok]
    return float(max(1.0, np.quantile(ratios, quantile)))
