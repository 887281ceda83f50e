"""``mopar profile collect``: measure the operator sweep and the example layers into a CSV.

Read in this order: `CollectConfig`, `collect` (ops, then models), then the row builders. The
file's schema and its resumable writer are `tools.profiler.dataset`.

The file is resumable: every row is appended and flushed as soon as it is measured, and rows whose
``sample_id`` is already in the file are skipped (a failed sample too: delete its row to retry).
A model whose layers are all in the file is skipped without capturing it again.

Columns follow `mopar.profile.features` (``op_type``, ``family``, ``params``, ``param_bytes``,
``flops``, ``bytes_in``, ``bytes_out``, ``input_shapes``, ``output_shape``, ``groups``,
``kernel_size``), so `features.feature_vector` reads a row as it is. Operator rows carry the
sweep's op name in ``op_type``; layer rows carry ``op_type = "layer"``, the ATen name of the
layer's dominant op in ``dominant_op`` and its family in ``family``.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import platform
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mopar.errors import MoparError
from tools.profiler.dataset import COLUMNS, Dataset
from tools.profiler.measure import MeasureConfig, MeasureError, Measurement, Prober
from tools.profiler.ops import OPSET, OpSample, build_model, feature_row, make_inputs
from tools.profiler.sweep import QUICK, Limits, sweep

__all__ = ["COLUMNS", "CollectConfig", "CollectSummary", "collect"]

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, kw_only=True)
class CollectConfig:
    """What to collect, and where.

    Attributes:
        out: the CSV file (created, or resumed if it exists).
        quick: a few small samples per op variant and the examples' ``_tiny`` models.
        ops: sweep op names (`tools.profiler.sweep.SWEEP` keys); None: all; (): none.
        models: example names (`examples.EXAMPLES` keys); None: all; (): none.
        limit: measure at most this many new samples, then stop (None: no limit).
        scale: samples per op variant, as a multiple of the full sweep's count (ignored if quick).
        seed: the sweep's seed.
        measure: how each sample is measured.
    """

    out: Path
    quick: bool = False
    ops: tuple[str, ...] | None = None
    models: tuple[str, ...] | None = None
    limit: int | None = None
    scale: float = 1.0
    seed: int = 0
    measure: MeasureConfig = field(default_factory=MeasureConfig)


@dataclass(frozen=True, kw_only=True)
class CollectSummary:
    """What a `collect` run did.

    Attributes:
        out: the CSV file.
        written: rows appended (failed ones included).
        skipped: samples already in the file.
        failed: rows appended with an ``error``.
        by_op: per ``op_type`` (``layer`` for layer rows): ``written``, ``skipped``, ``failed``.
        by_model: the same per example model.
        wall_s: seconds the run took.
        method: how memory was measured (``clear_refs`` or ``fresh_process``; "" if nothing ran).
        limited: whether ``limit`` stopped the run early.
    """

    out: Path
    written: int
    skipped: int
    failed: int
    by_op: dict[str, dict[str, int]]
    by_model: dict[str, dict[str, int]]
    wall_s: float
    method: str
    limited: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "written": self.written,
            "skipped": self.skipped,
            "failed": self.failed,
            "by_op": self.by_op,
            "by_model": self.by_model,
            "wall_s": round(self.wall_s, 1),
            "method": self.method,
            "limited": self.limited,
        }


class _Limit(Exception):
    """The run reached ``CollectConfig.limit``."""


class _Tally:
    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.by_op: dict[str, dict[str, int]] = {}
        self.by_model: dict[str, dict[str, int]] = {}
        self.new = 0

    def count(self, row: dict[str, Any], outcome: str) -> None:
        for table, key in ((self.by_op, row["op_type"]), (self.by_model, row.get("model"))):
            if key:
                counts = table.setdefault(key, {"written": 0, "skipped": 0, "failed": 0})
                counts[outcome] += 1
                if outcome == "failed":
                    counts["written"] += 1

    def check(self) -> None:
        if self.limit is not None and self.new >= self.limit:
            raise _Limit


def collect(config: CollectConfig, *, progress: Progress | None = None) -> CollectSummary:
    """Measure the selected op samples, then the selected example layers, into ``config.out``.

    ``progress(phase, done, total)`` hears about every sample, skipped ones included.

    Raises:
        MoparError: ``config.out`` exists with other columns, or names an unknown model.
    """
    import time

    start = time.perf_counter()
    dataset = Dataset(Path(config.out))
    tally = _Tally(config.limit)
    meta = _machine()
    tmp = Path(tempfile.mkdtemp(prefix="mopar-collect-"))
    limited = False
    with Prober(config.measure) as prober:
        try:
            if config.ops != ():
                _collect_ops(config, dataset, prober, tally, meta, tmp, progress)
            for name in _models(config.models):
                _collect_model(name, config, dataset, prober, tally, meta, tmp, progress)
        except _Limit:
            limited = True
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        method = prober.method if prober.ready else ""
    failed = sum(c["failed"] for c in tally.by_op.values())
    return CollectSummary(
        out=Path(config.out),
        written=sum(c["written"] for c in tally.by_op.values()),
        skipped=sum(c["skipped"] for c in tally.by_op.values()),
        failed=failed,
        by_op=tally.by_op,
        by_model=tally.by_model,
        wall_s=time.perf_counter() - start,
        method=method,
        limited=limited,
    )


def _models(names: tuple[str, ...] | None) -> tuple[str, ...]:
    from examples import EXAMPLES

    if names is None:
        return tuple(EXAMPLES)
    unknown = [n for n in names if n not in EXAMPLES]
    if unknown:
        raise MoparError(f"unknown example model {unknown[0]!r}; choose from {', '.join(EXAMPLES)}")
    return names


def _collect_ops(config, dataset, prober, tally, meta, tmp, progress) -> None:
    limits = QUICK if config.quick else Limits(per_variant=config.scale)
    samples = list(sweep(config.ops, limits=limits, seed=config.seed))
    for i, sample in enumerate(samples):
        _tell(progress, "operators", i, len(samples))
        row = _op_row(sample)
        if sample.sample_id in dataset.done:
            tally.count(row, "skipped")
            continue
        tally.check()
        result, error = _measure_op(sample, prober, tmp / f"{sample.sample_id}.onnx")
        _finish(row, result, error, prober, meta, opset=OPSET)
        dataset.append(row)
        tally.new += 1
        tally.count(row, "failed" if error else "written")
    _tell(progress, "operators", len(samples), len(samples))


def _measure_op(sample: OpSample, prober: Prober, path: Path) -> tuple[Measurement | None, str]:
    import onnx

    try:
        onnx.save(build_model(sample), str(path))
        return prober.measure_arrays(path, make_inputs(sample)), ""
    except Exception as exc:  # noqa: BLE001 - one bad sample is a row with an error, not a dead run
        return None, _one_line(exc)
    finally:
        path.unlink(missing_ok=True)


def _collect_model(name, config, dataset, prober, tally, meta, tmp, progress) -> None:
    from examples import EXAMPLES
    from tools.profiler.layers import export, model_key, model_layers

    ex = EXAMPLES[name]
    factory, specs = (ex.tiny_factory, ex.tiny_inputs) if config.quick else (ex.factory, ex.inputs)
    key = model_key(factory, specs)
    have = dataset.layers_done.get(key)
    if have is not None and have[0] >= have[1]:  # every layer is in the file
        for _ in range(have[0]):
            tally.count({"op_type": "layer", "model": name}, "skipped")
        return
    _tell(progress, f"{name}: capturing", 0, 1)
    try:
        layers = model_layers(name, tiny=config.quick)
    except MoparError as exc:  # the other models are still worth measuring
        log.warning("example %s was not captured: %s", name, _one_line(exc))
        tally.by_model.setdefault(name, {"written": 0, "skipped": 0, "failed": 0})["failed"] += 1
        return
    folder = tmp / name
    folder.mkdir()
    exported: dict[str, tuple[Path, tuple[str, ...], str]] = {}
    exported_inputs: dict[str, tuple[str, ...]] = {}
    try:
        for i, sample in enumerate(layers.layers):
            _tell(progress, f"{name}: layers", i, len(layers.layers))
            row = _layer_row(sample)
            if sample.sample_id in dataset.done:
                tally.count(row, "skipped")
                continue
            tally.check()
            if sample.signature not in exported:
                path = folder / f"{len(exported)}.onnx"
                try:
                    exported[sample.signature] = (path, export(sample, path), "")
                except Exception as exc:  # noqa: BLE001 - one layer's export is not the run
                    exported[sample.signature] = (path, (), _one_line(exc))
            path, onnx_ops, error = exported[sample.signature]
            result = None
            if not error:
                # A shared export names its inputs after the first layer's tensors; equal
                # signatures mean equal inputs position by position.
                names = exported_inputs.setdefault(sample.signature, tuple(sample.inputs))
                feed = dict(zip(names, sample.inputs.values()))
                try:
                    result = prober.measure_arrays(path, feed)
                except MeasureError as exc:
                    error = _one_line(exc)
            row["onnx_ops"] = json.dumps(list(onnx_ops))
            _finish(row, result, error, prober, meta, opset=_opset(path))
            dataset.append(row)
            tally.new += 1
            tally.count(row, "failed" if error else "written")
        _tell(progress, f"{name}: layers", len(layers.layers), len(layers.layers))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# --- rows -----------------------------------------------------------------------------------------


def _op_row(s: OpSample) -> dict[str, Any]:
    return {
        "sample_id": s.sample_id,
        "source": "op",
        **feature_row(s),
        "dominant_op": s.op_type,
        "config": json.dumps(dict(s.config)),
        "output_shapes": json.dumps([list(t.shape) for t in s.outputs]),
        "onnx_ops": json.dumps(list(dict.fromkeys(n.op for n in s.nodes))),
    }


def _layer_row(s) -> dict[str, Any]:
    f = s.features
    shapes = f.get("input_shapes") or []
    return {
        "sample_id": s.sample_id,
        "source": "layer",
        "op_type": "layer",
        "variant": "",
        "family": f.get("family", ""),
        "dominant_op": f.get("op_type", ""),
        "model": s.model,
        "model_family": s.model_family,
        "layer": s.layer,
        "module_type": f.get("module_type", ""),
        "layer_index": s.layer_index,
        "model_layers": s.model_layers,
        "config": s.config,
        "params": f.get("params", ""),
        "param_bytes": f.get("param_bytes", ""),
        "flops": f.get("flops", ""),
        "bytes_in": f.get("bytes_in", ""),
        "bytes_out": f.get("bytes_out", ""),
        "input_shapes": json.dumps(shapes),
        "output_shape": json.dumps(f.get("output_shape")),
        "output_shapes": "",
        "n_inputs": len(shapes),
        "groups": f.get("groups", ""),
        "kernel_size": f.get("kernel_size", ""),
    }


def _finish(
    row: dict[str, Any],
    m: Measurement | None,
    error: str,
    prober: Prober,
    meta: dict[str, Any],
    *,
    opset: int | str,
) -> None:
    if m is not None:
        row.update(
            memory_bytes=m.memory_bytes,
            load_bytes=m.load_bytes,
            session_bytes=m.session_bytes,
            run_bytes=m.run_bytes,
            time_ms_1t=round(m.time_ms_1t, 4),
            time_ms_nt=round(m.time_ms_nt, 4),
            load_ms=round(m.load_ms, 2),
            runs_1t=m.runs_1t,
            runs_nt=m.runs_nt,
            mem_method=m.method,
        )
    threads = prober.config.threads or meta["physical_cores"]
    row.update(
        threads_nt=threads,
        cpus=meta["cpus"],
        cpu_model=meta["cpu_model"],
        ort_version=prober.ready.get("ort", ""),
        opset=opset,
        collected_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        error=error,
    )


def _opset(path: Path) -> int | str:
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # a failed export leaves no file
        return ""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), "")


def _machine() -> dict[str, Any]:
    import psutil

    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            names = (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
            model = next(names, model)
    except OSError:
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # onnxruntime's default intra-op thread count is the number of physical cores.
    return {
        "cpus": cpus,
        "cpu_model": model,
        "physical_cores": psutil.cpu_count(logical=False) or cpus,
    }


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:500]


def _tell(progress: Progress | None, phase: str, done: int, total: int) -> None:
    if progress is not None:
        progress(phase, done, total)
