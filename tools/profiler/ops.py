"""Single-operator ONNX models for the profiler's collection and the speed probe
(`tools.profiler.speed`).

Read in this order: `OpSample` (what one sample is), `op_sample`, the builders (`_conv` ..
`_softmax`, each turning a config of integers into an `OpSample`; `BUILDERS` names them), then
`build_model` / `make_inputs` (the ONNX model and a feed for one sample). Which samples to take
is `tools.profiler.sweep`'s business.

Models are built directly with ``onnx.helper`` (no torch). A sample holds no weights: only their
shapes; `build_model` fills them with values seeded by the sample's id, so a sample is cheap to
list and its model is the same on every run.

FLOPs follow `mopar.ir.flops`, so that a measured operator and a layer of a LayerGraph are counted
alike: a multiply-add is 2, an op without a formula counts one per output element, an embedding
lookup counts 0. ``params`` counts the learned tensors (and batch-norm running statistics), not
constants such as an attention scale.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "OPSET",
    "TensorSpec",
    "Init",
    "Node",
    "OpSample",
    "op_sample",
    "BUILDERS",
    "make_sample",
    "build_model",
    "make_inputs",
    "feature_row",
]

OPSET = 18
_SAMPLE_FORMAT = 1  # part of every sample id: bump when a builder changes what it measures


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """A graph input or output: name, shape, numpy dtype; integer inputs draw from [0, high)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    high: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True, kw_only=True)
class Init:
    """An initializer: ``fill`` is ``normal`` or ``positive`` (weights) or ``const`` (``value``)."""

    name: str
    shape: tuple[int, ...]
    fill: str = "normal"
    value: tuple[float, ...] = ()
    dtype: str = "float32"


@dataclass(frozen=True, kw_only=True)
class Node:
    """An ONNX node: op type, input and output names, attributes as (name, value) pairs."""

    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, kw_only=True)
