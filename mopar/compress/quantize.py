"""Quantised weights, chosen per function within a budget (``mopar compile --quantize``).

Read in this order: `FORMS` (what a function's weights can become), `write_form` (onnxruntime's
own quantisers make a form from the exported float function), then `choose_forms` (measure
every form, in each int8 scheme, of every function on held-out calibration samples, keep the
cheapest whose effect on the model's final outputs stays within the budget, then check all
choices together).

The forms, each made by `onnxruntime.quantization`:
- ``int8``: dynamic int8 for MatMul and Gemm with constant weights and for embedding tables
  (`quantize_dynamic`: weights int8 per output channel, activations quantised at run time), and
  static QDQ int8 for convolutions, per output channel, with activation ranges calibrated on the
  training samples (`quantize_static`); made in each int8 scheme the target's int8 kernels call
  for (`mopar.compress.kernels`: the weights' sign and range, the convolutions kept float).
- ``int4``: as ``int8``, but large MatMul weights (at least `LARGE_MATMUL` elements) are 4-bit,
  weight-only, in blocks of `INT4_BLOCK` (`MatMulNBitsQuantizer`: the MatMulNBits contrib op,
  computing in int8 where the CPU has it).

A form's price is what the platform bills one invocation of its function: the function's
predicted memory less the weight bytes it saves, at the time measured in onnxruntime scaled by
how much faster or slower the form ran than the float function here. Its quality is measured on
the model's final outputs, with only that function quantised (`mopar.compress.budget`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mopar._quiet import quiet_libraries
from mopar.bundle.layout import HOT_DIR, WEIGHTS_FILE
from mopar.compress.budget import Budget, Effect, attention_mask, effect_of, held_out_count
from mopar.compress.calibration import Calibration
from mopar.compress.kernels import SCHEMES, Scheme, schemes_for
from mopar.runner.inprocess import chain_sessions, run_chain, session

__all__ = [
    "FORMS",
    "LARGE_MATMUL",
    "Form",
    "Quantization",
    "Price",
    "write_form",
    "choose_forms",
    "weight_bytes",
]

FORMS = ("none", "int8", "int4")
"""A function's weights: as exported (float), int8, or int8 with large MatMuls in 4 bits."""

LARGE_MATMUL = 1 << 18
"""MatMul weights of at least this many elements (262,144: a 512x512 linear layer) get 4 bits in
the ``int4`` form; smaller ones stay int8, where 4 bits save little and cost accuracy."""

INT4_BLOCK = 32
"""Weights per 4-bit block (each block has its own scale)."""

QUANTIZABLE = {"Conv": 1, "MatMul": 1, "Gemm": 1, "Gather": 0}
"""The op types whose constant weights are quantised, and which input holds the weight (an
embedding table is a Gather's input 0)."""

MIN_TABLE = 1 << 16
"""Embedding tables (Gather) of at least this many elements are quantised."""


@dataclass(frozen=True, kw_only=True)
class Price:
    """What a function in some form would be billed: its memory size, MB, and the cost of a
    million invocations, USD."""

    memory_mb: int
    cost_per_1m_usd: float


