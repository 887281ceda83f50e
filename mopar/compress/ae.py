"""The split-point autoencoder: a one-layer encoder at the tail of slice i, a one-layer decoder
at the head of slice i+1 (the paper's COM), trained on the activations that cross the cut.

Read in this order: `make_autoencoder` (the shapes: a conv pair for 4-D activations, a linear
pair for 2-D and 3-D ones), then `train_autoencoder` (reconstruction first, then the decoder
fine-tuned so that the model's final output is preserved, not just the activation), both
deterministic for a seed and bounded by a time budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["AutoEncoder", "make_autoencoder", "train_autoencoder", "TrainReport", "supports"]


class AutoEncoder(nn.Module):
    """An encoder and a decoder for one cut tensor; ``ratio`` = input elements / code elements."""

    def __init__(self, encoder: nn.Module, decoder: nn.Module, ratio: float):
        super().__init__()
        self.encoder, self.decoder, self.ratio = encoder, decoder, ratio

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


class _LastDim(nn.Module):
    """A Linear over the last dimension of any-rank input."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def supports(shape: tuple[int, ...], dtype: torch.dtype, ratio: int) -> bool:
    """Whether a tensor of ``shape`` can get an autoencoder of ``ratio``: floating point, rank 2
    to 4, and a channel (4-D: dim 1) or feature (last dim) count of at least ``ratio``."""
    if not dtype.is_floating_point or not 2 <= len(shape) <= 4:
        return False
    width = shape[1] if len(shape) == 4 else shape[-1]
    return width >= ratio


def make_autoencoder(shape: tuple[int, ...], ratio: int, *, seed: int) -> AutoEncoder:
    """A fresh autoencoder for activations of ``shape`` that shrinks them ``ratio`` times.

    4-D ``(N, C, H, W)``: 3x3 convolutions C -> C/ratio -> C (padding 1, so H and W are kept).
    2-D and 3-D: linear layers over the last dimension, D -> D/ratio -> D.
    """
    torch.manual_seed(seed)
    if len(shape) == 4:
        c = shape[1]
        code = max(1, c // ratio)
        enc = nn.Conv2d(c, code, 3, padding=1)
        dec = nn.Conv2d(code, c, 3, padding=1)
        return AutoEncoder(enc, dec, c / code)
    d = shape[-1]
    code = max(1, d // ratio)
    return AutoEncoder(_LastDim(d, code), _LastDim(code, d), d / code)


@dataclass(frozen=True, kw_only=True)
class TrainReport:
    """What training did: steps, the relative reconstruction error before and after, and whether
    the time budget cut it short (then it is not reproducible step for step)."""

    steps: int
    finetune_steps: int
    error_before: float
    error_after: float
    seconds: float
    budget_hit: bool


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def train_autoencoder(
    ae: AutoEncoder,
    activations: torch.Tensor,
    *,
    samples: int,
    downstream: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    budget_s: float = 20.0,
    seed: int = 0,
    lr: float = 1e-2,
    max_steps: int = 1500,
    finetune_steps: int = 100,
) -> TrainReport:
    """Fit ``ae`` to ``activations`` (samples stacked on dim 0), then fine-tune its decoder.

    Args:
        activations: the cut tensor of every calibration sample, stacked on dim 0.
        samples: how many samples ``activations`` holds (each has ``len // samples`` rows).
        downstream: ``f(decoded, k)`` -> the model's final output for sample k when its cut
            tensor is replaced by ``decoded`` (one sample's rows); the decoder is then tuned so
            that f(decoded) matches f(original). None skips the fine-tune.
        budget_s: wall-clock cap for both phases (2/3 reconstruction, 1/3 fine-tune).
        max_steps, finetune_steps: the steps of each phase. Training is deterministic for a seed
            when it finishes them within the budget; `TrainReport.budget_hit` says when it did not.
    """
    torch.manual_seed(seed)
    x = activations.detach().float()
    scale = x.abs().mean().clamp_min(1e-12)
    with torch.no_grad():
        before = _rel_err(ae(x), x)
    start = time.perf_counter()
    opt = torch.optim.Adam(ae.parameters(), lr=lr)
    steps = 0
    generator = torch.Generator().manual_seed(seed)
    batch = max(1, min(len(x), 16))
    budget_hit = False
    while steps < max_steps:
        if time.perf_counter() - start > budget_s * (2 / 3 if downstream else 1.0):
            budget_hit = True
            break
        idx = torch.randint(0, len(x), (batch,), generator=generator)
        loss = ((ae(x[idx]) - x[idx]) / scale).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    tune = 0
    if downstream is not None:
        per = len(x) // samples
        with torch.no_grad():
            targets = [downstream(x[k * per : (k + 1) * per], k) for k in range(samples)]
        opt = torch.optim.Adam(ae.decoder.parameters(), lr=lr / 3)
        with torch.no_grad():
            code = ae.encoder(x)
        while tune < finetune_steps:
            if time.perf_counter() - start > budget_s:
                budget_hit = True
                break
            k = int(torch.randint(0, len(targets), (1,), generator=generator))
            out = downstream(ae.decoder(code[k * per : (k + 1) * per]), k)
            want = targets[k]
            loss = ((out - want) / want.abs().mean().clamp_min(1e-12)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            tune += 1
    with torch.no_grad():
        after = _rel_err(ae(x), x)
    return TrainReport(
        steps=steps,
        finetune_steps=tune,
        error_before=before,
        error_after=after,
        seconds=time.perf_counter() - start,
        budget_hit=budget_hit,
    )
