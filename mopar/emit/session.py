"""How onnxruntime holds a function's weights: the settings written beside its ``model.onnx``.

onnxruntime maps a function's external weights rather than copying them; what copies them is
two of its own optimisations, each measured on 256-512 MB models (docs/session-memory.md):

- **pre-packing** copies a MatMul's or Gemm's constant weights into the layout its kernels
  read, 0.11-0.16x the weights more at the peak. It pays from two rows on (2-8 rows: 2.2-2.6x
  slower without it), and over one row (a decoder's step, a batch of one through a classifier
  head) onnxruntime's vector kernel reads the weights as they are: 0.6-0.84x the time without
  it. So it is off where every weighted MatMul and Gemm sees one row. It packs a layer while
  the layer's mapped weights are resident, so at load it holds the largest layer twice
  (VGG-16's 392 MB Gemm: 855 MB at load, 535 MB after); it is off too where that layer passes
  the allowance below (a Gemm of 8 x 4096^2 over 4 rows: 1.23x the time without it).
- **the NCHWc layout** (graph optimisations at ``all``, not ``extended``) copies convolution
  weights into blocks of 16 channels, 0.27x of them more, for 1.15x the speed. It is kept while
  that copy stays within `COPY_ALLOWANCE` of the function's weights, or `COPY_FLOOR_MB`,
  whichever is more: a small function keeps its speed, a big one its memory.

- **constant folding** turns the casts of 16-bit weights (a bfloat16 model's, cast where they are
  used: `mopar.frontend.dtypes`) into float32 copies at load. Where a graph casts such weights
  it is off, each cast waits for its user's input (`cast_after_inputs`), and optimisations stop
  at ``extended``. 256 MB of bfloat16 MatMul weights then peaked at 336-344 MB over the
  baseline, against 552-585 MB as float32. A float16 graph is left to onnxruntime, which casts
  the weights of the operators it has no float16 kernel for itself, at load: with folding off
  they were cast at every run, all before their users (a 542M Llama in float16: 2,290 MB for
  1,034 MB of weights, 3x the time).

And one of glibc's: its mmap threshold, which rises as activations are freed until it serves
them from a heap that keeps them. In a function server that runs requests on several threads,
VGG-16's function (528 MB of weights) crept to a peak of 1,047-1,096 MB after 20 requests, and
to 621-622 MB with the threshold pinned at 1 MB (`PINNED_MMAP_THRESHOLD`), with p50s within
the noise. Functions of `PIN_FROM_MB` of weights or more pin it: their activations are small
against what they hold.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import onnx
from onnx import shape_inference

from mopar.runtime.handler import SESSION_FILE, saved_settings

__all__ = [
    "LAYOUT_COPY",
    "COPY_ALLOWANCE",
    "COPY_FLOOR_MB",
    "PIN_FROM_MB",
    "PINNED_MMAP_THRESHOLD",
    "session_settings",
    "write_session",
    "cast_after_inputs",
    "cast_share",
    "half_note",
]

LAYOUT_COPY = 0.27
"""The NCHWc layout's copy, in units of the convolution weights (measured)."""
COPY_ALLOWANCE = 0.15
"""What a function may spend on copies of its weights, in units of them (issue 50's bound)."""
COPY_FLOOR_MB = 64.0
"""The copy any function may spend however small its weights, MB."""
PIN_FROM_MB = 512.0
"""The weights from which a function pins glibc's mmap threshold, MB."""
PINNED_MMAP_THRESHOLD = 1 << 20
"""The threshold they pin, bytes."""

_MB = float(1 << 20)


def _bytes(t: onnx.TensorProto) -> int:
    return math.prod(t.dims) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def session_settings(model: onnx.ModelProto) -> dict[str, bool | int]:
    """The settings of ``model``'s session that differ from onnxruntime's defaults (an empty
    dict: none), as `mopar.runtime.handler.saved_settings` reads them."""
    graph = shape_inference.infer_shapes(model).graph
    weights = {t.name: _bytes(t) for t in graph.initializer}
    made = {o: n for n in graph.node for o in n.output}
    shapes = {
        v.name: [
            d.dim_value if d.HasField("dim_value") else 0 for d in v.type.tensor_type.shape.dim
        ]
        for v in [*graph.input, *graph.value_info, *graph.output]
    }

    def constant(name: str) -> bool:  # an initializer, or one transposed
        node = made.get(name)
        return name in weights or (
            node is not None and node.op_type == "Transpose" and node.input[0] in weights
        )

    half = {
        t.name
        for t in graph.initializer
        if t.data_type in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    }
    rows, packed, conv, cast = [], [0], 0, False
    for node in graph.node:
        if node.op_type == "Reshape" and node.input[0] in half:  # a cast that waits (below)
            half.add(node.output[0])
        cast = cast or (node.op_type == "Cast" and node.input[0] in half)
        if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and constant(node.input[1]):
            dims = shapes.get(node.input[0], [])
            transposed = node.op_type == "Gemm" and any(
                a.name == "transA" and a.i for a in node.attribute
            )
            lead = dims[-1:] if transposed else dims[:-1]
            rows.append(math.prod(lead) if dims and all(lead) else 0)  # 0: not static
            b = made[node.input[1]].input[0] if node.input[1] in made else node.input[1]
            packed.append(weights.get(b, 0))
        elif node.op_type == "Conv" and node.input[1] in weights:
            conv += weights[node.input[1]]
    settings: dict[str, bool | int] = {}
    total = sum(weights.values())
    allowance = max(COPY_ALLOWANCE * total, COPY_FLOOR_MB * _MB)
    if rows and (all(r == 1 for r in rows) or max(packed) > allowance):
        settings["prepacking"] = False
    if LAYOUT_COPY * conv > allowance:
        settings["layouts"] = False
    if cast:
        settings.update(folding=False, layouts=False)
    if total >= PIN_FROM_MB * _MB:
        settings["mmap_threshold"] = PINNED_MMAP_THRESHOLD
    return settings


