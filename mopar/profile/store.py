"""Save and load trained predictors (xgboost JSON) with the metadata that says where they came from.

A profiles folder holds ``dataset.csv`` (one row per measured sample), ``memory.json`` and
``time.json`` (xgboost boosters) and ``predictors.json`` (format version, feature names, margins,
the fitted roofline, and the machine and library versions of the measurements). Loading refuses what this mopar cannot
use -- another format version, other features, another xgboost major version -- with a message
that says how to rebuild.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import json
import logging
import os
import platform
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from mopar.errors import MoparError, Option
from mopar.profile.features import TIME_FEATURE_NAMES, Roofline, param_mb, time_features

if TYPE_CHECKING:
    import xgboost as xgb

__all__ = [
    "PREDICTOR_FORMAT_VERSION",
    "ProfileError",
    "Predictors",
    "save_predictors",
    "load_predictors",
    "cpu_model",
    "version_of",
]

log = logging.getLogger(__name__)

# 2: time predicts ln(time / roofline) over TIME_FEATURE_NAMES; predictors.json holds the roofline.
# 3: memory predicts the transient beyond ``weight_copies`` x the weights (`transient_mb`).
PREDICTOR_FORMAT_VERSION = 3
_REBUILD = (
    "rebuild them with `mopar profile collect && mopar profile train --out DIR` and pass ",
    Option("profiles_dir", cli="profiles", metavar="DIR"),
)


WITHOUT_SKLEARN = False
"""Import xgboost as if scikit-learn were absent (`mopar.cli.main` sets it in the CLI's own
process). Where scikit-learn is installed, xgboost imports it, SciPy included, for estimator
wrappers mopar never calls: 1.5 s of every plan. An API caller's process is left as it is."""


@functools.cache
def _xgb() -> ModuleType:
    """The xgboost module, imported at first use (commands that plan nothing never pay for it)."""
    if WITHOUT_SKLEARN and "sklearn" not in sys.modules and "xgboost" not in sys.modules:
        sys.modules["sklearn"] = None  # type: ignore[assignment]  # import fails: "absent"
        try:
            import xgboost
        finally:
            del sys.modules["sklearn"]  # whoever imports scikit-learn later gets it
    import xgboost

    return xgboost


class ProfileError(MoparError):
    """A profiles folder is missing, corrupt, or from an incompatible version."""


@dataclass(frozen=True, kw_only=True)
class Predictors:
    """Memory and time predictors over `mopar.profile.features.FEATURE_NAMES`.

    Attributes:
        memory: booster predicting log1p(transient MB): a layer's memory beyond
            ``weight_copies`` x its weights (`transient_mb`).
        time: booster predicting ln(time / roofline time) at the measurement thread count, from
            `mopar.profile.features.TIME_FEATURE_NAMES`.
        memory_margin: factor on the predicted transient (learned, >= 1; `planned_transient_mb`);
            the weights are known exactly and get none.
        weight_copies: how many times its size a resident weight costs, as trained.
        roofline: the measuring machine's roofline, which time predictions scale.
        meta: the contents of ``predictors.json``.
        time_factor: every predicted time is multiplied by it: the target's CPU against the
            measuring machine's (`mopar.facts.Platform.time_factor`; 1: as trained).
    """

    memory: xgb.Booster
    time: xgb.Booster
    memory_margin: float
    weight_copies: float
    roofline: Roofline
    meta: dict[str, Any]
    time_factor: float = 1.0

    def predict_memory_mb(self, x: np.ndarray, *, margin: bool = True) -> np.ndarray:
        """Planned memory per row, MB: ``weight_copies`` x the weights, exactly, plus the
        predicted transient times the safety margin (without ``margin``: the transient as
        predicted)."""
        transient = np.expm1(self.memory.predict(_xgb().DMatrix(x)))
        if margin:
            transient = planned_transient_mb(transient, self.memory_margin)
        return self.weight_copies * param_mb(x) + transient

    def predict_time_ms(self, x: np.ndarray) -> np.ndarray:
        """Predicted time per row at `threads` threads on the target, ms (rows of ``x``:
        `FEATURE_NAMES`): the measuring machine's, times `time_factor`."""
        z = time_features(x, self.roofline)
        return np.exp(self.time.predict(_xgb().DMatrix(z)) + z[:, -1]) * self.time_factor

    @property
    def trained_on(self) -> str:
        """The CPU the samples were measured on (``measured_on``; predictors trained before it
        say only the machine that trained them, ``machine``), in words."""
        if measured := self.meta.get("measured_on"):
            return str(measured)
        machine = self.meta.get("machine", {})
        cpu, cores = machine.get("cpu") or "an unknown CPU", machine.get("cores")
        return f"{cpu}, {cores} cores" if cores else str(cpu)

    @property
    def threads(self) -> float:
        """The intra-op thread count the times were measured at."""
        return float(self.meta.get("threads", 1.0))

    def parallel_fraction(self, family: str) -> float:
        """The share of an op family's time that runs in parallel (0 where unmeasured)."""
        table = self.meta.get("parallel_fraction", {})
        return float(table.get(family, table.get("default", 0.0)))


