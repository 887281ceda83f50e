"""``function.json`` of every function, derived from the plan graph and the tensors' shapes.

A request travels the plan's path (`Plan.path`): each function on it receives what it and every
later function still read (skip connections ride along), runs, and sends on what is still read
after it. A function on the path calls the functions its kind says are called
(`Plan.callees`): each receives exactly the tensors it reads and answers with its outputs. What a
function receives, sends, calls and answers is all the runtime knows of the graph.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from mopar.bundle.document import Io, IoTensor
from mopar.bundle.function import FunctionSpec, TensorSpec
from mopar.bundle.generation import GenerationSpec
from mopar.bundle.layout import FUNCTIONS_DIR, UNITS_DIR
from mopar.errors import BundleError, Option
from mopar.facts import Platform
from mopar.plan import Plan
from mopar.runtime.chains import MODES, ChainMode, counterpart
from mopar.target import target_or_default

__all__ = [
    "chain_mode",
    "check_target",
    "function_specs",
    "write_function_specs",
    "deployed",
    "gather_units",
]


def check_target(plan: Plan, target: str) -> None:
    """Refuse to write ``target``'s files for ``plan`` unless it was planned for ``target``
    (or for a pricing-only target, which deploys as the default one,
    `mopar.target.target_or_default`): a target's files carry the sizes, chain mode and
    transports of a plan made for it, never another's.

    Raises:
        BundleError: the plan deploys as another target.
    """
    deploys = target_or_default(plan.target).name
    if deploys != target:
        raise BundleError(
            f"plan {plan.model!r} was planned and sized for {plan.target}, so its deployment "
            f"files are {deploys}'s, not {target}'s; compile it again with ",
            Option("target", value=target),
            f" for {target}'s files",
        )


def chain_mode(plan: Plan, target: str, offered: Sequence[ChainMode]) -> ChainMode:
    """The chain mode the files of ``target``, which offers the modes ``offered`` (its default
    first), deploy ``plan`` in: its ``chain`` (empty: the default); a plan priced for another
    target deploys in the `counterpart` of its mode.

    Raises:
        BundleError: the plan was priced for ``target`` in a mode ``target`` does not offer, or
            names no chain mode at all.
    """
    if not plan.chain:
        return offered[0]
    mode = MODES.get(plan.chain)
    if mode is None or (plan.target == target and mode not in offered):
        raise BundleError(
            f"plan {plan.model!r} chains its functions by {plan.chain!r}, which {target} does "
            f"not offer (it offers {[m.name for m in offered]}); re-plan it for {target}"
        )
    return counterpart(mode, offered)


def function_specs(plan: Plan, io: Io, prewarms: Sequence[str] = ()) -> list[FunctionSpec]:
    """The `FunctionSpec` of every function of ``plan``, in its order.

    Args:
        plan: the bundle's plan.
        io: ``plan.json``'s ``io`` section: the model's inputs and outputs, and each function's
            inputs and outputs with their shapes, dtypes and codecs.
        prewarms: the functions the entry warms up at a cold start
            (`mopar.bill.ColdRequest.warmed`).
    """
    info: dict[str, IoTensor] = {t.name: t for t in io.inputs}
    own = {f.name: f for f in io.functions}
    codec_of: dict[str, str] = {}
    for f in io.functions:
        info.update((t.name, t) for t in (*f.inputs, *f.outputs))
        codec_of.update(f.codecs)
    names = lambda ts: [t.name for t in ts]  # noqa: E731
    returns = {t.value: t.name for t in io.outputs}
    path = plan.path()
    calls = {f.name: plan.callees(f.name) for f in path}

    def reads(name: str) -> set[str]:
        """What a function on the path and the functions it calls read from outside."""
        called = calls[name]
        made = {v for c in called for v in names(own[c.name].outputs)}
        return (set(names(own[name].inputs)) - made) | {
            v for c in called for v in names(own[c.name].inputs)
        }

    needed_after: dict[str, set[str]] = {}  # read after a path function, or returned
    later = set(returns)
    for f in reversed(path):
        needed_after[f.name] = set(later)
        later |= reads(f.name)

    def spec(name: str, k: int, receives: list[str], sends: list[str], **more) -> FunctionSpec:
        return FunctionSpec(
            model=plan.model,
            slice=name,
            index=k,
            count=len(path),
            receives=tuple(
                TensorSpec(
                    name=v,
                    shape=info[v].max_shape or info[v].shape,
                    dtype=info[v].dtype,
                    codec=codec_of.get(v, "none"),
                    rows=own[name].rows,
                    min_shape=info[v].min_shape,
                    value_range=info[v].value_range,
                )
                for v in receives
            ),
            outputs=tuple(names(own[name].outputs)),
            codecs=dict(own[name].codecs),
            sends=tuple(sends),
            **more,
        )

    specs: dict[str, FunctionSpec] = {}
    available = names(io.inputs)
    for k, f in enumerate(path):
        last = k == len(path) - 1
        after = needed_after[f.name]
        need = reads(f.name)
        receives = [v for v in available if v in need or v in after]
        for c in calls[f.name]:
            wanted = names(own[c.name].inputs)
            given = wanted if c.spec.fed_by_caller else [v for v in available if v in wanted]
            specs[c.name] = spec(c.name, k, given, names(own[c.name].outputs), answers=True)
        outputs = names(own[f.name].outputs)
        specs[f.name] = spec(
            f.name,
            k,
            receives,
            [v for v in [*receives, *outputs] if v in after],
            returns=returns if last else {},
            transport=None if last and plan.answer == "response" else plan.handoff(f.name),
            calls=tuple(specs[c.name] for c in calls[f.name]),
            dispatch=own[f.name].dispatch,
            prewarms=tuple(prewarms) if k == 0 else (),
        )
        available = [*available, *outputs]
    return [specs[f.name] for f in plan.functions]


def deployed(plan: Plan, generation: GenerationSpec | None, platform: Platform) -> Plan:
    """The plan as it is deployed: ``plan`` itself, except for a ``--generate`` bundle whose
    main function runs several units, which deploys as that one function (its units' layers,
    time and weights together, its edges theirs) and the expert functions it calls. Its memory
    covers its measured need on ``platform`` (`GenerationSpec.main_need_mb`)."""
    if generation is None or len(generation.units) < 2:
        return plan
    units = set(generation.units)
    ours = [f for f in plan.functions if f.name in units]
    need = generation.main_need_mb([f.need_mb for f in ours])
    main = replace(
        ours[0],
        layers=tuple(layer for f in ours for layer in f.layers),
        memory_mb=platform.round_mb(need),
        need_mb=need,
        time_ms=sum(f.time_ms for f in ours),
        param_bytes=sum(f.param_bytes for f in ours),
        flops=sum(f.flops for f in ours),
        sparse_experts=tuple(e for f in ours for e in f.sparse_experts),
    )
    moved = lambda name: main.name if name in units else name  # noqa: E731
    edges = tuple(
        replace(e, src=moved(e.src), dst=moved(e.dst))
        for e in plan.edges
        if not (e.src in units and e.dst in units)
    )
    functions = tuple(
        main if f.name == main.name else f
        for f in plan.functions
        if f.name == main.name or f.name not in units
    )
    return replace(plan, functions=functions, edges=edges)


def gather_units(bundle: Path, generation: GenerationSpec | None) -> None:
    """Give a main function that runs several units their folders inside its own
    (``functions/<main>/units/<unit>``, hard links where the file system allows): an image
    built from its folder holds all it runs. The units keep their own folders too (`mopar run`
    serves the step through them)."""
    if generation is None or len(generation.units) < 2:
        return
    root = Path(bundle) / FUNCTIONS_DIR
    for name in generation.units[1:]:
        shutil.copytree(
            root / name, root / generation.function / UNITS_DIR / name, copy_function=_link
        )


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links refused: a copy
        shutil.copy2(src, dst)


def write_function_specs(
    bundle: Path,
    plan: Plan,
    io: Io,
    generation: GenerationSpec | None = None,
    prewarms: Sequence[str] = (),
) -> None:
    """Write ``functions/<name>/function.json`` of every function of ``plan`` into the bundle at
    ``bundle``, whose ``plan.json`` holds ``plan``, ``io`` and ``generation`` (its main
    function's spec carries it); the entry's names ``prewarms``."""
    for spec in function_specs(plan, io, prewarms):
        if generation is not None and spec.slice == generation.function:
            # a main function runs the loop over its units: it warms what it calls, by name
            spec = replace(spec, generation=generation, prewarms=())
        spec.write(Path(bundle) / FUNCTIONS_DIR / spec.slice)