def cast_after_inputs(graph: onnx.GraphProto) -> None:
    """Make each cast of a 16-bit weight wait for the activation its user reads, so that
    onnxruntime cannot run every cast first (it did: all of a 542M Llama's bfloat16 weights, cast
    to float32 at once, peaked at 2,745 MB for 1,034 MB of weights, 1,189 MB after this).

    The weight passes through a ``Reshape`` to its own shape, the shape concatenated with the
    empty ``Shape(activation, start=0, end=0)``: no copy, no arithmetic, one dependency. The
    activation is the first other input of the first node on from the cast (through nodes of one
    input and one output: a ``Transpose``)."""
    half = {
        t.name: list(t.dims)
        for t in graph.initializer
        if t.data_type in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    }
    constants = {t.name for t in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        activation, value = None, node.output[0] if node.output else ""
        while node.op_type == "Cast" and node.input[0] in half and readers.get(value):
            user = readers[value][0]
            activation = next(
                (i for i in user.input if i and i != value and i not in constants), None
            )
            if activation or len(user.output) != 1:
                break
            value = user.output[0]
        if activation:
            weight, tag = node.input[0], node.output[0]
            graph.initializer.append(
                onnx.helper.make_tensor(
                    f"{tag}_shape", onnx.TensorProto.INT64, [len(half[weight])], half[weight]
                )
            )
            nodes += [
                onnx.helper.make_node("Shape", [activation], [f"{tag}_after"], start=0, end=0),
                onnx.helper.make_node(
                    "Concat", [f"{tag}_shape", f"{tag}_after"], [f"{tag}_dims"], axis=0
                ),
                onnx.helper.make_node("Reshape", [weight, f"{tag}_dims"], [f"{tag}_waited"]),
            ]
            node.input[0] = f"{tag}_waited"
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


def write_session(path: Path) -> None:
    """Write the session settings of the function graph ``path`` (``model.onnx``) beside it,
    where any differ from the defaults (remove a stale file where none does); where its 16-bit
    weights are cast where used, rewrite it so that each cast waits for its user's input
    (`cast_after_inputs`)."""
    model = onnx.load(str(path), load_external_data=False)
    settings = session_settings(model)
    if settings.get("folding") is False:
        cast_after_inputs(model.graph)
        onnx.save(model, str(path))
    target = path.with_name(SESSION_FILE)
    if settings:
        target.write_text(json.dumps(settings, sort_keys=True) + "\n")
    else:
        target.unlink(missing_ok=True)


def cast_share(path: Path, *, runs: int = 3) -> float:
    """The share of the time of the function graph ``path`` that its casts of 16-bit weights
    take, under its session settings, over ``runs`` runs on made-up inputs (ones; every token
    id 0), as onnxruntime's own profile of its nodes gives it (0 where it has none)."""
    import numpy as np

    from mopar.runtime.handler import open_session

    settings = saved_settings(path.with_name(SESSION_FILE))
    with tempfile.TemporaryDirectory(prefix="mopar-profile-") as folder:
        session = open_session(path, 1, settings, profile_prefix=str(Path(folder) / "run"))
        kinds = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}
        kinds["tensor(float16)"] = np.float16
        feed: dict[str, Any] = {}
        for i in session.get_inputs():
            shape, kind = [d if isinstance(d, int) else 1 for d in i.shape], kinds.get(i.type)
            # token ids and masks 0, numbers 1
            floating = kind is None or kind is np.float16
            feed[i.name] = (np.ones if floating else np.zeros)(shape, kind or np.float32)
        for _ in range(runs + 1):
            session.run(None, feed)
        events = json.loads(Path(session.end_profiling()).read_text())
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    nodes = nodes[len(nodes) // (runs + 1) :]  # the first run warms up
    total = sum(e["dur"] for e in nodes)
    casts = sum(e["dur"] for e in nodes if e.get("args", {}).get("op_name") == "Cast")
    return casts / total if total else 0.0


def half_note(function: str, path: Path, *, max_slowdown: float) -> str | None:
    """The plan's note on function ``function``'s 16-bit weights, cast where used (graph
    ``path``): what the casts cost, measured (`cast_share`); None where it has none."""
    if saved_settings(path.with_name(SESSION_FILE)).get("folding") is not False:
        return None
    share = cast_share(path)
    text = (
        f"{function} holds its 16-bit weights at 2 bytes and casts them to float32 where they "
        f"are computed with: the casts took {share:.0%} of its time on this machine (measured "
        "over made-up inputs), and a MatMul cannot pre-pack weights cast at run time (a 542M "
        "Llama over 64 tokens ran 2.4x as long as with float32 weights, which hold twice the "
        "bytes: docs/exportable.md)"
    )
    if 1 / max(1 - share, 1e-9) > max_slowdown:  # the casts alone
        text += (
            f"; that is beyond the {max_slowdown:g}x latency bound: --quantize int8 holds 1 "
            "byte a weight and computes with it natively (docs/quantize.md)"
        )
    return text
