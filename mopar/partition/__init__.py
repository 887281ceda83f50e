"""Partition: decide where to cut a LayerGraph and how big each slice's function is."""

from __future__ import annotations

from mopar.config import CompileConfig, load_profile
from mopar.errors import PlanError
from mopar.ir import LayerGraph
from mopar.partition.balanced import balanced_split
from mopar.partition.plan import PLAN_FORMAT_VERSION, Plan, SlicePlan
from mopar.partition.sizing import estimate_memory_mb

__all__ = ["PLAN_FORMAT_VERSION", "Plan", "SlicePlan", "make_plan", "STRATEGIES"]

STRATEGIES = ("balanced",)


def make_plan(lg: LayerGraph, *, model: str, config: CompileConfig) -> Plan:
    """Cut ``lg`` into exactly ``config.slices`` slices with the configured strategy."""
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
    return Plan(
        model=model,
        strategy=config.strategy,
        slices=slices,
        memory_source="estimate: runtime baseline + 2x parameters + 2x activations (profiles/runtime.json)",
        notes=("memory sizes are estimates until a profiler predicts them; compare them with the "
               "peak RSS that `mopar run` measures",),
    )


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
