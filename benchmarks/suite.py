"""The benchmark suite: the paper's 12 models with their workloads, the strategies and ablations.

Read in this order: `SUITE` (model -> workload), `ABLATIONS` (which exist, and why the others are
skipped), `resolve_variants` (turn names into what the runner compiles), then `QUICK`.

A workload is the model's request: the input shapes the model is compiled and served with. They
are chosen so that request sizes (the bytes of the inputs) span the paper's range, from about
100 KB (a batch of 8 text lines for the CRNN) to about 90 MB (a 4,096-node graph), and so that
the full suite fits a 24 GB, 2-core machine. Text models take token ids, so their requests are
small in bytes (8-32 KB) whatever their activations weigh.
"""

from __future__ import annotations

from dataclasses import dataclass

from mopar.errors import MoparError
from mopar.planner import STRATEGIES

__all__ = [
    "BenchModel",
    "Variant",
    "SUITE",
    "ABLATIONS",
    "QUICK",
    "TORCH",
    "DEFAULT_VARIANTS",
    "resolve_models",
    "resolve_variants",
]


@dataclass(frozen=True, kw_only=True)
class BenchModel:
    """One model of the suite.

    Attributes:
        name: the `examples.EXAMPLES` key.
        family: ``cnn``, ``rnn``, ``gcn`` or ``transformer``.
        workload: the request in words (batch size or sequence length).
        inputs: ``--input`` specs of the full-size workload.
    """

    name: str
    family: str
    workload: str
    inputs: tuple[str, ...]

    def source(self, *, quick: bool) -> tuple[str, tuple[str, ...], str]:
        """(factory, input specs, workload in words): the tiny variant when ``quick``."""
        from examples import EXAMPLES

        ex = EXAMPLES[self.name]
        if quick:
            return ex.tiny_factory, ex.tiny_inputs, "tiny variant, " + " ".join(ex.tiny_inputs)
        return ex.factory, self.inputs, self.workload


def _text(batch: int, seq: int) -> tuple[str, ...]:
    return (f"input_ids={batch}x{seq}:int64:0..30000", f"attention_mask={batch}x{seq}:int64:1..2")


def _graph(nodes: int) -> tuple[str, ...]:
    return (f"x=1x{nodes}x1433:float32", f"adj=1x{nodes}x{nodes}:float32")


SUITE: dict[str, BenchModel] = {
    m.name: m
    for m in (
        BenchModel(
            name="resnet50",
            family="cnn",
            workload="batch 1, 224x224 image",
            inputs=("x=1x3x224x224:float32",),
        ),
        BenchModel(
            name="vgg16",
            family="cnn",
            workload="batch 4, 224x224 images",
            inputs=("x=4x3x224x224:float32",),
        ),
        BenchModel(
            name="inception_v3",
            family="cnn",
            workload="batch 1, 299x299 image",
            inputs=("x=1x3x299x299:float32",),
        ),
        BenchModel(
            name="convnext_tiny",
            family="cnn",
            workload="batch 8, 224x224 images",
            inputs=("x=8x3x224x224:float32",),
        ),
        BenchModel(
            name="lstm_cnn",
            family="rnn",
            workload="batch 8, 32x128 text lines",
            inputs=("x=8x1x32x128:float32",),
        ),
        BenchModel(
            name="gru_cnn",
            family="rnn",
            workload="batch 64, 32x128 text lines",
            inputs=("x=64x1x32x128:float32",),
        ),
        BenchModel(
            name="gcn", family="gcn", workload="Cora-sized graph, 2,708 nodes", inputs=_graph(2708)
        ),
        BenchModel(
            name="graphsage",
            family="gcn",
            workload="4,096-node graph, 1,433 features",
            inputs=_graph(4096),
        ),
        BenchModel(
            name="bert_mini",
            family="transformer",
            workload="batch 8, 128 tokens",
            inputs=_text(8, 128),
        ),
        BenchModel(
            name="bert_small",
            family="transformer",
            workload="batch 8, 256 tokens",
            inputs=_text(8, 256),
        ),
        BenchModel(
            name="distilbert",
            family="transformer",
            workload="batch 4, 384 tokens",
            inputs=_text(4, 384),
        ),
        BenchModel(
            name="bert", family="transformer", workload="batch 1, 512 tokens", inputs=_text(1, 512)
        ),
    )
}

ABLATIONS: dict[str, str | None] = {
    "min-memory": None,
    "no-codec": "codecs are opt-in (`mopar compile --codec`) and the bench's mopar runs without "
    "them on shm, where they do not pay: mopar already is the no-codec variant",
    "http": None,
    "horizontal": None,
}
"""Ablations of mopar (the paper's Fig. 13), by name: None where it runs, else why it cannot."""

