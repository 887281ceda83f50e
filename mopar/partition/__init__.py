"""Partition: decide where to cut a LayerGraph and how big each slice's function is."""

from __future__ import annotations

from dataclasses import replace

from mopar.config import CompileConfig, load_profile
from mopar.errors import PlanError
from mopar.ir import LayerGraph
from mopar.partition.balanced import balanced_split
from mopar.partition.plan import PLAN_FORMAT_VERSION, Plan, SlicePlan
from mopar.partition.sizing import PREDICTED_SOURCE, estimate_memory_mb, predicted_memory_mb

__all__ = ["PLAN_FORMAT_VERSION", "Plan", "SlicePlan", "make_plan", "STRATEGIES"]

STRATEGIES = ("balanced",)


def make_plan(
    lg: LayerGraph,
    *,
    model: str,
    config: CompileConfig,
    layer_memory_mb: tuple[float, ...] | None = None,
    layer_time_ms: tuple[float, ...] | None = None,
) -> Plan:
    """Cut ``lg`` into exactly ``config.slices`` slices with the configured strategy.

    Args:
        lg: the layer graph.
        model: the model's name.
        config: slices, strategy, profiles folder.
        layer_memory_mb: predicted memory of each layer beyond the runtime baseline, MB (from
            `mopar.profile.service.predict_layers`); None sizes slices by byte counts.
        layer_time_ms: predicted time of each layer, ms (summed per slice into ``time_ms``).
    """
    n_layers = len(lg)
    if not 1 <= config.slices <= n_layers:
        raise PlanError(
            f"--slices must be between 1 and {n_layers} (the model has {n_layers} layers), "
            f"got {config.slices}"
        )
    if config.strategy not in STRATEGIES:
        raise PlanError(
            f"unknown --strategy {config.strategy!r}; choose one of {', '.join(STRATEGIES)}"
        )
    weights = [layer.param_bytes + layer.activation_bytes for layer in lg.layers]
    cuts = balanced_split(weights, config.slices)
    bounds = list(zip((0, *cuts), (*cuts, n_layers)))
    runtime = load_profile(config.profiles_dir, "runtime")
    slices = tuple(_slice_plan(lg, i, lo, hi, runtime) for i, (lo, hi) in enumerate(bounds))
    if layer_memory_mb is None:
        return Plan(
            model=model, strategy=config.strategy, slices=slices,
            memory_source="estimate: runtime baseline + parameter and activation copies "
                          "(profiles/runtime.json)",
            notes=("no trained predictors found: memory sizes are byte-count estimates",),
        )
    sized = tuple(
        replace(s, memory_mb=predicted_memory_mb(layer_memory_mb[lo:hi], runtime),
                time_ms=float(sum(layer_time_ms[lo:hi])) if layer_time_ms else 0.0)
        for s, (lo, hi) in zip(slices, bounds)
    )
    return Plan(model=model, strategy=config.strategy, slices=sized,
                memory_source=PREDICTED_SOURCE)


def _slice_plan(lg: LayerGraph, index: int, lo: int, hi: int, runtime: dict) -> SlicePlan:
    layers = lg.layers[lo:hi]
    names = {layer.name for layer in layers}
    received: dict[str, int] = {}
    sent: dict[str, int] = {}
    for u, v, tensors in lg.graph.edges(data="tensors"):
        if v in names and u not in names:
            received.update((t.name, t.nbytes) for t in tensors)
        if u in names and v not in names:
            sent.update((t.name, t.nbytes) for t in tensors)
    in_bytes, out_bytes = sum(received.values()), sum(sent.values())
    param_bytes = sum(layer.param_bytes for layer in layers)
    peak = max(layer.activation_bytes for layer in layers)
    return SlicePlan(
        name=f"s{index}",
        layers=tuple(layer.name for layer in layers),
        memory_mb=estimate_memory_mb(
            param_bytes=param_bytes, io_bytes=in_bytes + out_bytes,
            peak_activation_bytes=peak, runtime=runtime,
        ),
        param_bytes=param_bytes,
        flops=sum(layer.flops for layer in layers),
        in_bytes=in_bytes,
        out_bytes=out_bytes,
    )
