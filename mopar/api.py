"""The public Python API: `analyze`, `partition` and `compile` (docs/api.md).

Each runs the stages of `mopar.pipeline` in order -- capture, profile, plan, rewrite, compress,
export, verify, measure, emit -- and returns data. This is the boundary: the facts the stages
need (platform, predictors, runtime figures) are loaded here once, by `facts_for`, and passed
down; nothing below opens ``profiles/``.

Each takes what `torch.export.export` takes -- a model, a tuple of positional example inputs and
a dict of keyword ones -- or mopar's own input forms (`mopar.arguments` has the rule). Every
failure a caller can fix is a `MoparError` that names the Python argument. Nothing here prints
or warns: mopar logs through `logging` (the ``mopar`` logger), and ``progress`` hears about
phases. Each may be called from several threads at once: the library calls that are not
thread-safe (torch.export, the ONNX exporter, model loading) take turns (`mopar._quiet.LIBRARIES`),
and the host's ``sys.stdout`` and ``sys.stderr`` are never replaced (docs/api.md, Threads).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mopar.arguments import (
    COMPILE_OPTIONS,
    PLAN_OPTIONS,
    check_arguments,
    compile_config,
    dynamic_dims,
    python_terms,
)
from mopar.config import CompileConfig, DynamicDim
from mopar.errors import OptionError
from mopar.facts import Facts, Platform
from mopar.pipeline import UNTIL, Analysis, Bundle, HandedOver

if TYPE_CHECKING:
    from mopar.ir import LayerGraph
    from mopar.plan import Plan
    from mopar.profile.service import LayerPrediction

__all__ = ["Bundle", "Analysis", "Platform", "analyze", "partition", "compile"]

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]
Model = (
    Any  # an nn.Module, a torch.export.ExportedProgram, a file path, or "package.module:factory"
)
ExampleArgs = tuple | Mapping[str, Any] | list[str] | str | os.PathLike | None
ExampleKwargs = Mapping[str, Any] | None


@python_terms
def analyze(
    model: Model,
    example_args: ExampleArgs = None,
    example_kwargs: ExampleKwargs = None,
    *,
    depth: int | None = None,
    trust_pickle: bool = False,
    progress: Progress | None = None,
    dynamic: Sequence[str | DynamicDim] = (),
    generate: bool = False,
    max_seq_len: int | None = None,
    keep_positions: str = "all",
) -> Analysis:
    """Load and capture ``model`` and group it into layers.

    Args:
        model: an ``nn.Module``, a ``torch.export.ExportedProgram``, the path of a ``.pt2``
            or TorchScript ``.pt`` file, or a factory ``"package.module:function"``.
        example_args: positional example inputs, as `torch.export.export` takes them:
            ``(x,)``; or a dict of inputs by name, a list of ``"NAME=SHAPE:DTYPE"`` specs, or
            an ``.npz`` path. None: a ``.pt2`` or ExportedProgram uses its own.
        example_kwargs: example inputs by forward() parameter name: ``{"x": x}``.
        depth: group layers by module path truncated to this depth (None: leaf modules).
        trust_pickle: allow loading a pickled ``nn.Module`` file (unpickling runs its code).
        progress: called as ``progress(phase, done, total)`` when a phase starts.
        dynamic: input dimensions to keep dynamic, ``"NAME:AXIS=MIN..MAX"`` each
            (``"input_ids:1=1..512"``); a ``.pt2``'s own bounded ones are kept anyway.
        generate: capture a transformers decoder's generation step, its key-value cache in
            and out (`mopar.frontend.generate`), instead of its forward.
        max_seq_len: with ``generate``: prompt and generated tokens together, at most.
        keep_positions: ``last``: each output with positions answers with the last alone
            (`mopar.frontend.capture.keep_last`).

    Raises:
        MoparError: a subclass naming the argument at fault and the fix.
    """
    from mopar import pipeline

    check_arguments(depth=depth, trust_pickle=trust_pickle, progress=progress)
    return pipeline.capture(
        model,
        example_args,
        example_kwargs,
        depth=depth,
        trust_pickle=trust_pickle,
        progress=progress,
        dims=dynamic_dims(dynamic),
        generate=generate,
        max_seq_len=max_seq_len,
        keep_last=keep_positions == "last",
    )


@python_terms
def partition(
    model: Model,
    example_args: ExampleArgs = None,
    example_kwargs: ExampleKwargs = None,
    *,
    depth: int | None = None,
    trust_pickle: bool = False,
    platform: Platform | None = None,
    progress: Progress | None = None,
    **options: Any,
):
    """Plan how to cut ``model`` into functions; returns a frozen `mopar.plan.Plan`.

    ``model``, ``example_args``, ``example_kwargs``, ``depth``, ``trust_pickle`` and
    ``progress`` are as in `analyze`. ``platform`` is a `mopar.facts.Platform` built in code,
    for a provider without a profile (None: ``target`` and ``arch`` choose one from the
    profiles). ``options`` are the planning fields of `CompileConfig`: ``slices``,
    ``strategy``, ``target``, ``transport``, ``colocate``, ``arch``, ``slo_ms``, ``max_slowdown``,
    ``max_memory_mb``, ``cold_start_rate``, ``rate``, ``trace``, ``chain``,
    ``simplify_threshold``, ``min_memory``, ``parallel``, ``force_parallel``, ``profiles_dir``.

    Raises:
        MoparError: a subclass naming the argument at fault and the fix; an unknown option is
            an `OptionError` listing the valid ones.
    """
    config = compile_config(
        "partition", PLAN_OPTIONS, depth=depth, options=options, platform=platform
    )
    facts = facts_for(config, platform=platform)
    analysis = analyze_for(
        config, model, example_args, example_kwargs, trust_pickle=trust_pickle, progress=progress
    )
    return plan_from(analysis, config, predict(analysis.layers, config, facts=facts), facts=facts)


def analyze_for(
    config: CompileConfig,
    model: Model,
    example_args: ExampleArgs,
    example_kwargs: ExampleKwargs = None,
    *,
    trust_pickle: bool = False,
    progress: Progress | None = None,
) -> Analysis:
    """`analyze` as a compile with ``config`` captures: its depth, dynamic dimensions and
    generation step."""
    return analyze(
        model,
        example_args,
        example_kwargs,
        depth=config.depth,
        trust_pickle=trust_pickle,
        progress=progress,
        dynamic=config.dynamic,
        generate=config.generate,
        max_seq_len=config.max_seq_len,
        keep_positions=config.keep_positions,
    )


def facts_for(
    config: CompileConfig, *, platform: Platform | None = None, predictors: bool = True
) -> Facts:
    """The facts a compile with ``config`` plans with, loaded once from
    ``config.profiles_dir``: ``platform`` if given, else ``config.target``'s (with
    ``config.arch``), restricted to ``config.transport``; the predictors (unless not
    ``predictors``: `mopar.facts.load_facts`); the runtime figures."""
    from mopar.facts import load_facts
    from mopar.traffic import load_traffic

    return load_facts(
        config.profiles_dir,
        target=config.target,
        arch=config.arch,
        transport=config.transport,
        platform=platform,
        max_memory_mb=config.max_memory_mb,
        cold_start_rate=config.cold_start_rate,
        traffic=load_traffic(rate=config.rate, trace=config.trace),
        colocate=config.colocate,
        predictors=predictors,
    )


def plan_from(
    analysis: Analysis,
    config: CompileConfig,
    prediction: LayerPrediction,
    *,
    facts: Facts | None = None,
) -> Plan:
    """The `Plan` of an analysed model for ``config``, from per-layer ``prediction`` (and, for a
    mixture-of-experts model, its activation trace, traced here on ``config.calibration``); its
    notes begin with what was assumed to read the example inputs. ``facts``: as `facts_for`
    loads them (None: loaded here)."""
    from mopar import pipeline

    profiled = pipeline.Profile(layers=prediction, experts=pipeline.experts_of(analysis, config))
    return pipeline.plan(analysis, config, facts or facts_for(config), profiled).plan


def predict(
    lg: LayerGraph, config: CompileConfig, *, facts: Facts | None = None
) -> LayerPrediction:
    """The profiler's per-layer predictions (`LayerPrediction`) for layer graph ``lg``, from the
    predictors of ``facts`` (None: those in ``config.profiles_dir``, or the shipped ones when
    that folder has none)."""
    from mopar.profile.service import predict_layers

    return predict_layers(lg, (facts or facts_for(config)).predictors)


@python_terms
def compile(  # noqa: A001 - the verb users expect, like torch.compile
    model: Model,
    example_args: ExampleArgs = None,
    example_kwargs: ExampleKwargs = None,
    *,
    out: str | os.PathLike | None = None,
    depth: int | None = None,
    trust_pickle: bool = False,
    force: bool = False,
    platform: Platform | None = None,
    until: str | None = None,
    progress: Progress | None = None,
    **options: Any,
) -> Bundle:
    """Compile ``model`` into a bundle at ``out`` (written atomically) and verify it.

    ``model``, ``example_args``, ``example_kwargs``, ``depth``, ``trust_pickle`` and
    ``progress`` are as in `analyze`, ``platform`` as in `partition`; ``force`` replaces an
    existing ``out`` that is a bundle mopar wrote, and nothing else (`mopar.emit.bundle.check_out`,
    which checks ``out`` before any work); ``until`` stops after that stage (``"plan"``, ``"rewrite"`` or
    ``"export"``) and keeps what it made, a bundle that cannot run (`mopar.pipeline`).
    ``options`` are `CompileConfig` fields (``slices``, ``strategy``, ``target``, ``codec``,
    ``tolerance`` ...), and ``rtol``/``atol`` for the fields of ``tolerance``.

    Raises:
        MoparError: a subclass naming the argument at fault and the fix; an unknown option is
            an `OptionError` listing the valid ones.
    """
    if out is None:
        raise OptionError(
            "compile() needs out=, the folder to write the bundle to, e.g. "
            "mopar.compile(model, (x,), out='bundle')"
        )
    check_arguments(out=out, force=force)
    from mopar.emit.bundle import check_out

    check_out(Path(out), force=force)  # before any work: a refusal costs nothing
    if until is not None and until not in UNTIL:
        raise OptionError(
            f"until={until!r} is not a stage compile can stop after; choose one "
            f"of {', '.join(map(repr, UNTIL))}, or None for a whole bundle"
        )
    config = compile_config(
        "compile", COMPILE_OPTIONS, depth=depth, options=options, platform=platform
    )
    facts = facts_for(config, platform=platform)
    analysis = analyze_for(
        config, model, example_args, example_kwargs, trust_pickle=trust_pickle, progress=progress
    )
    return build_bundle(
        analysis, Path(out), config=config, force=force, progress=progress, facts=facts, until=until
    )


def build_bundle(
    analysis: Analysis,
    out: Path,
    *,
    config: CompileConfig,
    force: bool,
    progress: Progress | None,
    facts: Facts | None = None,
    until: str | None = None,
    hand_over: bool = False,
) -> Bundle | HandedOver:
    """Run the stages after capture on ``analysis`` (`mopar.pipeline.run`) and write the
    bundle at ``out``; with ``until``, stop after that stage; with ``hand_over``, stop where
    the rest needs no torch, if it does not (`mopar.pipeline.finish`). ``facts``: as
    `facts_for` loads them (None: loaded here)."""
    from mopar import pipeline

    return pipeline.run(
        analysis,
        Path(out),
        config=config,
        facts=facts or facts_for(config),
        force=force,
        progress=progress,
        until=until,
        hand_over=hand_over,
    )