TRANSIENT_FLOOR_MB = 1.0
"""The margin scales the predicted transient plus this: a layer predicted at 0.1 MB that
measures 2 MB is a small error, not a factor of 20 (`tools.profiler.train.train_predictors`)."""


def transient_mb(memory_mb: np.ndarray, weights_mb: np.ndarray, weight_copies: float) -> np.ndarray:
    """What the memory predictor learns of a measured layer: its memory beyond
    ``weight_copies`` x its weights, which are known exactly (MB)."""
    return np.maximum(np.asarray(memory_mb) - weight_copies * np.asarray(weights_mb), 0.0)


def planned_transient_mb(predicted: np.ndarray, margin: float) -> np.ndarray:
    """A predicted transient with the safety margin on it (MB)."""
    return np.maximum(margin * (np.asarray(predicted) + TRANSIENT_FLOOR_MB) - TRANSIENT_FLOOR_MB, 0)


def version_of(dist: str) -> str:
    """The installed version of distribution ``dist`` (empty: not installed)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


def cpu_model() -> str:
    """This machine's CPU model, as ``/proc/cpuinfo`` names it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_facts() -> dict[str, Any]:
    """The machine and library versions a measurement or training ran with."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "onnxruntime": version_of("onnxruntime"),
        "torch": version_of("torch"),
        "xgboost": _xgb().__version__,
        "date": _dt.date.today().isoformat(),
    }


def save_predictors(
    folder: Path,
    memory: xgb.Booster,
    time: xgb.Booster,
    *,
    feature_names: tuple[str, ...],
    memory_margin: float,
    weight_copies: float,
    roofline: Roofline,
    extra: dict[str, Any],
) -> None:
    """Write ``memory.json``, ``time.json`` and ``predictors.json`` into ``folder``.

    ``feature_names`` are the memory booster's columns; the time booster's are
    `TIME_FEATURE_NAMES`, computed from them and ``roofline``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    memory.save_model(str(folder / "memory.json"))
    time.save_model(str(folder / "time.json"))
    meta = {
        "format_version": PREDICTOR_FORMAT_VERSION,
        "feature_names": list(feature_names),
        "time_feature_names": list(TIME_FEATURE_NAMES),
        "memory_margin": memory_margin,
        "weight_copies": weight_copies,
        "roofline": dataclasses.asdict(roofline),
        "machine": machine_facts(),
        **extra,
    }
    (folder / "predictors.json").write_text(json.dumps(meta, indent=2) + "\n")


def load_predictors(folder: Path, *, feature_names: tuple[str, ...]) -> Predictors:
    """Load predictors from ``folder``; raise `ProfileError` naming the fix when unusable."""
    folder = Path(folder)
    meta_path = folder / "predictors.json"
    if not meta_path.is_file():
        raise ProfileError(f"{str(folder)!r} holds no predictors.json; ", *_REBUILD)
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{str(meta_path)!r} is corrupt ({exc}); ", *_REBUILD) from None
    version = meta.get("format_version")
    if version != PREDICTOR_FORMAT_VERSION:
        raise ProfileError(
            f"predictors in {str(folder)!r} have format version {version!r}, this mopar reads "
            f"{PREDICTOR_FORMAT_VERSION}; ",
            *_REBUILD,
        )
    if (
        tuple(meta.get("feature_names", ())) != tuple(feature_names)
        or tuple(meta.get("time_feature_names", ())) != TIME_FEATURE_NAMES
    ):
        raise ProfileError(
            f"predictors in {str(folder)!r} were trained on other features than this mopar "
            f"computes; ",
            *_REBUILD,
        )
    trained = str(meta.get("machine", {}).get("xgboost", ""))
    if trained.split(".")[0] != _xgb().__version__.split(".")[0]:
        raise ProfileError(
            f"predictors in {str(folder)!r} were saved by xgboost {trained or '?'}, this is "
            f"xgboost {_xgb().__version__}; ",
            *_REBUILD,
        )
    ort = meta.get("machine", {}).get("onnxruntime")
    if ort and ort != version_of("onnxruntime"):
        # INFO, not a warning: it says where the numbers came from, not something to fix now,
        # and as a warning it was a line on every plan and under every error; --verbose shows it.
        log.info(
            "predictors were measured with onnxruntime %s, running %s",
            ort,
            version_of("onnxruntime"),
        )
    boosters = []
    for name in ("memory", "time"):
        booster = _xgb().Booster()
        try:
            booster.load_model(str(folder / f"{name}.json"))
        except (_xgb().core.XGBoostError, OSError) as exc:
            first = (
                str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            )
            raise ProfileError(
                f"{str(folder / (name + '.json'))!r} is missing or corrupt ({first}); ", *_REBUILD
            ) from None
        boosters.append(booster)
    try:
        roofline = Roofline(**{k: float(v) for k, v in meta["roofline"].items()})
        copies = float(meta["weight_copies"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProfileError(
            f"{str(meta_path)!r} has no usable roofline or weight copies "
            f"({type(exc).__name__}: {exc}); ",
            *_REBUILD,
        ) from None
    return Predictors(
        memory=boosters[0],
        time=boosters[1],
        memory_margin=float(meta.get("memory_margin", 1.0)),
        weight_copies=copies,
        roofline=roofline,
        meta=meta,
    )