@dataclass(frozen=True, kw_only=True)
class Form:
    """One function's weights in one form, measured on the held-out samples.

    Attributes:
        function: the plan function it belongs to.
        key: the model it is a form of: the function's name for its ``model.onnx``, a dispatch
            function's hot experts' name (`mopar.runner.inprocess`) for ``hot/model.onnx``.
        source: the float model file it replaces.
        form: one of `FORMS`.
        bytes: its model file and weights, bytes.
        float_bytes: the float function's, bytes.
        effect: what the form alone did to the model's final outputs.
        ms: its mean run time per held-out sample in onnxruntime here, ms.
        float_ms: the float function's, measured beside it.
        price: what the platform would bill for it.
    """

    function: str
    key: str
    source: Path
    form: str
    bytes: int
    float_bytes: int
    effect: Effect
    ms: float
    float_ms: float
    price: Price
    path: Path | None = None
    """Where the form was written (None: the float function, as exported)."""
    scheme: Scheme = Scheme()
    """How its int8 weights were made (`mopar.compress.kernels`; meaningless for ``none``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "form": self.form,
            **({"scheme": self.scheme.name} if self.form != "none" else {}),
            "bytes": self.bytes,
            "float_bytes": self.float_bytes,
            "ratio": round(self.float_bytes / max(self.bytes, 1), 3),
            **self.effect.to_dict(),
            "ms": round(self.ms, 3),
            "float_ms": round(self.float_ms, 3),
            "memory_mb": self.price.memory_mb,
            "cost_per_1m_usd": self.price.cost_per_1m_usd,
        }


@dataclass(frozen=True, kw_only=True)
class Quantization:
    """The chosen form of every function, and what they do to the final outputs together.

    Attributes:
        forms: the chosen `Form` (``none`` included) of every model, by `Form.key`.
        together: the effect of all of them at once on the held-out samples.
        held_out: how many held-out samples were measured.
        failed: the forms onnxruntime's quantisers could not make, each with its error.
    """

    forms: dict[str, Form]
    together: Effect
    held_out: int
    failed: tuple[str, ...] = ()
    measured: dict[str, tuple[Form, ...]] = dataclasses.field(default_factory=dict)
    """Every form of every function that was made and measured, by function."""


def weight_bytes(path: Path) -> int:
    """Bytes of the model file at ``path`` and of its weights file."""
    return sum(p.stat().st_size for p in (path, path.with_name(WEIGHTS_FILE)) if p.is_file())


# --- making a form -------------------------------------------------------------------------------


def _constant_ops(model) -> dict[str, list[tuple[str, int]]]:
    """Per quantisable op type, (node name, weight elements) of every node whose weight
    (`QUANTIZABLE`) is a floating-point initializer; tables under `MIN_TABLE` are left out."""
    import onnx

    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
    inits = {i.name: int(np.prod(i.dims)) for i in model.graph.initializer if i.data_type in floats}
    found: dict[str, list[tuple[str, int]]] = {}
    for node in model.graph.node:
        at = QUANTIZABLE.get(node.op_type)
        if at is None or len(node.input) <= at:
            continue
        weight = node.input[at]
        if weight in inits and (node.op_type != "Gather" or inits[weight] >= MIN_TABLE):
            found.setdefault(node.op_type, []).append((node.name, inits[weight]))
    return found


def _widen_casts(model) -> None:
    """Fold the casts of 16-bit weights to float32 (and the transposes of their results) into
    float32 initializers, so that the quantisers, which take only weights that are
    initializers, see a bfloat16 model's (`mopar.frontend.dtypes`) as they see a float32's."""
    import onnx
    from onnx import numpy_helper

    graph = model.graph
    consts = {t.name: t for t in graph.initializer}
    made: dict[str, onnx.NodeProto] = {o: n for n in graph.node for o in n.output}
    folded = set()
    for node in graph.node:
        source = node.input[0] if node.input else ""
        while source in made and made[source].op_type == "Reshape":  # a cast that waits
            source = made[source].input[0]
        kinds = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
        if node.op_type == "Cast" and source in consts and consts[source].data_type in kinds:
            value = numpy_helper.to_array(consts[source]).astype(np.float32)
        elif node.op_type == "Transpose" and source in folded:
            perm = [a.ints for a in node.attribute if a.name == "perm"]
            value = np.transpose(numpy_helper.to_array(consts[source]), *[list(p) for p in perm])
        else:
            continue
        consts[node.output[0]] = numpy_helper.from_array(
            np.ascontiguousarray(value), node.output[0]
        )
        graph.initializer.append(consts[node.output[0]])
        folded.add(node.output[0])
    keep = [n for n in graph.node if not (n.output and n.output[0] in folded)]
    read = {i for n in keep for i in n.input} | {o.name for o in graph.output}
    while True:  # the waits' Shape, Concat and Reshape, and the 16-bit weights, now unread
        dead = [n for n in keep if not any(o in read for o in n.output)]
        if not dead:
            break
        keep = [n for n in keep if n not in dead]
        read = {i for n in keep for i in n.input} | {o.name for o in graph.output}
    del graph.node[:]
    graph.node.extend(keep)
    live = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(live)


class _Feeds:
    """onnxruntime's CalibrationDataReader over a list of feeds."""

    def __init__(self, feeds: Sequence[dict[str, np.ndarray]]):
        self._feeds = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)

    def rewind(self) -> None:  # onnxruntime's reader protocol; one pass is all it takes here
        pass


