"""Feature vectors for the memory and time predictors, per operator or per layer.

Read in this order: `FAMILIES` and `FEATURE_NAMES` (the fixed vector layout), `op_family` (op names
to families), `row_family` and `feature_vector` (a row to numbers), `Roofline` and
`time_features` (what the time predictor adds), then the graph side: `node_features`
and `layer_features`.

A *row* is a plain mapping, so that one schema serves both a measured sample (a CSV row) and a
layer or operator of a LayerGraph. Keys (all but ``op_type`` optional; a missing or blank number
counts 0):

    op_type       an ATen, ONNX or family name: ``aten.conv2d.default``, ``Conv``, ``conv``
    family        the op family, already resolved; wins over ``op_type`` when it is one of FAMILIES
    params        parameter elements
    param_bytes   parameter bytes
    flops         forward FLOPs (a multiply-add counts 2)
    bytes_in      bytes of the activation inputs (parameters excluded)
    bytes_out     bytes of the outputs
    input_shapes  shapes of the activation inputs (parameters excluded): a list of lists or its JSON
    output_shape  the output's shape (the largest one if there are several): a list or its JSON
    n_inputs      number of activation inputs (default: ``len(input_shapes)``)
    batch_size    default: the first dim of the first input, else of the output
    kernel_size   the largest kernel extent (3 for 3x3, 7 for 1x7); pools default to in/out extent
    channels      default from the family and ``output_shape``: dim 1 for conv, batch norm and pool
                  (NCHW), the last dim for gemm, matmul, attention, layer norm, embedding, LSTM, GRU
    groups        convolution groups (default 1); groups == input channels > 1: depthwise

Only `feature_vector` and the helpers above it run on CSV rows; they import neither torch nor
the compiler, so that training and reporting stay light.
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from torch import fx

    from mopar.ir import Layer, LayerGraph

__all__ = [
    "FAMILIES",
    "FEATURE_NAMES",
    "ALIAS_OPS",
    "op_family",
    "row_family",
    "feature_vector",
    "feature_matrix",
    "TIME_FEATURE_NAMES",
    "Roofline",
    "roofline_inputs",
    "time_features",
    "node_features",
    "layer_features",
]

FAMILIES: tuple[str, ...] = (
    "conv",
    "depthwise_conv",
    "gemm",
    "matmul",
    "batched_matmul",
    "attention",
    "lstm",
    "gru",
    "layer_norm",
    "batch_norm",
    "pool",
    "embedding",
    "softmax",
    "elementwise",
    "other",
)
_LOG_FIELDS = (
    "params",
    "param_bytes",
    "flops",
    "bytes_in",
    "bytes_out",
    "max_input_numel",
    "output_numel",
)
_RAW_FIELDS = ("n_inputs", "output_rank", "batch_size", "kernel_size", "channels")
FEATURE_NAMES: tuple[str, ...] = (
    *(f"op_{f}" for f in FAMILIES),
    *(f"log1p_{f}" for f in _LOG_FIELDS),
    *_RAW_FIELDS,
)

# ATen ops that allocate nothing: views, tuple access and shape metadata. They hold no memory of
# their own (the tensor they alias is counted where it was made).
ALIAS_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "permute",
        "transpose",
        "t",
        "expand",
        "expand_as",
        "unsqueeze",
        "squeeze",
        "flatten",
        "unflatten",
        "select",
        "slice",
        "narrow",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "alias",
        "detach",
        "as_strided",
        "view_as",
        "getitem",
        "dropout",
        "native_dropout",
        "sym_size",
        "size",
        "_assert_tensor_metadata",
        "_assert_scalar",
        "sym_constrain_range_for_size",
    }
)


# --- op names to families ----------------------------------------------------------------------


def _key(name: str) -> str:
    """A lookup key: ``aten.native_layer_norm.default`` -> ``nativelayernorm``."""
    parts = [p for p in str(name).strip().split(".") if p]
    while len(parts) > 1 and parts[0].lower() in ("torch", "ops", "aten", "onnx", "ai"):
        parts = parts[1:]
    return (parts[0] if parts else "").lower().replace("_", "")


_FAMILY_OF: dict[str, str] = {}
for _family, _names in {
    "conv": (
        "conv",
        "conv1d",
        "conv2d",
        "conv3d",
        "convolution",
        "convtranspose",
        "convtranspose1d",
        "convtranspose2d",
        "convtranspose3d",
    ),
    "depthwise_conv": ("depthwise_conv",),
    "gemm": ("gemm", "linear", "addmm", "mm", "dense"),
    "matmul": ("matmul", "mv", "dot", "einsum"),
    "batched_matmul": ("batched_matmul", "bmm", "baddbmm"),
    "attention": ("attention", "multiheadattention", "scaleddotproductattention"),
    "lstm": ("lstm",),
    "gru": ("gru",),
    # Per-sample normalisations with affine parameters share the layer-norm family.
    "layer_norm": (
        "layer_norm",
        "nativelayernorm",
        "layernormalization",
        "rmsnorm",
        "simplifiedlayernormalization",
        "groupnorm",
        "groupnormalization",
        "instancenorm",
        "instancenormalization",
    ),
    "batch_norm": (
        "batch_norm",
        "nativebatchnorm",
        "nativebatchnormlegitnotraining",
        "batchnormalization",
    ),
    "pool": ("pool",),
    "embedding": ("embedding", "embeddingbag", "gather"),
    "softmax": ("softmax", "logsoftmax"),
    "elementwise": (
        "elementwise",
        "add",
        "sub",
        "rsub",
        "mul",
        "div",
        "truediv",
        "floordiv",
        "neg",
        "abs",
        "exp",
        "log",
        "log1p",
        "sqrt",
        "rsqrt",
        "pow",
        "reciprocal",
        "relu",
        "relu6",
        "leakyrelu",
        "prelu",
        "elu",
        "selu",
        "celu",
        "gelu",
        "silu",
        "swish",
        "mish",
        "sigmoid",
        "hardsigmoid",
        "hardswish",
        "hardtanh",
        "tanh",
        "softplus",
        "softsign",
        "clamp",
        "clip",
        "maximum",
        "minimum",
        "where",
        "erf",
        "sin",
        "cos",
        "sign",
        "floor",
        "ceil",
        "round",
        "maskedfill",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "equal",
        "greater",
        "less",
        "logicaland",
        "logicalor",
        "logicalnot",
        "addcmul",
        "lerp",
        "identity",
    ),
    "other": ("other",),
}.items():
    for _name in _names:
        _FAMILY_OF[_key(_name)] = _family


def op_family(op_type: str) -> str:
    """The family of an op named in ATen, ONNX or family terms; unknown names are ``other``.

    The name alone cannot tell a depthwise conv or a batched matmul; `row_family` refines those
    from the row's groups and input shapes.
    """
    key = _key(op_type)
    if key in _FAMILY_OF:
        return _FAMILY_OF[key]
    if "attention" in key:  # _scaled_dot_product_flash_attention and kin
        return "attention"
    if "softmax" in key:
        return "softmax"
    if "pool" in key:  # max_pool2d, adaptive_avg_pool2d, GlobalAveragePool, ...
        return "pool"
    if key.startswith("conv"):
        return "conv"
    return "other"


# --- rows to numbers -----------------------------------------------------------------------------


def _decode(value: Any) -> Any:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, (str, bytes)):
        return json.loads(value) if str(value).strip() else None
    return value


def _as_shape(value: Sequence[Any]) -> tuple[int, ...]:
    return tuple(int(d) for d in value)


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _input_shapes(row: Mapping[str, Any]) -> list[tuple[int, ...]]:
    value = _decode(row.get("input_shapes"))
    if not value:
        return []
    if all(isinstance(d, (int, float)) for d in value):  # one flat shape
        return [_as_shape(value)]
    return [_as_shape(s) for s in value]


def _output_shape(row: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The output's shape; of several (a nested list), the largest; None when unknown."""
    value = _decode(row.get("output_shape"))
    if value is None:
        return None
    if value and not all(isinstance(d, (int, float)) for d in value):
        return max((_as_shape(s) for s in value), key=_numel, default=None)
    return _as_shape(value)


