"""A mixture-of-experts layer's dispatch: group tokens, call experts, scatter-add. torch-free.

A dispatch function sits on the request path after the slice that ends at a router. It receives
the hidden states ``(T, H)``, the top-k expert indices ``(T, k)`` and their weights ``(T, k)``
(`DispatchSpec` names them), and the experts live in the functions it calls: each holds one
expert or a group of them (``groups``). For every called function that received at least one
token, `route` gathers those tokens' hidden states (``tokens``, ``(n, H)``) and, per expert of
the group, each token's weight for it (``gates``, ``(n, G)``, 0 where the token did not choose
it). The expert function answers ``out`` ``(n, H)``: the weighted sum of its experts on those
tokens. `combine` adds each answer into the rows its tokens came from. Functions no token
reached are never called: that is what makes an expert billed only when used.

The result equals the layer's dense translation (every expert on every token, weighted by 0
where not chosen) up to the order of a floating-point sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["expert_tensors", "DispatchError", "DispatchSpec", "Call", "route", "combine"]


def expert_tensors(function: str) -> tuple[str, str, str]:
    """The names of what expert function ``function`` receives (its tokens and their gates)
    and what it answers."""
    return f"{function}:tokens", f"{function}:gates", f"{function}:out"


class DispatchError(ValueError):
    """A dispatch request that cannot be served as sent (the caller's fault)."""


@dataclass(frozen=True, kw_only=True)
class DispatchSpec:
    """What a dispatch function knows of its layer.

    Attributes:
        hidden, index, weights: the names of the tensors it reads: the hidden states, the
            top-k expert indices and the top-k weights.
        output: the name of the experts' weighted sum, which the dispatch function's tail model
            reads (with its other inputs) to make what it hands on.
        output_shape: its shape.
        tokens: T, tokens per request.
        hidden_size: H.
        top_k: k.
        num_experts: E.
        groups: the experts each called function holds, in call order.
        callees: the called functions' names, in the same order.
    """

    hidden: str
    index: str
    weights: str
    output: str
    output_shape: tuple[int, ...]
    tokens: int
    hidden_size: int
    top_k: int
    num_experts: int
    groups: tuple[tuple[int, ...], ...]
    callees: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"hidden": self.hidden, "index": self.index, "weights": self.weights,
                "output": self.output, "output_shape": list(self.output_shape),
                "tokens": self.tokens, "hidden_size": self.hidden_size, "top_k": self.top_k,
                "num_experts": self.num_experts, "groups": [list(g) for g in self.groups],
                "callees": list(self.callees)}

    @classmethod
    def from_dict(cls, d: dict) -> DispatchSpec:
        return cls(hidden=d["hidden"], index=d["index"], weights=d["weights"], output=d["output"],
                   output_shape=tuple(int(x) for x in d["output_shape"]), tokens=int(d["tokens"]),
                   hidden_size=int(d["hidden_size"]), top_k=int(d["top_k"]),
                   num_experts=int(d["num_experts"]),
                   groups=tuple(tuple(int(e) for e in g) for g in d["groups"]),
                   callees=tuple(d["callees"]))


@dataclass(frozen=True, kw_only=True)
class Call:
    """One expert function to call: which, the rows of its tokens, and what it is sent."""

    function: str
    rows: np.ndarray
    tokens: np.ndarray
    gates: np.ndarray


def route(spec: DispatchSpec, hidden: np.ndarray, index: np.ndarray,
          weights: np.ndarray) -> list[Call]:
    """The calls of one request: one per expert function that received a token, in call order.

    Raises:
        DispatchError: an index names no expert of the layer, or the tensors disagree on the
            number of tokens.
    """
    t, h, k = spec.tokens, spec.hidden_size, spec.top_k
    if hidden.size != t * h or index.size != t * k or weights.size != t * k:
        raise DispatchError(f"dispatch expects {t} tokens: hidden states of {t}x{h}, indices and "
                            f"weights of {t}x{k}; got {hidden.size}, {index.size} and "
                            f"{weights.size} values")
    if not np.issubdtype(index.dtype, np.integer):
        raise DispatchError(f"expert indices must be integers, got {index.dtype}")
    idx = index.reshape(t, k)
    bad = idx[(idx < 0) | (idx >= spec.num_experts)]
    if bad.size:
        raise DispatchError(f"expert index {int(bad[0])} is not one of the layer's "
                            f"{spec.num_experts} experts (0..{spec.num_experts - 1})")
    x, w = hidden.reshape(t, h), weights.reshape(t, k)
    calls = []
    for function, experts in zip(spec.callees, spec.groups):
        chosen = idx[:, :, None] == np.asarray(experts)[None, None, :]  # (T, k, G)
        rows = np.flatnonzero(chosen.any(axis=(1, 2)))
        if rows.size:
            gates = (w[rows, :, None] * chosen[rows]).sum(axis=1).astype(w.dtype, copy=False)
            calls.append(Call(function=function, rows=rows, tokens=np.ascontiguousarray(x[rows]),
                              gates=np.ascontiguousarray(gates)))
    return calls


def combine(spec: DispatchSpec, calls: Sequence[Call], answers: Sequence[np.ndarray],
            dtype: np.dtype) -> np.ndarray:
    """The layer's output: each answer added into its tokens' rows, zero where none came.

    Raises:
        DispatchError: an answer's shape is not its call's ``(n, H)``.
    """
    if len(answers) != len(calls):
        raise DispatchError(f"{len(calls)} expert functions were called but {len(answers)} "
                            "answered")
    out = np.zeros((spec.tokens, spec.hidden_size), dtype=dtype)
    for call, answer in zip(calls, answers):
        if answer.shape != (call.rows.size, spec.hidden_size):
            raise DispatchError(f"expert function {call.function} answered "
                                f"{list(answer.shape)}, expected {[call.rows.size, spec.hidden_size]}")
        out[call.rows] += answer
    return out.reshape(spec.output_shape)