def write_form(
    source: Path,
    folder: Path,
    form: str,
    feeds: Sequence[dict[str, np.ndarray]],
    scheme: Scheme = SCHEMES[0],
) -> Path | None:
    """Write the float function at ``source`` in ``form`` as ``folder/model.onnx`` (and its
    weights file); None where ``form`` changes nothing in it (no weight it applies to).

    ``feeds``: the function's inputs on the training samples, which calibrate the activation
    ranges of the static QDQ convolutions. ``scheme``: how its int8 weights are made (their
    sign and range, and the convolutions left float: `mopar.compress.kernels`).
    """
    import onnx
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    if form == "none":
        return None
    model = onnx.load(str(source))
    _widen_casts(model)
    for i, node in enumerate(model.graph.node):  # the quantisers pick nodes by name
        node.name = node.name or f"{node.op_type}_{i}"
    ops = _constant_ops(model)
    large = [n for n, size in ops.get("MatMul", ()) if size >= LARGE_MATMUL]
    small = [n for n, size in ops.get("MatMul", ()) if size < LARGE_MATMUL]
    if not ops or (form == "int4" and not large):
        return None
    folder.mkdir(parents=True, exist_ok=True)
    step = 0
    weight_type = QuantType.QInt8 if scheme.weights == "s8" else QuantType.QUInt8
    kept = [n for n, _ in ops.get("Conv", ())][: scheme.float_convs]

    def next_path() -> Path:
        nonlocal step
        step += 1
        return folder / f"step{step}.onnx"

    def settled(model: onnx.ModelProto) -> Path:
        """``model`` written as the next step's input, without the shapes the exporter or a
        step recorded: the next step infers its own, and onnx's inference refuses stale ones
        that disagree with them."""
        to = next_path()
        del model.graph.value_info[:]
        onnx.save_model(model, str(to), save_as_external_data=True, location=f"{to.name}.data")
        return to

    current = settled(model)
    with quiet_libraries(), _no_logging():
        if "Conv" in ops:
            out = next_path()
            quantize_static(
                str(current),
                str(out),
                _Feeds(feeds),
                quant_format=QuantFormat.QDQ,
                # with its Clip or Relu, a convolution's output is quantised over the
                # activation's range; without, over its own (EfficientNet-Lite0's ReLU6 got
                # 6 levels of [0, 6] from [-115, 143])
                op_types_to_quantize=["Conv", "Clip", "Relu"],
                nodes_to_exclude=kept,
                per_channel=True,
                reduce_range=scheme.reduce_range,
                activation_type=QuantType.QUInt8,
                weight_type=weight_type,
                calibrate_method=CalibrationMethod.MinMax,
                use_external_data_format=True,
            )
            current = settled(onnx.load(str(out)))
        if form == "int4":
            quantizer = MatMulNBitsQuantizer(
                onnx.load(str(current)),
                bits=4,
                block_size=INT4_BLOCK,
                is_symmetric=True,
                accuracy_level=4,
                nodes_to_exclude=small,  # its nodes_to_include adds to the op types
                op_types_to_quantize=("MatMul",),
            )
            quantizer.process()
            out = next_path()
            quantizer.model.save_model_to_file(str(out), use_external_data_format=True)
            current = settled(onnx.load(str(out)))
        # onnxruntime's dynamic quantiser turns a Gemm into a float MatMul (it has no integer
        # Gemm) and quantises MatMuls, so a second pass takes the MatMuls the first one made
        dynamic = sorted({"MatMul", "Gemm", "Gather"} & set(ops))
        if "Gemm" in ops:
            dynamic = sorted({*dynamic, "MatMul"})
        for _ in range(0 if not dynamic else 2 if "Gemm" in ops else 1):
            out = next_path()
            quantize_dynamic(
                str(current),
                str(out),
                op_types_to_quantize=dynamic,
                nodes_to_exclude=_small_tables(model),
                per_channel=True,  # per tensor, BERT-like layers lost 10x the accuracy here
                reduce_range=scheme.reduce_range,
                weight_type=weight_type,
                use_external_data_format=True,
                # a value past a contrib op (MatMulNBits) has no inferred type; it is float
                # (MiniLM's int4 failed without this)
                extra_options={
                    "MatMulConstBOnly": True,
                    "DefaultTensorType": onnx.TensorProto.FLOAT,
                },
            )
            current = settled(onnx.load(str(out)))
    final = folder / "model.onnx"
    model = onnx.load(str(current))
    onnx.save_model(
        model, str(final), save_as_external_data=True, location=WEIGHTS_FILE, size_threshold=1024
    )
    for p in folder.glob("step*"):
        p.unlink()
    return final


