"""The dispatch spec: what a mixture-of-experts layer's dispatch function knows of its layer.

It travels in ``plan.json`` (``io.functions[].dispatch``) and in the dispatch function's
``function.json``; `mopar.runtime.dispatch` routes tokens by it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["DispatchSpec", "MODES"]

MODES = ("direct", "store")
"""How tokens reach the expert functions: in the invocation's payload, or through the store."""


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
        groups: the experts each called function holds, in call order; an expert in several
            (a replicated one) has its tokens shared out among them.
        callees: the called functions' names, in the same order.
        hot: the experts the dispatch function holds and runs itself.
        local: the name its hot experts run under (their tensors are ``expert_tensors(local)``).
        mode: how the called functions are sent their tokens, one of `MODES`.
        warm: the next MoE layer's expert functions and their experts, which this dispatch
            predicts from its hidden states (its ``WARM_DIR`` model: the next layer's router)
            and pre-warms when they are cold; empty when it predicts nothing.
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
    hot: tuple[int, ...] = ()
    local: str = ""
    mode: str = "direct"
    warm: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def __post_init__(self) -> None:
        if self.hot and not self.local:
            raise ValueError("a dispatch holding hot experts needs the name they run under")
        if self.mode not in MODES:
            raise ValueError(f"dispatch mode {self.mode!r} is not one of {list(MODES)}")
        held = {e for g in (*self.groups, self.hot) for e in g}
        if held != set(range(self.num_experts)):
            missing = sorted(set(range(self.num_experts)) - held)
            raise ValueError(
                f"dispatch places experts {sorted(held)} of {self.num_experts}; "
                f"{missing} are held nowhere"
            )

    def to_dict(self) -> dict:
        """Its fields, for JSON (which writes the tuples as lists)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DispatchSpec:
        return cls(
            hidden=d["hidden"],
            index=d["index"],
            weights=d["weights"],
            output=d["output"],
            output_shape=tuple(int(x) for x in d["output_shape"]),
            tokens=int(d["tokens"]),
            hidden_size=int(d["hidden_size"]),
            top_k=int(d["top_k"]),
            num_experts=int(d["num_experts"]),
            groups=tuple(tuple(int(e) for e in g) for g in d["groups"]),
            callees=tuple(d["callees"]),
            hot=tuple(int(e) for e in d.get("hot", ())),
            local=str(d.get("local", "")),
            mode=str(d.get("mode", "direct")),
            warm=tuple((str(f), tuple(int(e) for e in g)) for f, g in d.get("warm", ())),
        )
