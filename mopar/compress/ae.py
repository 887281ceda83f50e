"""The split-point autoencoder: an encoder at the tail of slice i, a decoder at the head of
slice i+1 (the paper's COM), trained so that the model's final outputs stay what they were.

Read in this order: `make_autoencoder` (the shapes: each half is a linear map plus a nonlinear
residual branch; convolutions over channels for 4-D activations, linear layers over the last
dimension for 2-D and 3-D ones; the linear maps start as the activations' principal components),
then `train_autoencoder` (distillation against the model's final outputs plus a small
reconstruction term, with the code passed through the runtime codec that will carry it), both
deterministic for a seed and bounded by a time budget.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mopar.errors import InternalError

__all__ = [
    "AutoEncoder",
    "make_autoencoder",
    "train_autoencoder",
    "output_loss",
    "TrainReport",
    "supports",
]

log = logging.getLogger(__name__)

PCA_ROWS = 200_000
"""At most this many activation vectors (pixels or tokens) estimate the principal components."""


class AutoEncoder(nn.Module):
    """An encoder and a decoder for one cut tensor; ``ratio`` = input elements / code elements."""

    def __init__(self, encoder: nn.Module, decoder: nn.Module, ratio: float):
        super().__init__()
        self.encoder, self.decoder, self.ratio = encoder, decoder, ratio

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


class _Half(nn.Module):
    """``(linear(u) + branch(u)) * scale_out`` of ``u = x * scale_in``: one half of an
    autoencoder. The branch (a small network with a GELU) ends in a layer that starts at zero,
    so a fresh half is its linear map, and training adds the nonlinearity only where it helps.
    The two fixed scales put the weights in units of the activations' spread, so that Adam's
    steps (about ``lr`` per weight, whatever the gradient's size) mean the same on any tensor."""

    def __init__(self, linear: nn.Module, branch: nn.Sequential):
        super().__init__()
        self.linear, self.branch = linear, branch
        self.scale_in, self.scale_out = 1.0, 1.0
        nn.init.zeros_(branch[-1].weight)
        nn.init.zeros_(branch[-1].bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x * self.scale_in
        return (self.linear(u) + self.branch(u)) * self.scale_out


def supports(shape: tuple[int, ...], dtype: torch.dtype, ratio: int) -> bool:
    """Whether a tensor of ``shape`` can get an autoencoder of ``ratio``: floating point, rank 2
    to 4, and a channel (4-D: dim 1) or feature (last dim) count of at least ``ratio``."""
    if not dtype.is_floating_point or not 2 <= len(shape) <= 4:
        return False
    width = shape[1] if len(shape) == 4 else shape[-1]
    return width >= ratio


def make_autoencoder(
    shape: tuple[int, ...], ratio: int, *, seed: int, activations: torch.Tensor | None = None
) -> AutoEncoder:
    """A fresh autoencoder for activations of ``shape`` that shrinks them ``ratio`` times.

    4-D ``(N, C, H, W)``, code ``K = C/ratio`` channels: the encoder is a 1x1 convolution C -> K
    plus the branch 1x1 C -> K, GELU, depthwise 3x3, 1x1 K -> K; the decoder a 1x1 convolution
    K -> C plus the branch depthwise 3x3, 1x1 K -> K, GELU, 1x1 K -> C (depthwise, so that the
    spatial context costs 9 multiply-adds per code element). H and W are kept. 2-D and 3-D, over the last dimension
    D (code K = D/ratio): Linear D -> K plus Linear D -> D, GELU, Linear D -> K; mirrored back.

    Args:
        activations: samples of the tensor (stacked on dim 0). With them, the linear maps start
            as the projection onto their K principal components and back (the best linear
            autoencoder), so training starts from there; without them, at random.
    """
    torch.manual_seed(seed)
    conv = len(shape) == 4
    width = shape[1] if conv else shape[-1]
    k = max(1, width // ratio)
    if conv:
        enc = _Half(
            nn.Conv2d(width, k, 1),
            nn.Sequential(
                nn.Conv2d(width, k, 1),
                nn.GELU(),
                nn.Conv2d(k, k, 3, padding=1, groups=k),
                nn.Conv2d(k, k, 1),
            ),
        )
        dec = _Half(
            nn.Conv2d(k, width, 1),
            nn.Sequential(
                nn.Conv2d(k, k, 3, padding=1, groups=k),
                nn.Conv2d(k, k, 1),
                nn.GELU(),
                nn.Conv2d(k, width, 1),
            ),
        )
    else:
        enc = _Half(
            nn.Linear(width, k),
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, k)),
        )
        dec = _Half(
            nn.Linear(k, width),
            nn.Sequential(nn.Linear(k, width), nn.GELU(), nn.Linear(width, width)),
        )
    if activations is not None:
        _principal(enc, dec, activations, k, conv=conv)
    return AutoEncoder(enc, dec, width / k)


@torch.no_grad()
def _principal(enc: _Half, dec: _Half, x: torch.Tensor, k: int, *, conv: bool) -> None:
    """Start ``enc`` as the projection onto the top ``k`` principal components of ``x``'s channel
    (4-D) or last-dimension vectors, centred and whitened (each code channel of unit variance),
    and ``dec`` as the map back; both in units of ``x``'s spread (an element's centred RMS)."""
    width = x.shape[1] if conv else x.shape[-1]
    rows = (x.movedim(1, -1) if conv else x).reshape(-1, width).double()
    rows = rows[:: max(1, len(rows) // PCA_ROWS)]
    mean = rows.mean(0)
    cov = (rows - mean).T @ (rows - mean) / max(1, len(rows) - 1)
    values, vectors = torch.linalg.eigh(cov)  # ascending eigenvalues
    spread = float(values.clamp_min(0).mean().sqrt()) or 1.0  # RMS of one centred element
    basis = vectors[:, -k:].flip(1)  # (width, k), largest variance first
    sd = values[-k:].flip(0).clamp_min(float(values[-1]) * 1e-6 + 1e-30).sqrt()  # (k,)
    enc.scale_in, dec.scale_out = 1.0 / spread, spread
    shape_down = (k, width, 1, 1) if conv else (k, width)
    shape_up = (width, k, 1, 1) if conv else (width, k)
    enc.linear.weight.copy_((basis.T * spread / sd[:, None]).reshape(shape_down).float())
    enc.linear.bias.copy_((-(basis.T @ mean) / sd).float())
    dec.linear.weight.copy_((basis * sd / spread).reshape(shape_up).float())
    dec.linear.bias.copy_((mean / spread).float())


@dataclass(frozen=True, kw_only=True)
class TrainReport:
    """What training did.

    Attributes:
        steps: optimizer steps taken (each over ``batch`` samples).
        error_before, error_after: relative reconstruction error ``|x - ae(x)| / |x|`` over the
            training activations, the code carried by the runtime codec, before and after.
        output_loss_before, output_loss_after: the training loss (distillation and
            reconstruction) on up to 16 training samples, before and after (None without a
            downstream).
        seconds: wall-clock seconds.
        budget_hit: whether the time budget held fewer than ``max_steps`` (then the schedule
            was planned from the first step's time, and training is not reproducible).
        restored: whether training made the outputs worse on the probe samples, so the
            autoencoder was set back to where it started.
    """

    steps: int
    error_before: float
    error_after: float
    output_loss_before: float | None
    output_loss_after: float | None
    seconds: float
    budget_hit: bool
    restored: bool = False


def output_loss(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> torch.Tensor:
    """How far the model's final outputs ``got`` are from the reference ``want``.

    Logits (2-D, more than one column): the KL divergence of the predicted class distribution
    from the reference one (distillation to the reference's softmax). Other outputs: the mean
    squared error relative to the reference's mean square.
    """
    total = torch.zeros(())
    for g, w in zip(got, want):
        g, w = g.float(), w.float()
        if w.ndim == 2 and w.shape[1] > 1:
            total = total + nn.functional.kl_div(
                g.log_softmax(1), w.log_softmax(1), log_target=True, reduction="batchmean"
            )
        else:
            total = total + (g - w).pow(2).mean() / w.pow(2).mean().clamp_min(1e-12)
    return total


def train_autoencoder(
    ae: AutoEncoder,
    activations: torch.Tensor,
    *,
    samples: int,
    downstream: Callable[[torch.Tensor, int], Sequence[torch.Tensor]] | None = None,
    targets: Sequence[Sequence[torch.Tensor]] | None = None,
    carry: Callable[[torch.Tensor], torch.Tensor] | None = None,
    budget_s: float = 20.0,
    seed: int = 0,
    lr: float = 3e-4,
    max_steps: int = 300,
    batch: int = 8,
    reconstruction_weight: float = 0.1,
) -> TrainReport:
    """Train ``ae`` on ``activations`` (samples stacked on dim 0) with Adam, its learning rate
    decaying to 0 over ``max_steps`` or the steps the first one says fit in ``budget_s``.

    Each step takes ``batch`` samples. A sample's code goes through ``carry`` (the runtime
    codec's round trip, e.g. int8) on the way forward, and straight through it on the way back,
    so the decoder learns to read what will really arrive. The loss is `output_loss` of the
    model's final outputs against ``targets`` (distillation) plus ``reconstruction_weight``
    times the relative squared reconstruction error; without a downstream, reconstruction alone.

    Args:
        activations: the cut tensor of every calibration sample, stacked on dim 0.
        samples: how many samples ``activations`` holds (each has ``len // samples`` rows).
        downstream: ``f(decoded, k)`` -> the model's final outputs for sample k when its cut
            tensor is replaced by ``decoded`` (one sample's rows). None: reconstruction only.
            Its own weights should need no gradient (only the input's is wanted).
        targets: the model's final outputs for each sample, uncompressed (with ``downstream``).
        carry: the round trip of the codec that carries the code; None sends it as it is.
        budget_s: wall-clock cap. Training is deterministic for a seed when it takes its
            ``max_steps`` within the budget; `TrainReport.budget_hit` says when it did not.
    """
    if downstream is not None and targets is None:
        raise InternalError("train_autoencoder: a downstream needs the targets of every sample")
    start = time.perf_counter()
    torch.manual_seed(seed)
    x = activations.detach().float()
    per = len(x) // samples
    rows = [x[k * per : (k + 1) * per] for k in range(samples)]
    weight = reconstruction_weight if downstream is not None else 1.0
    generator = torch.Generator().manual_seed(seed)
    probe = list(range(0, samples, max(1, samples // 16)))[:16]

    def loss_of(batch_ks: list[int]) -> torch.Tensor:
        """The mean loss of the samples ``batch_ks``, run through the autoencoder together."""
        xs = torch.cat([rows[k] for k in batch_ks])
        code = ae.encoder(xs)
        if carry is not None:  # forward: what arrives; backward: straight through
            sent = torch.cat([carry(c) for c in code.detach().split(per)])
            code = code + (sent - code).detach()
        decoded = ae.decoder(code)
        rec = (decoded - xs).pow(2).mean() / xs.pow(2).mean().clamp_min(1e-12)
        if downstream is None:
            return rec
        parts = decoded.split(per)
        out = sum(output_loss(downstream(d, k), targets[k]) for d, k in zip(parts, batch_ks))
        return out / len(batch_ks) + weight * rec

    def outputs() -> float | None:
        if downstream is None:
            return None
        with torch.no_grad():
            return float(loss_of(probe))

    before, out_before = _error(ae, rows, carry), outputs()
    initial = copy.deepcopy(ae.state_dict())
    opt = torch.optim.Adam(ae.parameters(), lr=lr)
    steps, horizon = 0, max_steps
    while steps < horizon:
        if time.perf_counter() - start > budget_s:
            horizon = steps
            break
        begun = time.perf_counter()
        for group in opt.param_groups:  # cosine decay to 0 over the steps that fit the budget
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * steps / horizon))
        opt.zero_grad()
        loss_of(torch.randint(0, samples, (batch,), generator=generator).tolist()).backward()
        opt.step()
        steps += 1
        if steps == 1:  # plan the schedule for the steps the budget holds
            left = budget_s - (time.perf_counter() - start)
            horizon = max(1, min(max_steps, 1 + int(left / (time.perf_counter() - begun))))
    out_after = outputs()
    restored = out_before is not None and out_after is not None and out_after > out_before
    if restored:  # training made the outputs worse on the probe samples: keep the start
        ae.load_state_dict(initial)
        out_after = out_before
    report = TrainReport(
        steps=steps,
        error_before=before,
        error_after=_error(ae, rows, carry),
        output_loss_before=out_before,
        output_loss_after=out_after,
        seconds=time.perf_counter() - start,
        budget_hit=horizon < max_steps,
        restored=restored,
    )
    log.info("autoencoder trained: %s", report)
    return report


def _error(ae: AutoEncoder, rows: list[torch.Tensor], carry) -> float:
    """Relative reconstruction error over all samples, the code carried by ``carry``."""
    num = den = 0.0
    with torch.no_grad():
        for r in rows:
            code = ae.encoder(r)
            back = ae.decoder(carry(code) if carry is not None else code)
            num += float((back - r).pow(2).sum())
            den += float(r.pow(2).sum())
    return (num / max(den, 1e-24)) ** 0.5