@contextlib.contextmanager
def _no_logging():
    """onnxruntime's quantisers log every node they visit, at INFO on the root logger."""
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def _small_tables(model) -> list[str]:
    """Gather nodes whose table is under `MIN_TABLE` elements (or not a weight at all): left
    float, where int8 saves nothing worth its error."""
    big = {n for n, _ in _constant_ops(model).get("Gather", ())}
    return [n.name for n in model.graph.node if n.op_type == "Gather" and n.name not in big]


# --- choosing ------------------------------------------------------------------------------------


def choose_forms(
    model_paths: Sequence[Path],
    units: Sequence[Any],
    outputs: Sequence[str],
    calibration: Calibration,
    *,
    mode: str,
    budget: Budget,
    price: Callable[[str, int, float], Price],
    max_slowdown: float | None,
    scratch: Path,
    kernels: tuple[str, str] = ("avx2", "avx2"),
    progress: Callable[[str, int, int], None] | None = None,
) -> Quantization:
    """The form of every unit's weights: each measured alone, then all together.

    Args:
        model_paths: each unit's exported float ``model.onnx``, in plan order.
        units: the units (`mopar.runner.inprocess` says what it reads of them).
        outputs: the value names of the model's final outputs.
        mode: ``auto`` (the cheapest form within ``budget``), ``int8`` or ``int4`` (that form
            wherever it applies and, with a lossy ``budget``, stays within it).
        price: ``(function, bytes saved, time ratio) -> Price`` of the function in a form.
        max_slowdown: a form whose measured time is over this multiple of the float
            function's is not taken (None: no bound).
        scratch: a folder for the forms; the chosen ones are ``scratch/<unit>/<form>/<scheme>/``.
        kernels: the int8 kernels of the target and of this machine (`mopar.compress.kernels`):
            which int8 schemes are measured (`schemes_for`).

    Returns:
        The `Quantization`: the chosen `Form` of each unit's model and of each dispatch
        function's hot experts (by `Form.key`), and their effect together.
    """
    train, held = calibration.split(held_out_count(len(calibration.samples), budget))
    floats = chain_sessions(model_paths, units)
    train_values = [run_chain(floats, units, s) for s in train]
    held_values, float_ms = _timed(floats, units, held)
    references = [{n: v[n] for n in outputs} for v in held_values]
    masks = [attention_mask(s) for s in held]
    measured: dict[str, list[Form]] = {}
    failed: list[str] = []
    forms = FORMS[1:] if mode == "auto" else (mode,)
    parts = _parts(model_paths, units)
    function_ms: dict[str, float] = {}
    for part in parts:
        function_ms[part.function] = function_ms.get(part.function, 0.0) + float_ms.get(
            part.key, 0.0
        )

    def priced(part: _Part, saved: int, ms: float) -> Price:
        whole = function_ms[part.function]
        ratio = (whole - float_ms.get(part.key, 0.0) + ms) / whole if whole > 0 else 1.0
        return price(part.function, saved, ratio)

    for i, part in enumerate(parts):
        if progress:
            progress(f"quantize {part.key}", i, len(parts))
        plain = weight_bytes(part.path)
        ms = float_ms.get(part.key, 0.0)
        none = Form(
            function=part.function,
            key=part.key,
            source=part.path,
            form="none",
            bytes=plain,
            float_bytes=plain,
            effect=Effect(error=0.0),
            ms=ms,
            float_ms=ms,
            price=priced(part, 0, ms),
        )
        measured[part.key] = [none]
        feeds = [] if part.experts else [{n: v[n] for n in part.inputs} for v in train_values]
        convs = _has_conv(part.path)
        for form in forms:
            if form != "int8" and part.experts:  # small linear layers: int8 is enough
                continue
            if not feeds and convs:
                continue  # experts with a convolution: nothing to calibrate it on
            int8 = [f for f in measured[part.key] if f.form == "int8"]
            schemes = (
                schemes_for(*kernels, convs=convs)
                if form == "int8"
                else (min(int8, key=_loss).scheme if int8 else Scheme(reduce_range=True),)
            )
            for scheme in schemes:
                where = scratch / part.key / form / scheme.name.replace(" ", "_").replace(",", "")
                try:
                    made = write_form(part.path, where, form, feeds, scheme)
                except Exception as exc:  # noqa: BLE001 - onnxruntime's quantisers raise anything
                    failed.append(
                        f"{part.key} {form} {scheme.name} ({type(exc).__name__}: {exc})"[:200]
                    )
                    continue
                if made is None:
                    break
                got, times = _timed({**floats, part.key: session(made)}, units, held)
                size = weight_bytes(made)
                found = dataclasses.replace(
                    none,
                    form=form,
                    scheme=scheme,
                    bytes=size,
                    effect=effect_of(
                        references, [{n: v[n] for n in outputs} for v in got], masks=masks
                    ),
                    ms=times.get(part.key, 0.0),
                    path=made,
                    price=priced(part, plain - size, times.get(part.key, 0.0)),
                )
                measured[part.key].append(found)
                if mode == "auto" and budget.admits(found.effect):
                    break  # the schemes after it are slower, or keep more weights float
    chosen = {
        name: _cheapest(found, mode=mode, budget=budget, max_slowdown=max_slowdown)
        for name, found in measured.items()
    }
    chosen, together = _fit_together(
        chosen, measured, floats, units, held, references, outputs, budget, masks
    )
    return Quantization(
        forms=chosen,
        together=together,
        held_out=len(held),
        failed=tuple(failed),
        measured={n: tuple(found) for n, found in measured.items()},
    )


