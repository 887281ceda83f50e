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

Three placements refine that (`mopar.planner.experts` chooses them):

- hot experts (``hot``): the most loaded experts stay in the dispatch function itself and run
  there, on their tokens, while the called functions work: no hop for them;
- replicas: an expert held by several called functions has its tokens shared out among them,
  in turn, starting from a rotating offset so that a replica is not favoured across requests;
- the communication mode (``mode``): ``direct`` sends the tokens in the invocation itself,
  ``store`` through the store (Redis), for payloads over the platform's limit.

The result equals the layer's dense translation (every expert on every token, weighted by 0
where not chosen) up to the order of a floating-point sum.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mopar.bundle.dispatch import DispatchSpec

if TYPE_CHECKING:
    from mopar.runtime.handler import SliceHandler

__all__ = [
    "expert_tensors",
    "DispatchError",
    "Call",
    "route",
    "combine",
    "run_local",
    "to_warm",
    "Warmer",
    "WARM_KEEP_S",
]

WARM_KEEP_S = 300.0
"""How long a pre-warmed function is taken to stay warm, s (platforms keep an idle instance for
minutes: Lambda's are reused for 5 to 15, OpenFaaS scales to zero after its idle timeout)."""


def expert_tensors(function: str) -> tuple[str, str, str]:
    """The names of what expert function ``function`` receives (its tokens and their gates)
    and what it answers."""
    return f"{function}:tokens", f"{function}:gates", f"{function}:out"


class DispatchError(ValueError):
    """A dispatch request that cannot be served as sent (the caller's fault)."""


@dataclass(frozen=True, kw_only=True)
class Call:
    """One expert function to call (or, ``local``, the dispatch's own hot experts): which, the
    rows of its tokens, and what it is sent."""

    function: str
    rows: np.ndarray
    tokens: np.ndarray
    gates: np.ndarray
    local: bool = False


def route(
    spec: DispatchSpec, hidden: np.ndarray, index: np.ndarray, weights: np.ndarray, offset: int = 0
) -> list[Call]:
    """The calls of one request: one per expert function that received a token, in call order,
    then the hot experts' (``local``) when any of them did.

    Args:
        offset: where the turn starts when a replicated expert's tokens are shared out among
            its replicas (a counter of requests balances them over time).

    Raises:
        DispatchError: an index names no expert of the layer, or the tensors disagree on the
            number of tokens.
    """
    h, k = spec.hidden_size, spec.top_k
    # as many tokens as the indices hold: a step of a generation brings any number
    t = index.size // k if index.size % k == 0 else spec.tokens
    if hidden.size != t * h or index.size != t * k or weights.size != t * k:
        raise DispatchError(
            f"dispatch expects {t} tokens: hidden states of {t}x{h}, indices and "
            f"weights of {t}x{k}; got {hidden.size}, {index.size} and "
            f"{weights.size} values"
        )
    if not np.issubdtype(index.dtype, np.integer):
        raise DispatchError(f"expert indices must be integers, got {index.dtype}")
    idx = index.reshape(t, k)
    bad = idx[(idx < 0) | (idx >= spec.num_experts)]
    if bad.size:
        raise DispatchError(
            f"expert index {int(bad[0])} is not one of the layer's "
            f"{spec.num_experts} experts (0..{spec.num_experts - 1})"
        )
    x, w = hidden.reshape(t, h), weights.reshape(t, k)
    owner = _owners(spec, idx, offset)  # (T, k): which group serves each choice
    groups = (*spec.groups, spec.hot) if spec.hot else spec.groups
    names = (*spec.callees, spec.local) if spec.hot else spec.callees
    calls = []
    for g, (function, experts) in enumerate(zip(names, groups)):
        mine = owner == g
        chosen = mine[:, :, None] & (idx[:, :, None] == np.asarray(experts)[None, None, :])
        rows = np.flatnonzero(mine.any(axis=1))
        if rows.size:
            gates = (w[rows, :, None] * chosen[rows]).sum(axis=1).astype(w.dtype, copy=False)
            calls.append(
                Call(
                    function=function,
                    rows=rows,
                    tokens=np.ascontiguousarray(x[rows]),
                    gates=np.ascontiguousarray(gates),
                    local=g >= len(spec.groups),
                )
            )
    return calls


def _owners(spec: DispatchSpec, idx: np.ndarray, offset: int) -> np.ndarray:
    """For each (token, choice), the index of the group that serves it: its expert's only
    holder, or, for a replicated expert, its holders in turn from ``offset``."""
    holders: dict[int, list[int]] = {}
    for g, experts in enumerate((*spec.groups, spec.hot) if spec.hot else spec.groups):
        for e in experts:
            holders.setdefault(e, []).append(g)
    owner = np.empty(idx.shape, dtype=np.int64)
    for e, gs in holders.items():
        at = idx == e
        if len(gs) == 1:
            owner[at] = gs[0]
        else:
            owner[at] = np.asarray(gs)[(np.arange(int(at.sum())) + offset) % len(gs)]
    return owner


def combine(
    spec: DispatchSpec,
    calls: Sequence[Call],
    answers: Sequence[np.ndarray],
    dtype: np.dtype,
    tokens: int | None = None,
) -> np.ndarray:
    """The layer's output for ``tokens`` tokens (None: the spec's): each answer added into its
    tokens' rows, zero where none came.

    Raises:
        DispatchError: an answer's shape is not its call's ``(n, H)``.
    """
    if len(answers) != len(calls):
        raise DispatchError(
            f"{len(calls)} expert functions were called but {len(answers)} answered"
        )
    t = spec.tokens if tokens is None else tokens
    out = np.zeros((t, spec.hidden_size), dtype=dtype)
    for call, answer in zip(calls, answers):
        if answer.shape != (call.rows.size, spec.hidden_size):
            raise DispatchError(
                f"expert function {call.function} answered "
                f"{list(answer.shape)}, expected {[call.rows.size, spec.hidden_size]}"
            )
        out[call.rows] += answer
    if t == spec.tokens:
        return out.reshape(spec.output_shape)
    return out.reshape((*spec.output_shape[:-2], -1, spec.hidden_size))


def run_local(handler: SliceHandler, call: Call) -> np.ndarray:
    """The hot experts' answer to ``call``, computed in the dispatch function by ``handler``
    (a `mopar.runtime.handler.SliceHandler` of ``HOT_DIR``)."""
    tokens, gates, out = expert_tensors(call.function)
    return handler.handle({tokens: call.tokens, gates: call.gates})[out]


def to_warm(spec: DispatchSpec, predicted: np.ndarray) -> list[str]:
    """The next layer's expert functions holding any of the ``predicted`` experts (the indices
    the next router picks on this layer's hidden states), in call order."""
    chosen = set(np.asarray(predicted).reshape(-1).tolist())
    return [f for f, experts in spec.warm if chosen & set(experts)]


class Warmer:
    """Which of the predicted functions a deployed dispatch sends a warm-up.

    A dispatch cannot see whether a function of the next layer is warm: the next dispatch
    calls it, on another instance. It takes a function it predicted (and so warmed, or saw
    called) within ``keep_s`` to be warm still, and every other one to be cold.
    """

    def __init__(
        self, keep_s: float = WARM_KEEP_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.keep_s, self.clock = keep_s, clock
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def cold(self, names: Sequence[str]) -> list[str]:
        """The ones of ``names`` not predicted within ``keep_s``; all are now taken as warm."""
        now = self.clock()
        with self._lock:
            out = [n for n in names if now - self._last.get(n, -math.inf) > self.keep_s]
            self._last.update((n, now) for n in names)
        return out
