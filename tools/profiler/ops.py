"""The operators the profiler's collection measures beyond those the package times
(`mopar.profile.ops`, whose builders the probe of `mopar.profile.machine` needs): LSTM, GRU,
batch norm, pool and softmax. `BUILDERS` names every operator the sweep may sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from mopar.profile import ops
from mopar.profile.ops import Init, Node, OpSample, TensorSpec, op_sample

__all__ = ["BUILDERS", "make_sample"]


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
    **ops.BUILDERS,
    "lstm": _rnn("LSTM", 4),
    "gru": _rnn("GRU", 3),
    "batch_norm": _batch_norm,
    "pool": _pool,
    "softmax": _softmax,
}


def make_sample(op_type: str, variant: str, config: dict[str, int]) -> OpSample:
    """The sample of one op and variant with this config."""
    return BUILDERS[op_type](variant, config)