@dataclass(frozen=True)
class _Part:
    """A model file of a unit that has weights of its own: the unit's ``model.onnx``, or a
    dispatch function's hot experts (``hot/model.onnx``). Experts get ``int8`` only and are
    calibrated on nothing (their linear layers need no activation ranges)."""

    key: str
    function: str
    path: Path
    experts: bool
    inputs: tuple[str, ...]


def _parts(model_paths: Sequence[Path], units: Sequence[Any]) -> list[_Part]:
    parts = []
    for path, unit in zip(model_paths, units, strict=True):
        tail = unit.dispatch.tail if unit.dispatch is not None else unit
        names = tuple(t.name for t in tail.inputs)
        parts.append(_Part(unit.name, unit.name, path, bool(unit.rows), names))
        if unit.dispatch is not None and unit.dispatch.hot is not None:
            hot = path.parent / HOT_DIR / "model.onnx"
            parts.append(_Part(unit.dispatch.spec.local, unit.name, hot, True, ()))
    return parts


def _has_conv(path: Path) -> bool:
    import onnx

    return "Conv" in _constant_ops(onnx.load(str(path), load_external_data=False))


TIMED_PASSES = 3
"""Timed passes over the held-out samples, after one untimed: a unit's time is its fastest."""


def _timed(
    sessions: Mapping[str, Any], units: Sequence[Any], held: Sequence[dict]
) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
    """The chain's values on every held-out sample, and each unit's time per sample, ms: the
    fastest of `TIMED_PASSES` passes after an untimed one (a session's first runs are slow)."""
    values = [run_chain(sessions, units, s) for s in held]
    best: dict[str, float] = {}
    for _ in range(TIMED_PASSES):
        times: dict[str, float] = {}
        for s in held:
            run_chain(sessions, units, s, times_ms=times)
        for name, ms in times.items():
            best[name] = min(best.get(name, float("inf")), ms / len(held))
    return values, best


