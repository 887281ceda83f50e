"""How much a lossy transform may change the model's final outputs, and how much it did.

Read in this order: `Budget` (the user's bound: ``--max-output-error``, ``--max-top1-change``,
``--min-cosine``), then `Effect` and `effect_of` (what a transform did to the final outputs of
the held-out calibration samples). Codecs at the cuts (`mopar.compress.choose`) and quantised
weights (`mopar.compress.quantize`) are both judged this way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CONFIDENCE",
    "MIN_TRAIN",
    "Budget",
    "Effect",
    "attention_mask",
    "effect_of",
    "held_out_count",
    "interval",
    "resolving_count",
]

CONFIDENCE = 0.95
"""The confidence of a measured share's interval (`interval`), and of the held-out count that
resolves a top-1 budget (`held_out_count`)."""


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
            Where the sample has an attention mask, only the rows it keeps count, for this and
            for ``top1_change``: padding is read by no one.
        pooled_cosine: the lowest cosine of the mean of the rows the mask keeps (the sentence
            embedding, as sentence-transformers pools an encoder's hidden states) with its
            reference's, over every output of hidden states; None without a mask.
        rows: how many rows ``top1_change`` is a share of.
    """

    error: float
    top1_change: float | None = None
    cosine: float | None = None
    pooled_cosine: float | None = None
    rows: int = 0

    @property
    def judged_cosine(self) -> float | None:
        """The cosine ``--min-cosine`` bounds: the pooled embedding's where there is one (what
        an embedding model's users read), else the rows'."""
        return self.pooled_cosine if self.pooled_cosine is not None else self.cosine

    def top1_interval(self) -> tuple[float, float] | None:
        """The `CONFIDENCE` interval of the top-1 change, from its rows (None: no logits)."""
        if self.top1_change is None or not self.rows:
            return None
        return interval(round(self.top1_change * self.rows), self.rows)

    def to_dict(self) -> dict[str, float | int | list[float] | None]:
        low_high = self.top1_interval()
        return {
            "error": self.error,
            "top1_change": self.top1_change,
            "top1_interval": None if low_high is None else [round(x, 4) for x in low_high],
            "rows": self.rows,
            "cosine": self.cosine,
            "pooled_cosine": self.pooled_cosine,
        }


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
        return self.allows(effect.error, effect.top1_change, effect.judged_cosine)


def interval(k: int, n: int) -> tuple[float, float]:
    """The Wilson score interval of a share of ``k`` in ``n``, at `CONFIDENCE`."""
    z = 1.959963984540054  # the normal quantile of (1 + CONFIDENCE) / 2
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


MIN_TRAIN = 32
"""Samples kept to calibrate activation ranges (at most half of them), whatever the budget."""


def held_out_count(samples: int, budget: Budget) -> int:
    """How many of ``samples`` are held out to judge a lossy transform: a quarter, or, under a
    top-1 budget, as many as resolve it: with none of them changed, the change is under the
    budget at `CONFIDENCE` (the rule of three: 299 samples for 1%), while `MIN_TRAIN` stay to
    calibrate."""
    share = max(1, round(samples * 0.25)) if samples > 1 else 0
    p = budget.max_top1_change
    if not p or samples < 2:
        return share
    return max(share, min(resolving_count(p), samples - min(MIN_TRAIN, samples // 2)))


def resolving_count(top1_change: float) -> int:
    """The held-out samples that resolve a top-1 budget of ``top1_change`` (0..1): with none
    of them changed, the change is under it at `CONFIDENCE`."""
    return math.ceil(math.log(1 - CONFIDENCE) / math.log(1 - min(top1_change, 0.5)))


def attention_mask(sample: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """The attention mask among a sample's inputs: an integer or boolean input named as one
    (``attention_mask``), of rank 2 (batch, positions); None where there is none."""
    for name, value in sample.items():
        array = np.asarray(value)
        if "attention_mask" in name and array.ndim == 2 and array.dtype.kind in "biu":
            return array
    return None


def effect_of(
    references: Iterable[Mapping[str, np.ndarray]],
    got: Iterable[Mapping[str, np.ndarray]],
    masks: Sequence[np.ndarray | None] | None = None,
) -> Effect:
    """The `Effect` of ``got`` against ``references``: one mapping of output name to array per
    held-out sample, in the same order, with the same names; ``masks``: each sample's attention
    mask (`attention_mask`), or None."""
    err, flips, rows = 0.0, 0, 0
    cosine: float | None = None
    pooled: float | None = None
    for i, (ref_outputs, outputs) in enumerate(zip(references, got, strict=True)):
        mask = masks[i] if masks is not None else None
        for name, reference in ref_outputs.items():
            ref = np.asarray(reference, dtype=np.float64)
            out = np.asarray(outputs[name], dtype=np.float64)
            scale = float(np.abs(ref).max()) if ref.size else 0.0
            err = max(err, float(np.abs(out - ref).max()) / (scale or 1.0) if ref.size else 0.0)
            if not np.issubdtype(np.asarray(reference).dtype, np.floating) or ref.ndim == 0:
                continue
            a, b = out.reshape(-1, ref.shape[-1]), ref.reshape(-1, ref.shape[-1])
            masked = mask is not None and ref.ndim == 3 and ref.shape[:2] == mask.shape
            if masked:
                keep = np.asarray(mask).reshape(-1) != 0
                weights = np.asarray(mask, dtype=np.float64)[..., None]
                pa = (out * weights).sum(1) / np.maximum(weights.sum(1), 1.0)
                pb = (ref * weights).sum(1) / np.maximum(weights.sum(1), 1.0)
                low = _lowest_cosine(pa, pb)
                pooled = low if pooled is None or low is None else min(pooled, low)
                a, b = a[keep], b[keep]
            if ref.ndim >= 2 and ref.shape[-1] > 1:
                flips += int((a.argmax(1) != b.argmax(1)).sum()) if len(a) else 0
                rows += b.shape[0]
            low = _lowest_cosine(a, b)
            if low is not None:
                cosine = low if cosine is None else min(cosine, low)
    return Effect(
        error=err,
        top1_change=(flips / rows if rows else None),
        cosine=cosine,
        pooled_cosine=pooled,
        rows=rows,
    )


def _lowest_cosine(a: np.ndarray, b: np.ndarray) -> float | None:
    """The lowest cosine similarity of a row of ``a`` with the same row of ``b``."""
    if not a.size:
        return None
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    sims = np.where(norms > 0, (a * b).sum(axis=1) / np.maximum(norms, 1e-300), 1.0)
    return float(sims.min())
