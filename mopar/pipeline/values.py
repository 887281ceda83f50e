"""The typed values the compile stages hand each other, and the stage names and clock."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mopar.config import Tolerance

if TYPE_CHECKING:
    import torch
    from torch import nn

    from mopar.bundle.document import LatencyCheck
    from mopar.frontend import CapturedModel
    from mopar.frontend.generate import StepNames
    from mopar.ir import LayerGraph
    from mopar.ir.moe import MoeBlock
    from mopar.ir.subgraph import SliceModule
    from mopar.plan import Plan
    from mopar.profile.experts import Experts
    from mopar.profile.service import LayerPrediction
    from mopar.profile.shards import ShardAnalysis


log = logging.getLogger(__name__)

STAGES = (
    "capture",
    "profile",
    "plan",
    "rewrite",
    "compress",
    "export",
    "quantize",
    "verify",
    "measure",
    "emit",
)
"""The stages of a compile, in order."""

UNTIL = ("plan", "rewrite", "export")
"""The stages a compile may stop after (``--until``)."""

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, kw_only=True)
class Analysis:
    """A captured model and its layer graph.

    Attributes:
        captured: the model, its example inputs and reference outputs
            (`mopar.frontend.CapturedModel`).
        layers: its layer graph (`mopar.ir.LayerGraph`).
        seconds: how long capturing took, s (the capture stage).
        moe: the mixture-of-experts blocks found (`mopar.ir.moe.MoeBlock`), each now one
            layer of ``layers`` holding its experts' dense translation.
        experts: each block's expert modules, by block name (an expert maps (n, H) to (n, H)).
        generation: a ``--generate`` capture's step names
            (`mopar.frontend.generate.StepNames`), else None.
    """

    captured: CapturedModel
    layers: LayerGraph
    seconds: float
    moe: tuple[MoeBlock, ...] = ()
    experts: Mapping[str, Sequence[nn.Module]] | None = None
    generation: StepNames | None = None


@dataclass(frozen=True, kw_only=True)
class Profile:
    """What the profile stage measured of an analysed model, for every planning round.

    Attributes:
        layers: the profiler's per-layer memory and time predictions.
        experts: a mixture-of-experts model's blocks and activation trace (None: no blocks).
    """

    layers: LayerPrediction
    experts: Experts | None


@dataclass(frozen=True, kw_only=True)
class Planned:
    """The plan stage's result: the plan, and the sharding analysis its η were chosen from,
    which the rewrite builds the sub-slices of (None: ``--parallel`` 1, or expert functions).
    """

    plan: Plan
    shards: ShardAnalysis | None = None


@dataclass(frozen=True, kw_only=True)
class StageTime:
    """How long one stage took, in all its runs, s."""

    stage: str
    seconds: float


@dataclass(frozen=True, kw_only=True)
class Bundle:
    """A written bundle, or what a compile stopped with.

    Attributes:
        path: the bundle folder.
        plan: the Plan it carries out.
        max_abs_err: onnxruntime chain vs the original model, absolute (None: not verified,
            the compile stopped before).
        max_rel_err: the same, relative to the largest reference magnitude (None: likewise).
        tolerance: the allclose tolerances it was (or would be) verified with.
        until: the stage the compile stopped after (None: a whole bundle).
        stages: the seconds of each stage that ran, in order.
    """

    path: Path
    plan: Plan
    max_abs_err: float | None
    max_rel_err: float | None
    tolerance: Tolerance
    until: str | None = None
    stages: tuple[StageTime, ...] = ()


@dataclass(frozen=True)
class HandedOver:
    """A compile stopped where the rest needs no torch, for `mopar.pipeline.finish.finish` to
    carry out in another process: the staged folder, released to it."""

    staged: Path


class Stopwatch:
    """Seconds per stage, each stage's own: a stage that runs inside another (rewrite inside
    export, when the export stage moves a cut) pauses the outer one. Each finished run is an
    INFO record (``mopar -v`` shows them)."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._running: list[list] = []  # [stage, seconds so far] of each stage running
        self._since = 0.0

    def add(self, name: str, seconds: float) -> None:
        """Count ``seconds`` under stage ``name`` (a stage timed, and logged, elsewhere)."""
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block as stage ``name``."""
        self._tick()
        self._running.append([name, 0.0])
        try:
            yield
        finally:
            self._tick()
            _, seconds = self._running.pop()
            self.add(name, seconds)
            log.info("stage %s: %.3f s", name, seconds)

    def _tick(self) -> None:
        now = time.perf_counter()
        if self._running:
            self._running[-1][1] += now - self._since
        self._since = now

    def times(self) -> tuple[StageTime, ...]:
        """The stages timed so far, those still running included, in pipeline order."""
        self._tick()
        seconds = dict(self._seconds)
        for name, so_far in self._running:
            seconds[name] = seconds.get(name, 0.0) + so_far
        return tuple(
            StageTime(stage=s, seconds=round(seconds[s], 3)) for s in STAGES if s in seconds
        )


@dataclass(frozen=True, kw_only=True)
class Realised:
    """A plan made concrete for export: its executable units and the tensors between them."""

    plan: Plan  # the plan, with the codec choices when --codec
    slices: tuple[SliceModule, ...]  # one per unit, in plan order
    values: dict[str, torch.Tensor]  # every tensor on the example inputs, by value name
    codecs: dict[str, str]  # runtime codec of each cut tensor
    tolerance: Tolerance  # what verification holds the bundle to
    # a slice function's predicted (t1, parallel) ms at one vCPU (`mopar.planner.sizing`)
    compute: Mapping[str, tuple[float, float]] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Exported:
    """Every unit of a plan, exported: what it was realised as, and each unit's ONNX file."""

    realised: Realised
    paths: tuple[Path, ...]


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What serving the units found: the plan sized to cover it, each unit's peak RSS (MB)
    and median time (ms), the request's median latency (ms), the process the peaks were
    measured in (`mopar.runner.report.RunReport.served_by`), and, under the default objective,
    the latency check's record (`mopar.bundle.document.LatencyCheck`) for ``plan.json``."""

    plan: Plan
    peaks_mb: dict[str, float]
    p50_ms: dict[str, float]
    latency_ms: float
    measured_in: str = ""
    check: LatencyCheck | None = None


@dataclass(frozen=True, kw_only=True)
class Reference:
    """The unsplit model exported to a scratch folder, served beside the plan
    (`CompileConfig.check_latency`): the folder and its realised unit."""

    root: Path
    realised: Realised


def tell_progress(progress: Progress | None, phase: str, done: int, total: int) -> None:
    log.info("%s (%d/%d)", phase, done, total)
    if progress is not None:
        progress(phase, done, total)