def _number(row: Mapping[str, Any], key: str) -> float | None:
    """The row's number at ``key``; None when missing, blank or NaN (as CSV readers give them)."""
    value = row.get(key)
    if isinstance(value, (str, bytes)):
        value = value.strip() or None
    if value is None:
        return None
    number = float(value)
    return None if math.isnan(number) else number


def row_family(row: Mapping[str, Any]) -> str:
    """The family of a row: ``family`` if set, else ``op_type`` refined by groups and shapes.

    Raises:
        KeyError: the row has neither ``family`` nor ``op_type``.
    """
    family = row.get("family")
    if isinstance(family, str) and family in FAMILIES:
        return family
    if "op_type" not in row:
        raise KeyError(f"a feature row needs an 'op_type' (or a 'family'); it has {sorted(row)}")
    family = op_family(str(row["op_type"]))
    inputs = _input_shapes(row)
    if family == "conv":
        groups = _number(row, "groups") or 1
        in_channels = inputs[0][1] if inputs and len(inputs[0]) > 1 else 0
        if groups > 1 and groups == in_channels:
            return "depthwise_conv"
    if family == "matmul" and len(inputs) >= 2 and min(len(inputs[0]), len(inputs[1])) >= 3:
        return "batched_matmul"
    return family


def _default_channels(family: str, out: tuple[int, ...] | None) -> int:
    if not out:
        return 0
    if family in ("conv", "depthwise_conv", "batch_norm", "pool"):
        return out[1] if len(out) > 1 else 0
    if family in (
        "gemm",
        "matmul",
        "batched_matmul",
        "attention",
        "layer_norm",
        "embedding",
        "lstm",
        "gru",
    ):
        return out[-1]
    return 0