class OpSample:
    """One operator to measure.

    Attributes:
        op_type: the sweep's op name (a `mopar.profile.features` family name, e.g. ``conv``).
        variant: which form of it (``regular``, ``depthwise``, ``grouped``, ``2d``, ``max``...).
        family: its feature family (a depthwise conv is ``depthwise_conv``).
        config: the sweep parameters, as sorted (name, value) pairs.
        inputs: activation inputs (weights are initializers, not inputs).
        outputs: graph outputs.
        params: learned elements (weights, biases, norm statistics).
        param_bytes: bytes of those.
        flops: forward FLOPs, counted as `mopar.ir.flops` counts them.
        bytes_in: bytes of the activation inputs.
        bytes_out: bytes of the outputs.
        groups: convolution groups (1 otherwise).
        kernel_size: largest kernel extent of a conv or pool (0 otherwise).
        nodes: the graph's nodes.
        initializers: the graph's initializers (shapes only).
    """

    op_type: str
    variant: str
    family: str
    config: tuple[tuple[str, int], ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    params: int
    param_bytes: int
    flops: int
    bytes_in: int
    bytes_out: int
    groups: int = 1
    kernel_size: int = 0
    nodes: tuple[Node, ...] = field(default=(), repr=False)
    initializers: tuple[Init, ...] = field(default=(), repr=False)

    @property
    def sample_id(self) -> str:
        """A stable 16-hex-digit id from the op, variant and config."""
        key = json.dumps(
            {
                "v": _SAMPLE_FORMAT,
                "op": self.op_type,
                "variant": self.variant,
                "config": dict(self.config),
            },
            sort_keys=True,
        )
        return hashlib.sha1(key.encode()).hexdigest()[:16]


def op_sample(
    op_type: str,
    variant: str,
    config: dict[str, int],
    *,
    family: str | None = None,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    nodes: Sequence[Node],
    inits: Sequence[Init] = (),
    flops: int,
    groups: int = 1,
    kernel_size: int = 0,
) -> OpSample:
    learned = [i for i in inits if i.fill != "const"]
    params = sum(math.prod(i.shape) for i in learned)
    return OpSample(
        op_type=op_type,
        variant=variant,
        family=family or op_type,
        config=tuple(sorted(config.items())),
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        params=params,
        param_bytes=4 * params,
        flops=int(flops),
        bytes_in=sum(t.nbytes for t in inputs),
        bytes_out=sum(t.nbytes for t in outputs),
        groups=groups,
        kernel_size=kernel_size,
        nodes=tuple(nodes),
        initializers=tuple(inits),
    )


# --- builders: config -> OpSample ----------------------------------------------------------------


def _conv(variant: str, c: dict[str, int]) -> OpSample:
    n, cin, cout, h = c["batch"], c["cin"], c["cout"], c["size"]
    k, s, g = c["kernel"], c["stride"], c["groups"]
    pad = k // 2
    ho = (h + 2 * pad - k) // s + 1
    x, y = TensorSpec(name="x", shape=(n, cin, h, h)), TensorSpec(name="y", shape=(n, cout, ho, ho))
    node = Node(
        op="Conv",
        inputs=("x", "w", "b"),
        outputs=("y",),
        attrs=(("kernel_shape", [k, k]), ("pads", [pad] * 4), ("strides", [s, s]), ("group", g)),
    )
    inits = [Init(name="w", shape=(cout, cin // g, k, k)), Init(name="b", shape=(cout,))]
    family = "depthwise_conv" if variant == "depthwise" else "conv"
    return op_sample(
        "conv",
        variant,
        c,
        family=family,
        inputs=[x],
        outputs=[y],
        nodes=[node],
        inits=inits,
        groups=g,
        kernel_size=k,
        flops=2 * math.prod(y.shape) * (cin // g) * k * k,
    )


def _gemm(variant: str, c: dict[str, int]) -> OpSample:
    i, o = c["in_features"], c["out_features"]
    if variant == "2d":  # torch's linear on a matrix exports as Gemm
        x = TensorSpec(name="x", shape=(c["batch"], i))
        y = TensorSpec(name="y", shape=(c["batch"], o))
        nodes = [Node(op="Gemm", inputs=("x", "w", "b"), outputs=("y",), attrs=(("transB", 1),))]
        inits = [Init(name="w", shape=(o, i)), Init(name="b", shape=(o,))]
    else:  # ... and on a sequence as MatMul + Add
        x = TensorSpec(name="x", shape=(c["batch"], c["seq"], i))
        y = TensorSpec(name="y", shape=(c["batch"], c["seq"], o))
        nodes = [
            Node(op="MatMul", inputs=("x", "w"), outputs=("xw",)),
            Node(op="Add", inputs=("xw", "b"), outputs=("y",)),
        ]
        inits = [Init(name="w", shape=(i, o)), Init(name="b", shape=(o,))]
    return op_sample(
        "gemm",
        variant,
        c,
        inputs=[x],
        outputs=[y],
        nodes=nodes,
        inits=inits,
        flops=2 * math.prod(y.shape) * i,
    )


def _batched_matmul(variant: str, c: dict[str, int]) -> OpSample:
    b, m, k, n = c["batch"], c["m"], c["k"], c["n"]
    a, bb = TensorSpec(name="a", shape=(b, m, k)), TensorSpec(name="b", shape=(b, k, n))
    y = TensorSpec(name="y", shape=(b, m, n))
    return op_sample(
        "batched_matmul",
        variant,
        c,
        inputs=[a, bb],
        outputs=[y],
        nodes=[Node(op="MatMul", inputs=("a", "b"), outputs=("y",))],
        flops=2 * math.prod(y.shape) * k,
    )


def _attention(variant: str, c: dict[str, int]) -> OpSample:
    shape = (c["batch"], c["heads"], c["seq"], c["head_dim"])
    q, k, v = (TensorSpec(name=n, shape=shape) for n in ("q", "k", "v"))
    y = TensorSpec(name="y", shape=shape)
    nodes = [
        Node(op="Transpose", inputs=("k",), outputs=("kt",), attrs=(("perm", [0, 1, 3, 2]),)),
        Node(op="MatMul", inputs=("q", "kt"), outputs=("s",)),
        Node(op="Mul", inputs=("s", "scale"), outputs=("ss",)),
        Node(op="Softmax", inputs=("ss",), outputs=("p",), attrs=(("axis", -1),)),
        Node(op="MatMul", inputs=("p", "v"), outputs=("y",)),
    ]
    scores = math.prod(shape[:3]) * c["seq"]
    return op_sample(
        "attention",
        variant,
        c,
        inputs=[q, k, v],
        outputs=[y],
        nodes=nodes,
        inits=[Init(name="scale", shape=(), fill="const", value=(c["head_dim"] ** -0.5,))],
        flops=2 * 2 * scores * c["head_dim"] + 2 * scores,
    )


def _layer_norm(variant: str, c: dict[str, int]) -> OpSample:
    x = TensorSpec(name="x", shape=(c["batch"], c["seq"], c["channels"]))
    y = TensorSpec(name="y", shape=x.shape)
    node = Node(
        op="LayerNormalization",
        inputs=("x", "scale", "bias"),
        outputs=("y",),
        attrs=(("axis", -1), ("epsilon", 1e-5)),
    )
    inits = [Init(name="scale", shape=(c["channels"],)), Init(name="bias", shape=(c["channels"],))]
    return op_sample(
        "layer_norm",
        variant,
        c,
        inputs=[x],
        outputs=[y],
        nodes=[node],
        inits=inits,
        flops=math.prod(y.shape),
    )


def _embedding(variant: str, c: dict[str, int]) -> OpSample:
    ids = TensorSpec(name="ids", shape=(c["batch"], c["seq"]), dtype="int64", high=c["vocab"])
    y = TensorSpec(name="y", shape=(c["batch"], c["seq"], c["dim"]))
    node = Node(op="Gather", inputs=("table", "ids"), outputs=("y",), attrs=(("axis", 0),))
    return op_sample(
        "embedding",
        variant,
        c,
        inputs=[ids],
        outputs=[y],
        nodes=[node],
        inits=[Init(name="table", shape=(c["vocab"], c["dim"]))],
        flops=0,
    )


def _elementwise(variant: str, c: dict[str, int]) -> OpSample:
    if c["rank"] == 4:
        shape = (c["batch"], c["channels"], c["size"], c["size"])
    else:
        shape = (c["batch"], c["seq"], c["channels"])
    x, y = TensorSpec(name="x", shape=shape), TensorSpec(name="y", shape=shape)
    inputs, inits = [x], []
    if variant in ("add", "mul"):
        inputs.append(TensorSpec(name="x2", shape=shape))
        nodes = [Node(op=variant.capitalize(), inputs=("x", "x2"), outputs=("y",))]
    elif variant == "gelu":  # the exact (Erf) GELU, as torch exports nn.GELU()
        inits = [
            Init(name=n, shape=(), fill="const", value=(v,))
            for n, v in (("sqrt2", math.sqrt(2.0)), ("one", 1.0), ("half", 0.5))
        ]
        nodes = [
            Node(op="Div", inputs=("x", "sqrt2"), outputs=("d",)),
            Node(op="Erf", inputs=("d",), outputs=("e",)),
            Node(op="Add", inputs=("e", "one"), outputs=("a",)),
            Node(op="Mul", inputs=("x", "a"), outputs=("m",)),
            Node(op="Mul", inputs=("m", "half"), outputs=("y",)),
        ]
    else:
        nodes = [Node(op=variant.capitalize(), inputs=("x",), outputs=("y",))]
    return op_sample(
        "elementwise",
        variant,
        c,
        inputs=inputs,
        outputs=[y],
        nodes=nodes,
        inits=inits,
        flops=math.prod(shape),
    )


def _rnn(kind: str, gates: int) -> Callable[[str, dict[str, int]], OpSample]:
    def build(variant: str, c: dict[str, int]) -> OpSample:
        t, n, i, h, d = c["seq"], c["batch"], c["input"], c["hidden"], c["directions"]
        x = TensorSpec(name="x", shape=(t, n, i))
        y = TensorSpec(name="y", shape=(t, d, n, h))
        attrs: list[tuple[str, Any]] = [
            ("hidden_size", h),
            ("direction", "bidirectional" if d == 2 else "forward"),
        ]
        if kind == "GRU":
            attrs.append(("linear_before_reset", 1))  # PyTorch's GRU
        inits = [
            Init(name="w", shape=(d, gates * h, i)),
            Init(name="r", shape=(d, gates * h, h)),
            Init(name="bias", shape=(d, 2 * gates * h)),
        ]
        node = Node(op=kind, inputs=("x", "w", "r", "bias"), outputs=("y",), attrs=tuple(attrs))
        return op_sample(
            kind.lower(),
            variant,
            c,
            inputs=[x],
            outputs=[y],
            nodes=[node],
            inits=inits,
            flops=2 * t * n * d * gates * h * (i + h),
        )

    return build


def _batch_norm(variant: str, c: dict[str, int]) -> OpSample:
    ch = c["channels"]
    x = TensorSpec(name="x", shape=(c["batch"], ch, c["size"], c["size"]))
    y = TensorSpec(name="y", shape=x.shape)
    node = Node(
        op="BatchNormalization",
        inputs=("x", "scale", "bias", "mean", "var"),
        outputs=("y",),
        attrs=(("epsilon", 1e-5),),
    )
    inits = [
        Init(name="scale", shape=(ch,)),
        Init(name="bias", shape=(ch,)),
        Init(name="mean", shape=(ch,)),
        Init(name="var", shape=(ch,), fill="positive"),
    ]
    return op_sample(
        "batch_norm",
        variant,
        c,
        inputs=[x],
        outputs=[y],
        nodes=[node],
        inits=inits,
        flops=math.prod(y.shape),
    )


def _pool(variant: str, c: dict[str, int]) -> OpSample:
    n, ch, h = c["batch"], c["channels"], c["size"]
    x = TensorSpec(name="x", shape=(n, ch, h, h))
    if variant == "global":
        y = TensorSpec(name="y", shape=(n, ch, 1, 1))
        node, kernel = Node(op="GlobalAveragePool", inputs=("x",), outputs=("y",)), h
    else:
        k, s = c["kernel"], c["stride"]
        pad = k // 2 if k % 2 else 0
        ho = (h + 2 * pad - k) // s + 1
        y = TensorSpec(name="y", shape=(n, ch, ho, ho))
        op = "MaxPool" if variant == "max" else "AveragePool"
        node = Node(
            op=op,
            inputs=("x",),
            outputs=("y",),
            attrs=(("kernel_shape", [k, k]), ("pads", [pad] * 4), ("strides", [s, s])),
        )
        kernel = k
    return op_sample(
        "pool",
        variant,
        c,
        inputs=[x],
        outputs=[y],
        nodes=[node],
        flops=math.prod(y.shape),
        kernel_size=kernel,
    )


def _softmax(variant: str, c: dict[str, int]) -> OpSample:
    x = TensorSpec(name="x", shape=(c["batch"], c["rows"], c["cols"]))
    y = TensorSpec(name="y", shape=x.shape)
    return op_sample(
        "softmax",
        variant,
        c,
        inputs=[x],
        outputs=[y],
        nodes=[Node(op="Softmax", inputs=("x",), outputs=("y",), attrs=(("axis", -1),))],
        flops=math.prod(y.shape),
    )


BUILDERS: dict[str, Callable[[str, dict[str, int]], OpSample]] = {
    "conv": _conv,
    "gemm": _gemm,
    "batched_matmul": _batched_matmul,
    "attention": _attention,
    "layer_norm": _layer_norm,
    "embedding": _embedding,
    "elementwise": _elementwise,
    "lstm": _rnn("LSTM", 4),
    "gru": _rnn("GRU", 3),
    "batch_norm": _batch_norm,
    "pool": _pool,
    "softmax": _softmax,
}


def make_sample(op_type: str, variant: str, config: dict[str, int]) -> OpSample:
    """The sample of one op and variant with this config."""
    return BUILDERS[op_type](variant, config)


# --- materialising a sample ----------------------------------------------------------------------


def _rng(sample: OpSample) -> np.random.Generator:
    return np.random.default_rng(int(sample.sample_id, 16))


def _initializer(init: Init, rng: np.random.Generator):
    from onnx import numpy_helper

    if init.fill == "const":
        array = np.array(init.value, dtype=init.dtype).reshape(init.shape)
    else:
        array = rng.standard_normal(init.shape, dtype=np.float32) * np.float32(0.05)
        if init.fill == "positive":
            array = np.abs(array) + np.float32(0.5)
    return numpy_helper.from_array(array, init.name)


def build_model(sample: OpSample):
    """The sample as a checked ``onnx.ModelProto``, weights seeded by the sample's id.

    Raises:
        onnx.checker.ValidationError: the model is not valid ONNX, or its declared output shapes
            disagree with ONNX shape inference (a builder bug).
    """
    import onnx
    from onnx import helper

    def info(t: TensorSpec):
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype))
        return helper.make_tensor_value_info(t.name, elem, list(t.shape))

    rng = _rng(sample)
    graph = helper.make_graph(
        [
            helper.make_node(n.op, list(n.inputs), list(n.outputs), **dict(n.attrs))
            for n in sample.nodes
        ],
        f"{sample.op_type}_{sample.variant}",
        [info(t) for t in sample.inputs],
        [info(t) for t in sample.outputs],
        initializer=[_initializer(i, rng) for i in sample.initializers],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="mopar.profile"
    )
    model.ir_version = 9  # what onnxruntime >= 1.16 reads
    onnx.checker.check_model(model, full_check=True)
    return model


def feature_row(sample: OpSample) -> dict[str, Any]:
    """The sample's columns that `mopar.profile.features.feature_vector` reads."""
    return {
        "op_type": sample.op_type,
        "variant": sample.variant,
        "family": sample.family,
        "params": sample.params,
        "param_bytes": sample.param_bytes,
        "flops": sample.flops,
        "bytes_in": sample.bytes_in,
        "bytes_out": sample.bytes_out,
        "input_shapes": json.dumps([list(t.shape) for t in sample.inputs]),
        "output_shape": json.dumps(list(max(sample.outputs, key=lambda t: t.nbytes).shape)),
        "n_inputs": len(sample.inputs),
        "groups": sample.groups,
        "kernel_size": sample.kernel_size or "",
    }


def make_inputs(sample: OpSample) -> dict[str, np.ndarray]:
    """A feed for the sample: standard-normal floats, integers uniform in [0, high)."""
    rng = np.random.default_rng(int(sample.sample_id, 16) + 1)
    feed = {}
    for t in sample.inputs:
        if np.issubdtype(np.dtype(t.dtype), np.integer):
            feed[t.name] = rng.integers(0, max(t.high, 1), size=t.shape, dtype=t.dtype)
        else:
            array = rng.standard_normal(t.shape, dtype=np.float32)
            feed[t.name] = array.astype(t.dtype, copy=False)
    return feed