HORIZONTAL_PARALLEL = 2
"""The cap on η of ``mopar+horizontal``: the planner shards a slice in two where it predicts a
gain. mopar itself runs as compiled by default, without sub-slices (``--parallel 1``), so the
paper's "no horizontal" ablation is measured the other way round: mopar against mopar with them."""

TORCH = "torch-unsplit"
"""The reference users would deploy instead: the model under eager PyTorch in one function
(`benchmarks.torch_ref`), measured in the same harness after the bundles."""

DEFAULT_VARIANTS: tuple[str, ...] = (
    TORCH,
    "unsplit",
    "uniform",
    "params",
    "latency",
    "mopar-paper",
    "mopar",
    *(f"mopar+{name}" for name in ABLATIONS),
)


@dataclass(frozen=True, kw_only=True)
class Variant:
    """One thing to compile per model.

    Attributes:
        label: the name in results (``mopar``, ``mopar+min-memory``, ``mopar@lambda``).
        strategy: the partition strategy.
        ablation: the ablation's name, or None.
        target: the platform it is planned for (None: the bench's target).
        min_memory: size every slice at its smallest memory (the min-memory ablation).
        transport: every cut planned for, and run through, this transport (None: the planner
            picks per cut, and the bench runs the bundle with shm handoff).
        parallel: the cap on η (sub-slices per slice) the planner may choose up to.
    """

    label: str
    strategy: str
    ablation: str | None = None
    target: str | None = None
    min_memory: bool = False
    transport: str | None = None
    parallel: int = 1


@dataclass(frozen=True, kw_only=True)
class Quick:
    """What ``--quick`` runs: tiny models, few strategies, few requests (under 3 minutes)."""

    models: tuple[str, ...] = ("resnet50", "gcn")
    variants: tuple[str, ...] = (TORCH, "unsplit", "mopar", "uniform", "mopar+http")
    requests: int = 5
    baseline_slices: int = 3  # mopar keeps tiny models whole; 3 slices exercise the cuts


QUICK = Quick()


def resolve_models(names: tuple[str, ...] | None) -> tuple[BenchModel, ...]:
    """The suite models named (None: all 12), checked."""
    if names is None:
        return tuple(SUITE.values())
    unknown = [n for n in names if n not in SUITE]
    if unknown:
        raise MoparError(f"unknown bench model {unknown[0]!r}; choose from {', '.join(SUITE)}")
    if not names:
        raise MoparError("no models to benchmark; pass --models NAME,NAME or drop --models")
    return tuple(SUITE[n] for n in names)


def resolve_variants(
    names: tuple[str, ...], *, target: str
) -> tuple[tuple[Variant, ...], tuple[dict, ...]]:
    """The variants to compile, and the skipped ones (``{"label", "reason"}``), for ``names``.

    ``mopar+min-memory`` plans for Lambda (the ablation changes nothing on OpenFaaS, where CPU
    does not follow memory); when the bench targets OpenFaaS, ``mopar@lambda`` (CPU-aware sizing
    on Lambda) is added as the reference it is compared with.
    """
    known = (TORCH, *STRATEGIES, *(f"mopar+{a}" for a in ABLATIONS))
    variants: list[Variant] = []
    skipped: list[dict] = []
    for name in dict.fromkeys(names):
        if name not in known:
            raise MoparError(f"unknown bench strategy {name!r}; choose from {', '.join(known)}")
        if name in STRATEGIES or name == TORCH:
            variants.append(Variant(label=name, strategy=name))
            continue
        ablation = name.removeprefix("mopar+")
        reason = ABLATIONS[ablation]
        if reason is not None:
            skipped.append({"label": name, "reason": reason})
            continue
        if ablation == "http":  # the same search, every cut priced and run as HTTP POSTs
            variants.append(
                Variant(label=name, strategy="mopar", ablation=ablation, transport="http")
            )
            continue
        if ablation == "horizontal":  # the same search, then η <= 2 where predicted faster
            variants.append(
                Variant(
                    label=name, strategy="mopar", ablation=ablation, parallel=HORIZONTAL_PARALLEL
                )
            )
            continue
        variants.append(
            Variant(
                label=name, strategy="mopar", ablation=ablation, target="lambda", min_memory=True
            )
        )
        if target != "lambda":
            variants.append(Variant(label="mopar@lambda", strategy="mopar", target="lambda"))
    if not variants:
        raise MoparError(
            f"nothing to run: {', '.join(names) or 'no strategies'} "
            f"{'are' if len(names) != 1 else 'is'} skipped; add a strategy such as "
            "unsplit or mopar"
        )
    labels = [v.label for v in variants]
    return tuple(v for k, v in enumerate(variants) if v.label not in labels[:k]), tuple(skipped)