def _default_kernel(family: str, inputs: list[tuple[int, ...]], out: tuple[int, ...] | None) -> int:
    # A pool's window is about its input extent over its output extent (exact for adaptive and
    # non-overlapping pools). A conv's kernel cannot be told from shapes alone: 0 (unknown).
    if family != "pool" or not inputs or not out or len(inputs[0]) != len(out) or len(out) < 3:
        return 0
    return max(-(-i // max(o, 1)) for i, o in zip(inputs[0][2:], out[2:]))


def feature_vector(row: Mapping[str, Any]) -> np.ndarray:
    """The row's features, laid out as `FEATURE_NAMES` (float64, length ``len(FEATURE_NAMES)``)."""
    family = row_family(row)
    inputs = _input_shapes(row)
    out = _output_shape(row)

    def get(key: str, default: float = 0.0) -> float:
        value = _number(row, key)
        return default if value is None else value

    logged = {
        "params": get("params"),
        "param_bytes": get("param_bytes"),
        "flops": get("flops"),
        "bytes_in": get("bytes_in"),
        "bytes_out": get("bytes_out"),
        "max_input_numel": max((_numel(s) for s in inputs), default=0),
        "output_numel": _numel(out) if out is not None else 0,
    }
    first = inputs[0] if inputs and inputs[0] else (out or ())
    raw = {
        "n_inputs": get("n_inputs", len(inputs)),
        "output_rank": len(out) if out is not None else 0,
        "batch_size": get("batch_size", first[0] if first else 0),
        "kernel_size": get("kernel_size", _default_kernel(family, inputs, out)),
        "channels": get("channels", _default_channels(family, out)),
    }
    onehot = [1.0 if f == family else 0.0 for f in FAMILIES]
    logs = [math.log1p(max(logged[k], 0.0)) for k in _LOG_FIELDS]
    return np.array([*onehot, *logs, *(float(raw[k]) for k in _RAW_FIELDS)], dtype=np.float64)


def feature_matrix(rows: Iterable[Mapping[str, Any]]) -> np.ndarray:
    """`feature_vector` of every row, stacked: shape ``(n_rows, len(FEATURE_NAMES))``."""
    vectors = [feature_vector(r) for r in rows]
    return np.stack(vectors) if vectors else np.zeros((0, len(FEATURE_NAMES)))


# --- the time predictor's extra features --------------------------------------------------------

TIME_FEATURE_NAMES: tuple[str, ...] = (
    *FEATURE_NAMES,
    "log1p_bytes_moved",
    "log_intensity",
    "log_roofline_ms",
)
"""The time predictor's columns: `FEATURE_NAMES`, then three derived from them and a `Roofline`."""


@dataclass(frozen=True, kw_only=True)
class Roofline:
    """A roofline of the measuring machine, fitted to the operator samples (`fit_roofline`).

    time_ms = overhead_ms + max(flops / flops_per_ms, bytes moved / bytes_per_ms), where bytes
    moved = bytes in + bytes out + parameter bytes (every run reads its weights).

    Attributes:
        flops_per_ms: peak compute, FLOP per ms.
        bytes_per_ms: memory bandwidth, bytes per ms.
        overhead_ms: fixed cost of one run (session dispatch, thread wake-up), ms.
    """

    flops_per_ms: float
    bytes_per_ms: float
    overhead_ms: float

    def time_ms(self, flops: np.ndarray, bytes_moved: np.ndarray) -> np.ndarray:
        """The roofline's time for each (flops, bytes moved) pair, ms (> 0 when overhead > 0)."""
        work = np.maximum(
            np.asarray(flops, float) / self.flops_per_ms,
            np.asarray(bytes_moved, float) / self.bytes_per_ms,
        )
        return self.overhead_ms + work


_MIN_MS = 1e-6  # a floor under the roofline's time, so that its log is finite (ms)
_COLUMN = {name: i for i, name in enumerate(FEATURE_NAMES)}


def _unlog(x: np.ndarray, name: str) -> np.ndarray:
    return np.expm1(x[:, _COLUMN[f"log1p_{name}"]])


def param_mb(x: np.ndarray) -> np.ndarray:
    """The parameter MB of each row of ``x`` (`FEATURE_NAMES`): exact, not predicted."""
    x = np.asarray(x, dtype=np.float64).reshape(-1, len(FEATURE_NAMES))
    return _unlog(x, "param_bytes") / float(1 << 20)


def roofline_inputs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FLOPs and bytes moved (in + out + parameters) of each row of ``x`` (`FEATURE_NAMES`)."""
    x = np.asarray(x, dtype=np.float64).reshape(-1, len(FEATURE_NAMES))
    moved = _unlog(x, "bytes_in") + _unlog(x, "bytes_out") + _unlog(x, "param_bytes")
    return _unlog(x, "flops"), moved


def time_features(x: np.ndarray, roofline: Roofline) -> np.ndarray:
    """``x`` (columns `FEATURE_NAMES`) with the time predictor's columns appended.

    Bytes moved, arithmetic intensity (FLOPs per byte moved) and the roofline's time, on log
    scales: trees split on them, and the time predictor learns log(time / roofline), a ratio
    that carries across op families better than a time does. All three follow from columns of
    ``x``, so a feature row needs nothing new.

    Returns:
        shape ``(len(x), len(TIME_FEATURE_NAMES))``.
    """
    x = np.asarray(x, dtype=np.float64).reshape(-1, len(FEATURE_NAMES))
    flops, moved = roofline_inputs(x)
    extra = np.column_stack(
        [
            np.log1p(moved),
            np.log1p(flops) - np.log1p(moved),
            np.log(np.maximum(roofline.time_ms(flops, moved), _MIN_MS)),
        ]
    )
    return np.hstack([x, extra])


# --- fx nodes and layers to rows -----------------------------------------------------------------


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "element_size")


def _tensors(value: Any) -> list[Any]:
    if _is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if _is_tensor(v)]
    return []


def _params(nodes: Iterable[fx.Node], gm: fx.GraphModule) -> dict[str, Any]:
    """Distinct parameters and buffers that ``nodes`` read: target -> tensor."""
    found: dict[str, Any] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and str(arg.target) not in found:
                value = operator.attrgetter(str(arg.target))(gm)
                if _is_tensor(value):
                    found[str(arg.target)] = value
    return found


CAST_READS = 5
"""Bytes a run moves per byte of a 16-bit weight cast where it is used: the cast reads its 2
bytes and writes 4, which the operator then reads (float32 weights: 4 bytes, once). Measured,
the casts of 256 MB of bfloat16 MatMul weights over one row took 70% of the time (3.4x float32),
and a bfloat16 Llama of 117M parameters over 16 tokens ran 2.5-4x as long as in float32
(docs/exportable.md); the time predictor sees this many bytes of such a weight."""


def cast_bytes(nodes: Iterable[fx.Node], gm: fx.GraphModule) -> int:
    """Bytes of the float16 and bfloat16 weights that ``nodes`` compute with, which each run
    casts to float32 (`mopar.frontend.dtypes`); an embedding's table, whose looked-up rows
    alone are cast, does not count."""
    found: dict[str, Any] = {}
    for node in nodes:
        if str(node.target) == "aten.embedding.default":
            continue
        for arg in node.all_input_nodes:
            value = operator.attrgetter(str(arg.target))(gm) if arg.op == "get_attr" else None
            if _is_tensor(value) and str(value.dtype) in ("torch.float16", "torch.bfloat16"):
                found[str(arg.target)] = value
    return sum(int(v.numel()) * 2 for v in found.values())


def _activation_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if a.op != "get_attr" and _is_tensor(a.meta.get("val"))]


def _groups(node: fx.Node, op: str) -> int:
    position = {"conv1d": 6, "conv2d": 6, "conv3d": 6, "convolution": 8, "_convolution": 8}.get(op)
    if position is None:
        return 1
    groups = node.kwargs.get("groups", node.args[position] if len(node.args) > position else 1)
    return int(groups) if isinstance(groups, int) else 1


def _kernel_size(node: fx.Node, op: str) -> int:
    from mopar.ir import sizes

    family = op_family(op)
    if family == "conv" and len(node.args) > 1 and _is_tensor(_val(node.args[1])):
        return max(sizes.shape(_val(node.args[1]))[2:], default=0)
    if family == "pool" and not op.startswith("adaptive") and len(node.args) > 1:
        kernel = node.args[1]
        if isinstance(kernel, (list, tuple)):
            return int(max(kernel, default=0))
        return int(kernel or 0)
    return 0


def _val(arg: Any) -> Any:
    return arg.meta.get("val") if hasattr(arg, "meta") else arg


def _sizes(params: dict[str, Any], flops: int, inputs: list[Any], outputs: list[Any]) -> dict:
    """A row's sizes: of ``params`` (target -> tensor), ``flops``, the bytes of ``inputs`` and
    ``outputs``, the shapes of ``inputs`` and of the largest output."""
    from mopar.ir import sizes  # a data-dependent size counts at its upper bound

    out = max(outputs, key=sizes.numel, default=None)
    return {
        "params": sum(int(p.numel()) for p in params.values()),
        "param_bytes": sum(sizes.nbytes(p) for p in params.values()),
        "flops": flops,
        "bytes_in": sum(sizes.nbytes(t) for t in inputs),
        "bytes_out": sum(sizes.nbytes(t) for t in outputs),
        "input_shapes": [list(sizes.shape(t)) for t in inputs],
        "output_shape": list(sizes.shape(out)) if out is not None else None,
    }


def node_features(node: fx.Node, gm: fx.GraphModule) -> dict[str, Any]:
    """The row of one ATen node of ``gm`` (a ``call_function``), with ``family`` resolved."""
    from mopar.ir.flops import node_flops, op_name

    op = op_name(node)
    inputs = [_val(a) for a in _activation_inputs(node)]
    outputs = _tensors(node.meta.get("val"))
    row: dict[str, Any] = {
        "op_type": op,
        **_sizes(_params([node], gm), node_flops(node), inputs, outputs),
        "groups": _groups(node, op),
    }
    kernel = _kernel_size(node, op)
    if kernel:
        row["kernel_size"] = kernel
    row["family"] = row_family(row)
    return row


def _layer_nodes(layer: Layer, lg: LayerGraph) -> list[fx.Node]:
    inside = set(layer.nodes)
    return [n for n in lg.gm.graph.nodes if n.name in inside]


def _attention_nodes(nodes: list[fx.Node], family: dict[str, str]) -> set[str]:
    """Nodes of softmax(batched matmul) @ batched matmul patterns, found through cheap glue ops.

    Decomposed attention (nn.MultiheadAttention, eager Hugging Face attention) shows up as bmm or
    matmul, then scaling, masking and a softmax, then another bmm: as a layer that is attention.
    """
    glue = {"elementwise"}
    inside = {n.name for n in nodes}

    def walk(start: fx.Node, step) -> list[fx.Node] | None:
        path, frontier = [], [start]
        for _ in range(8):  # a few hops of glue at most
            nxt = [m for n in frontier for m in step(n) if m.name in inside]
            hit = [m for m in nxt if family[m.name] == "batched_matmul"]
            if hit:
                return path + hit
            frontier = [m for m in nxt if family[m.name] in glue or _op(m) in ALIAS_OPS]
            path += frontier
            if not frontier:
                return None
        return None

    found: set[str] = set()
    for s in (n for n in nodes if family[n.name] == "softmax"):
        before = walk(s, lambda n: n.all_input_nodes)
        after = walk(s, lambda n: list(n.users))
        if before and after:
            found.update(n.name for n in (s, *before, *after))
    return found


def _op(node: fx.Node) -> str:
    from mopar.ir.flops import op_name

    return op_name(node) if node.op == "call_function" else node.op


def _dominant(nodes: list[fx.Node], rows: dict[str, dict[str, Any]]) -> tuple[str, fx.Node | None]:
    """The family holding most of the layer's FLOPs and parameters, and its heaviest node.

    A node scores its share of the layer's FLOPs plus its share of the layer's parameters; a
    family scores the sum over its nodes. Without FLOPs or parameters, output bytes decide.
    """
    family = {n.name: rows[n.name]["family"] for n in nodes}
    for name in _attention_nodes(nodes, family):
        family[name] = "attention"
    flops = {n.name: rows[n.name]["flops"] for n in nodes}
    params = {n.name: rows[n.name]["params"] for n in nodes}
    if not any(flops.values()) and not any(params.values()):
        flops = {n.name: 0 if _op(n) in ALIAS_OPS else rows[n.name]["bytes_out"] for n in nodes}
    total_f, total_p = sum(flops.values()) or 1, sum(params.values()) or 1
    score = {n.name: flops[n.name] / total_f + params[n.name] / total_p for n in nodes}
    by_family: dict[str, float] = {}
    for n in nodes:
        by_family[family[n.name]] = by_family.get(family[n.name], 0.0) + score[n.name]
    if not by_family or max(by_family.values()) <= 0:
        return "other", None
    best = max(by_family, key=by_family.__getitem__)  # first of equals, in graph order
    node = max((n for n in nodes if family[n.name] == best), key=lambda n: score[n.name])
    return best, node


def layer_features(layer: Layer, lg: LayerGraph) -> dict[str, Any]:
    """The row of a LayerGraph layer: layer totals, plus the kernel and groups of its dominant op.

    ``bytes_in`` and ``input_shapes`` cover the distinct activation tensors the layer reads from
    outside itself; ``bytes_out`` the distinct tensors it hands on (each once, however many
    readers; `Layer.output_bytes` counts a tensor once per reading layer); ``output_shape`` is the
    largest of those. ``family`` is the dominant op family (see `_dominant`), ``op_type`` the ATen
    name of its heaviest node. Extra keys ``layer`` and ``module_type`` name the layer.
    """
    nodes = _layer_nodes(layer, lg)
    inside = set(layer.nodes)
    rows = {n.name: node_features(n, lg.gm) for n in nodes}
    external: dict[str, Any] = {}
    for n in nodes:
        for a in _activation_inputs(n):
            if a.name not in inside:
                external.setdefault(a.name, a.meta["val"])
    leaving = [
        n.meta["val"]
        for n in nodes
        if _is_tensor(n.meta.get("val")) and any(u.name not in inside for u in n.users)
    ]
    if not leaving:  # nothing read later: the layer's last tensor stands for its output
        leaving = [t for n in nodes for t in _tensors(n.meta.get("val"))][-1:]
    family, top = _dominant(nodes, rows)
    row: dict[str, Any] = {
        "layer": layer.name,
        "module_type": layer.module_type,
        "op_type": rows[top.name]["op_type"] if top is not None else "",
        "family": family,
        **_sizes(_params(nodes, lg.gm), layer.flops, list(external.values()), leaving),
        "groups": rows[top.name]["groups"] if top is not None else 1,
        "cast_bytes": cast_bytes(nodes, lg.gm),
    }
    if top is not None and "kernel_size" in rows[top.name]:
        row["kernel_size"] = rows[top.name]["kernel_size"]
    return row
