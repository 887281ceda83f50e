"""How much a lossy transform may change the model's final outputs, and how much it did.

Read in this order: `Budget` (the user's bound: ``--max-output-error``, ``--max-top1-change``,
``--min-cosine``), then `Effect` and `effect_of` (what a transform did to the final outputs of
the held-out calibration samples). Codecs at the cuts (`mopar.compress.choose`) and quantised
weights (`mopar.compress.quantize`) are both judged this way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

__all__ = ["Budget", "Effect", "effect_of"]


@dataclass(frozen=True, kw_only=True)
class Effect:
    """What a transform did to the final outputs of the held-out samples.

    Attributes:
        error: max relative error, as verification defines it (max |diff| / max |reference|).
        top1_change: share of rows of the last axis whose largest entry moved, over every
            floating-point output of rank 2 or more (the top-1 class of a classifier's logits,
            the next token of a language model's at each position); None where no output is one.
        cosine: the lowest cosine similarity of a row of the last axis (an embedding, a token's
            hidden state) with its reference, over every floating-point output; None where none is.
    """

    error: float
    top1_change: float | None = None
    cosine: float | None = None

    def to_dict(self) -> dict[str, float | None]:
        return {"error": self.error, "top1_change": self.top1_change, "cosine": self.cosine}


@dataclass(frozen=True, kw_only=True)
class Budget:
    """How much the final outputs may change. Without a bound only exact transforms are used.

    Attributes:
        max_output_error: max relative error of the final outputs (``--max-output-error``).
        max_top1_change: max share of samples whose top-1 class changes, 0..1
            (``--max-top1-change`` gives percent).
        min_cosine: the lowest cosine similarity an output row may keep with the model's
            (``--min-cosine``; for embeddings).
    """

    max_output_error: float | None = None
    max_top1_change: float | None = None
    min_cosine: float | None = None

    @property
    def lossy(self) -> bool:
        return any(
            b is not None for b in (self.max_output_error, self.max_top1_change, self.min_cosine)
        )

    def allows(
        self, error: float, top1_change: float | None = None, cosine: float | None = None
    ) -> bool:
        """Whether an effect of this ``error``, ``top1_change`` and ``cosine`` is within the
        budget; a bound on a measure the outputs do not have (no logits, say) does not bind."""
        if not self.lossy:
            return error == 0.0
        if self.max_output_error is not None and error > self.max_output_error:
            return False
        if self.max_top1_change is not None and (top1_change or 0.0) > self.max_top1_change:
            return False
        return not (self.min_cosine is not None and cosine is not None and cosine < self.min_cosine)

    def admits(self, effect: Effect) -> bool:
        return self.allows(effect.error, effect.top1_change, effect.cosine)


def effect_of(
    references: Iterable[Mapping[str, np.ndarray]], got: Iterable[Mapping[str, np.ndarray]]
) -> Effect:
    """The `Effect` of ``got`` against ``references``: one mapping of output name to array per
    held-out sample, in the same order, with the same names."""
    err, flips, rows, cosine = 0.0, 0, 0, None
    for ref_outputs, outputs in zip(references, got, strict=True):
        for name, reference in ref_outputs.items():
            ref = np.asarray(reference, dtype=np.float64)
            out = np.asarray(outputs[name], dtype=np.float64)
            scale = float(np.abs(ref).max()) if ref.size else 0.0
            err = max(err, float(np.abs(out - ref).max()) / (scale or 1.0) if ref.size else 0.0)
            if not np.issubdtype(np.asarray(reference).dtype, np.floating) or ref.ndim == 0:
                continue
            a, b = out.reshape(-1, ref.shape[-1]), ref.reshape(-1, ref.shape[-1])
            if ref.ndim >= 2 and ref.shape[-1] > 1:
                flips += int((a.argmax(1) != b.argmax(1)).sum())
                rows += b.shape[0]
            norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
            sims = np.where(norms > 0, (a * b).sum(axis=1) / np.maximum(norms, 1e-300), 1.0)
            if sims.size:
                low = float(sims.min())
                cosine = low if cosine is None else min(cosine, low)
    return Effect(error=err, top1_change=(flips / rows if rows else None), cosine=cosine)
