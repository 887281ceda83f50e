"""The ``generation`` section: how a bundle's main function generates text, token by token.

A bundle compiled with ``--generate`` serves one *step* of a decoder: the token ids of this step
(the prompt at prefill, one token after) and the key-value cache of the steps before, in; the
next token's logits and the cache grown by this step's tokens, out. The main function holds the
cache between steps and runs the decoding loop for a whole request
(`mopar.runtime.generate`). This section names, in the main function's own model, which input
takes the token ids, which output gives the logits, and which output feeds which cache input at
the next step. It is written into plan.json and into the main function's ``function.json``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mopar.errors import BundleError

__all__ = ["GenerationSpec", "GenerationTiming", "CachePair", "NEW_TOKENS"]


NEW_TOKENS = 32
"""The tokens a generation is billed at where none are given (`mopar plan`, `mopar compile`,
and `mopar simulate --new-tokens`'s default)."""


@dataclass(frozen=True, kw_only=True)
class CachePair:
    """One cache tensor: the step's input ``past`` (empty at prefill: its sequence axis is 0)
    and the step's output ``present`` that becomes it at the next step."""

    past: str
    present: str
    axis: int


@dataclass(frozen=True, kw_only=True)
class GenerationTiming:
    """One generation compile measured with the bundle's main function, in process: greedy,
    ``new_tokens`` after a prompt of ``prompt_tokens``; the first token's time (the prompt's
    step) and the later tokens' p50 and p95, ms. Where the main function runs several units,
    also its peak RSS serving the same generation in a process of its own, as deployed (its
    units, the runtime once, and the cache), and that peak with compile's margin: the need its
    deployed size covers (None: one unit, sized by its own measured peak)."""

    prompt_tokens: int
    new_tokens: int
    first_token_ms: float
    token_p50_ms: float
    token_p95_ms: float
    main_peak_rss_mb: float | None = None
    main_need_mb: float | None = None

    def request_ms(self, new_tokens: int, prompt_tokens: int | None = None) -> float:
        """A generation of ``new_tokens`` at these times: the first token, then the p50 each;
        after a prompt of ``prompt_tokens`` (None: the timed one's), the first token's time
        scaled by the prompt's length (the prompt's step is linear in its tokens while
        attention's share is small)."""
        scale = prompt_tokens / self.prompt_tokens if prompt_tokens else 1.0
        return self.first_token_ms * scale + (new_tokens - 1) * self.token_p50_ms

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "first_token_ms": round(self.first_token_ms, 3),
            "token_p50_ms": round(self.token_p50_ms, 3),
            "token_p95_ms": round(self.token_p95_ms, 3),
            **(
                {
                    "main_peak_rss_mb": round(self.main_peak_rss_mb, 1),
                    "main_need_mb": round(self.main_need_mb, 1),
                }
                if self.main_peak_rss_mb is not None and self.main_need_mb is not None
                else {}
            ),
        }


@dataclass(frozen=True, kw_only=True)
class GenerationSpec:
    """What the decoding loop needs of a step model.

    Attributes:
        function: the main function's name (the one that holds the cache): the first of
            ``path``.
        path: the units the main function runs, in order, each a function folder of the
            bundle (its slices and, for a mixture of experts, its dispatches: the attention
            layers, the routers and the rest of each MoE layer).
        callees: the expert functions it calls, stateless, per step (none: a dense model).
        input_ids: the step's token-id input (int64 ``[1, tokens]``).
        logits: the step's output of the last position's logits (``[1, vocab]``).
        cache: the key-value cache, in the step's order.
        max_seq_len: prompt and generated tokens together, at most.
        vocab_size: the logits' width.
        eos_token_ids: the tokens that end a generation (none: it runs to max_new_tokens).
        timing: what compile measured of a generation (plan.json only; None in function.json,
            and before it is measured).
    """

    function: str
    path: tuple[str, ...] = ()
    callees: tuple[str, ...] = ()
    input_ids: str
    logits: str
    cache: tuple[CachePair, ...]
    max_seq_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    timing: GenerationTiming | None = None

    @property
    def units(self) -> tuple[str, ...]:
        """The units the main function runs (its path; itself alone where none is given)."""
        return self.path or (self.function,)

    def main_need_mb(self, unit_needs: Sequence[float]) -> float:
        """The memory the main function needs where it runs several units, MB: its peak
        serving a generation in a process of its own, with compile's margin, where compile
        measured it (`GenerationTiming.main_need_mb`); else its units' needs (``unit_needs``)
        summed, each counting the runtime again: an overestimate."""
        if self.timing is not None and self.timing.main_need_mb is not None:
            return self.timing.main_need_mb
        return float(sum(unit_needs))

    def to_dict(self) -> dict:
        timing = {"timing": self.timing.to_dict()} if self.timing is not None else {}
        return {
            "function": self.function,
            "path": list(self.path),
            "callees": list(self.callees),
            "input_ids": self.input_ids,
            "logits": self.logits,
            "cache": [{"past": c.past, "present": c.present, "axis": c.axis} for c in self.cache],
            "max_seq_len": self.max_seq_len,
            "vocab_size": self.vocab_size,
            "eos_token_ids": list(self.eos_token_ids),
            **timing,
        }

    @classmethod
    def from_dict(cls, data: object, *, where: str) -> GenerationSpec:
        """Raises:
        BundleError: a field is missing or of the wrong type, naming ``where`` (the file)."""
        try:
            assert isinstance(data, dict)
            spec = cls(
                function=str(data["function"]),
                path=tuple(str(n) for n in data.get("path", ())),
                callees=tuple(str(n) for n in data.get("callees", ())),
                input_ids=str(data["input_ids"]),
                logits=str(data["logits"]),
                cache=tuple(
                    CachePair(past=str(c["past"]), present=str(c["present"]), axis=int(c["axis"]))
                    for c in data["cache"]
                ),
                max_seq_len=int(data["max_seq_len"]),
                vocab_size=int(data["vocab_size"]),
                eos_token_ids=tuple(int(t) for t in data.get("eos_token_ids", ())),
                timing=GenerationTiming(**data["timing"]) if data.get("timing") else None,
            )
        except (AssertionError, KeyError, TypeError, ValueError) as exc:
            raise BundleError(
                f"{where}: the generation section is malformed ({type(exc).__name__}: {exc}); "
                "recompile the bundle with --generate"
            ) from None
        if spec.path and spec.path[0] != spec.function:
            raise BundleError(
                f"{where}: the generation section's path starts at {spec.path[0]!r}, not at its "
                f"main function {spec.function!r}; recompile the bundle with --generate"
            )
        if spec.max_seq_len < 2 or spec.vocab_size < 1 or not spec.cache:
            raise BundleError(
                f"{where}: the generation section has max_seq_len {spec.max_seq_len}, "
                f"vocab_size {spec.vocab_size} and {len(spec.cache)} cache tensors, expected "
                "at least 2, 1 and 1; recompile the bundle with --generate"
            )
        return spec