def _cheapest(
    found: Sequence[Form], *, mode: str, budget: Budget, max_slowdown: float | None
) -> Form:
    """``auto``: the cheapest form within the budget and no slower than ``max_slowdown``
    allows; a forced form: that one wherever it applies, in its cheapest scheme within a lossy
    budget, else in its most exact."""
    none, forms = found[0], found[1:]
    if mode != "auto":
        within = [f for f in forms if not budget.lossy or budget.admits(f.effect)]
        if not within:
            return none
        if budget.lossy:
            return min(within, key=lambda f: (f.price.cost_per_1m_usd, f.bytes))
        # no budget: the form's most exact scheme of those no slower than float
        return min([f for f in within if f.ms <= f.float_ms] or within, key=_loss)
    pool = [
        f
        for f in forms
        if budget.admits(f.effect) and (max_slowdown is None or f.ms <= f.float_ms * max_slowdown)
    ]
    return min([none, *pool], key=lambda f: (f.price.cost_per_1m_usd, f.bytes))


def _fit_together(
    chosen: dict[str, Form],
    measured: Mapping[str, Sequence[Form]],
    floats: Mapping[str, Any],
    units: Sequence[Any],
    held: Sequence[dict],
    references: Sequence[dict],
    outputs: Sequence[str],
    budget: Budget,
    masks: Sequence[np.ndarray | None],
) -> tuple[dict[str, Form], Effect]:
    """Every chosen form at once, and what they do together; while the outputs leave the
    budget, the function whose form changed them most on its own steps back to its next more
    exact form."""
    chosen = dict(chosen)
    while True:
        lossy = [f for f in chosen.values() if f.path is not None]
        if not lossy:
            return chosen, Effect(error=0.0)
        sessions = {**floats, **{f.key: session(f.path) for f in lossy}}
        got = [run_chain(sessions, units, s) for s in held]
        effect = effect_of(references, [{n: v[n] for n in outputs} for v in got], masks=masks)
        if not budget.lossy or budget.admits(effect):
            return chosen, effect
        worst = max(lossy, key=lambda f: f.effect.error)
        exact = [f for f in measured[worst.key] if _loss(f) < _loss(worst)]
        chosen[worst.key] = min(exact, key=lambda f: (f.price.cost_per_1m_usd, f.bytes))


def _loss(form: Form) -> tuple[float, float, float]:
    """How much ``form`` changed the outputs, least first: top-1 change, cosine, error."""
    e = form.effect
    return (e.top1_change or 0.0, -(1.0 if e.cosine is None else e.cosine), e.error)
