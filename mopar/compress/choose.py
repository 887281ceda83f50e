"""Choose a codec for every tensor a slice hands on, within an error budget, and insert it.

Read in this order: `Budget`, `choose_codecs` (measure every candidate on held-out
calibration samples, keep the cheapest within the budget, then check all choices together),
`_Chain` (runs the torch slices with a cut tensor replaced: the downstream the autoencoder is
distilled through and every candidate is judged by), then `_Coded` (wraps a slice so that its
encoder runs at its tail and its consumers' decoders at their heads, inside the ONNX graphs).

A candidate's price is the time it adds to a request: encode + hand over its bytes on the cut's
transport + decode. The output change is measured on the model's final outputs: the relative
error as verification defines it (max |diff| / max |reference|) and, for classifiers (2-D
outputs), the share of samples whose top-1 class changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from mopar.compress.ae import (
    AutoEncoder,
    TrainReport,
    make_autoencoder,
    supports,
    train_autoencoder,
)
from mopar.compress.budget import Budget, Effect, effect_of
from mopar.compress.calibration import Calibration
from mopar.errors import Option, PlanError

__all__ = [
    "CodecChoice",
    "Measured",
    "measure_candidates",
    "choose_codecs",
    "roundtrip",
    "LOSSLESS",
    "LOSSY",
    "AE_RATIOS",
]

LOSSLESS = ("none", "zstd")
LOSSY = ("fp16", "bf16", "int8", "fp16+zstd", "int8+zstd")
AE_RATIOS = {"ae2": 2, "ae4": 4, "ae16": 16}
AE_CODECS = ("ae2+int8+zstd", "ae4+int8+zstd", "ae4", "ae4+fp16", "ae16", "ae16+fp16")
"""Autoencoders, their code sent as it is, cast to fp16 (``+fp16``), or quantised to int8 and
compressed (``+int8+zstd``: 2 x 4 = 8 and 4 x 4 = 16 times fewer bytes, and a little more)."""
AUTO_AE = ("ae2+int8+zstd", "ae4+int8+zstd", "ae4", "ae4+fp16")
"""The autoencoders ``--codec auto`` tries: two networks per cut tensor (ratios 2 and 4). A
network of ratio 16 would take training time from them, and where ratio 4 already misses a
1% top-1 budget (most cuts in docs/codecs.md), 16 misses it further."""
AE_CARRIER = "int8"
"""Every autoencoder is trained with its code carried by this codec (quantisation-aware), so one
network serves its ratio's labels; a code sent as fp16 or as it is arrives closer still."""


def _is_ae(label: str) -> bool:
    return label.split("+")[0] in AE_RATIOS


def _ae_key(tensor: str, label: str) -> str:
    return f"{tensor}|{label.split('+')[0]}"


def code_codec(label: str) -> str:
    """The runtime codec that carries an autoencoder's code (``none``, ``fp16``, ``int8+zstd``)."""
    return label.split("+", 1)[1] if "+" in label else "none"


MIN_CODEC_BYTES = 16 << 10
"""Tensors smaller than this are sent as they are: no codec pays for itself on them."""


@dataclass(frozen=True, kw_only=True)
class CodecChoice:
    """The codec of one cut tensor, with what it measured on the held-out samples."""

    slice: str
    tensor: str
    codec: str
    raw_bytes: int
    bytes: int
    error: float
    top1_change: float | None
    encode_ms: float
    decode_ms: float
    cosine: float | None = None

    @property
    def ratio(self) -> float:
        return self.raw_bytes / max(self.bytes, 1)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ratio": round(self.ratio, 3)}


@dataclass(frozen=True, kw_only=True)
class Measured:
    """Every candidate codec of every cut tensor, measured on the held-out samples.

    Attributes:
        chain: the torch slices (`_Chain`).
        tensors: (producing slice index, tensor name) of every cut tensor.
        candidates: tensor name -> its measured candidates.
        autoencoders: ``"<tensor>|<ae codec>"`` -> the trained autoencoder.
        held: every held-out sample's tensors (the uncompressed run).
        trained: ``"<tensor>|<ae codec>"`` -> how its training went.
    """

    chain: Any
    tensors: tuple[tuple[int, str], ...]
    candidates: dict[str, tuple[CodecChoice, ...]]
    autoencoders: dict[str, AutoEncoder]
    held: tuple[dict[str, torch.Tensor], ...]
    trained: dict[str, TrainReport] = dataclasses.field(default_factory=dict)

    def training(self, choice: CodecChoice) -> TrainReport | None:
        """How the autoencoder of ``choice`` trained; None for a codec without one."""
        return (
            self.trained.get(_ae_key(choice.tensor, choice.codec)) if _is_ae(choice.codec) else None
        )


def measure_candidates(
    slices: Sequence[Any],
    calibration: Calibration,
    *,
    codec: str,
    budget: Budget,
    budget_s: float = 60.0,
    seed: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
) -> Measured:
    """Train the autoencoders and measure every candidate of every cut tensor (see
    `choose_codecs` for the arguments)."""
    from mopar.codec import get_codec

    train, held = calibration.split()
    chain = _Chain(slices)
    cut = _cut_tensors(slices)
    candidates = _candidates(codec, budget)
    train_values = [chain.values(s) for s in train]
    held_values = [chain.values(s) for s in held]
    measured: dict[str, tuple[CodecChoice, ...]] = {}
    aes: dict[str, AutoEncoder] = {}
    reports: dict[str, TrainReport] = {}
    ae_budget = budget_s / max(1, _networks(candidates, [held_values[0][n] for _k, n in cut]))
    for n, (k, name) in enumerate(cut):
        if progress:
            progress(f"codecs: {name}", n, len(cut))
        raw = held_values[0][name]
        found = []
        for cand in candidates:
            if raw.numel() * raw.element_size() < MIN_CODEC_BYTES and cand != "none":
                continue
            if _is_ae(cand):
                ratio = AE_RATIOS[cand.split("+")[0]]
                if not supports(tuple(raw.shape), raw.dtype, ratio):
                    continue
                key = _ae_key(name, cand)
                if key not in aes:
                    aes[key], reports[key] = _train_ae(
                        chain, k, name, train_values, ratio, ae_budget, seed
                    )
                found.append(_measure(chain, k, name, held_values, cand, slices[k].name, aes[key]))
            elif get_codec(cand).supports(raw.numpy().dtype):
                found.append(_measure(chain, k, name, held_values, cand, slices[k].name))
        measured[name] = tuple(found)
    return Measured(
        chain=chain,
        tensors=tuple(cut),
        candidates=measured,
        autoencoders=aes,
        held=tuple(held_values),
        trained=reports,
    )


def _networks(candidates: Sequence[str], tensors: Sequence[torch.Tensor]) -> int:
    """How many autoencoders `measure_candidates` trains: one per cut tensor and ratio that fits
    it (the training budget is shared among them)."""
    ratios = {AE_RATIOS[c.split("+")[0]] for c in candidates if _is_ae(c)}
    return sum(
        supports(tuple(t.shape), t.dtype, r)
        for t in tensors
        if t.numel() * t.element_size() >= MIN_CODEC_BYTES
        for r in ratios
    )


def choose_codecs(
    slices: Sequence[Any],
    calibration: Calibration,
    *,
    codec: str,
    budget: Budget,
    transfer_ms: Callable[[str, int], float],
    budget_s: float = 60.0,
    seed: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
) -> tuple[tuple[Any, ...], tuple[CodecChoice, ...], dict[str, str]]:
    """Pick and insert codecs.

    Args:
        slices: `SliceModule`s in order.
        codec: ``"auto"`` (choose per tensor) or one codec for every cut tensor.
        budget: the output change allowed.
        transfer_ms: ``(slice name, bytes) -> ms`` of handing bytes on from that slice.
        budget_s: training time for all autoencoders together.

    Returns:
        The slices with autoencoders inserted, a `CodecChoice` per cut tensor, and the runtime
        codec of every cut tensor (what the worker encodes it with; autoencoders' codes ``none``).
    """
    m = measure_candidates(
        slices,
        calibration,
        codec=codec,
        budget=budget,
        budget_s=budget_s,
        seed=seed,
        progress=progress,
    )
    choices = []
    for _k, name in m.tensors:
        found = m.candidates[name]
        plain = [c for c in found if c.codec == "none"]
        if codec == "auto":
            pool = [c for c in found if budget.allows(c.error, c.top1_change, c.cosine)]
        else:  # forced: wherever it applies, and within the budget if one was given
            pool = [
                c
                for c in found
                if c.codec != "none"
                and (not budget.lossy or budget.allows(c.error, c.top1_change, c.cosine))
            ]
        choices.append(
            min(
                pool or plain,
                key=lambda c: (c.encode_ms + transfer_ms(c.slice, c.bytes) + c.decode_ms, c.error),
            )
        )
    if budget.lossy:
        choices = _fit_together(m.chain, choices, list(m.held), budget, m.autoencoders)
    coded = _insert(slices, choices, m.autoencoders)
    runtime = {c.tensor: (code_codec(c.codec) if _is_ae(c.codec) else c.codec) for c in choices}
    return coded, tuple(choices), runtime


def _candidates(codec: str, budget: Budget) -> tuple[str, ...]:
    from mopar.codec import CodecError, get_codec

    if codec == "auto":
        return LOSSLESS + ((*LOSSY, *AUTO_AE) if budget.lossy else ())
    if codec == "ae":
        return ("none", "ae4")
    if not _is_ae(codec):
        try:
            get_codec(codec)
        except CodecError:
            raise PlanError(
                "unknown ",
                Option("codec", value=codec, quoted=True),
                f"; choose auto, ae, {', '.join((*LOSSLESS, *LOSSY, *AE_CODECS))}",
            ) from None
    return tuple(dict.fromkeys(("none", codec)))


def _cut_tensors(slices) -> list[tuple[int, str]]:
    """(producing slice index, tensor) of every tensor a later slice reads; model outputs that
    are also read later are left alone (the client must get them unchanged)."""
    read_later = {t.name for s in slices[1:] for t in s.inputs}
    final = {t.name for t in slices[-1].outputs}
    out = []
    for k, s in enumerate(slices[:-1]):
        out += [(k, t.name) for t in s.outputs if t.name in read_later and t.name not in final]
    return out


class _Chain:
    """The torch slices, run from any slice on with any tensor replaced."""

    def __init__(self, slices):
        self.slices = slices
        self.outputs = [t.name for t in slices[-1].outputs]

    def values(self, inputs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        values = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in inputs.items()}
        with torch.no_grad():
            self._run(values, 0)
        return values

    def _run(
        self,
        values: dict[str, torch.Tensor],
        start: int,
        after_slice: Callable[[Any, dict[str, torch.Tensor]], None] | None = None,
    ) -> None:
        for s in self.slices[start:]:
            results = s.gm(*[values[t.name] for t in s.inputs])
            values.update(zip((t.name for t in s.outputs), results))
            if after_slice is not None:
                after_slice(s, values)

    def coded(
        self, values: dict[str, torch.Tensor], carry: Callable[[Any, dict[str, torch.Tensor]], None]
    ) -> list[torch.Tensor]:
        """The model's outputs from the inputs in ``values`` when ``carry(slice, values)``
        replaces what each slice hands on."""
        mine = dict(values)
        self._run(mine, 0, carry)
        return [mine[n] for n in self.outputs]

    def final(
        self, values: dict[str, torch.Tensor], after: int, replace: dict[str, torch.Tensor]
    ) -> list[torch.Tensor]:
        """The model's outputs when slices after ``after`` read ``replace`` instead."""
        mine = {**values, **replace}
        self._run(mine, after + 1)
        return [mine[n] for n in self.outputs]


def _change(chain: _Chain, base: list[dict], got: list[list[torch.Tensor]]) -> Effect:
    """What ``got`` changed of the base outputs (`mopar.compress.budget.effect_of`)."""
    return effect_of(
        ({n: values[n].numpy() for n in chain.outputs} for values in base),
        ({n: o.detach().numpy() for n, o in zip(chain.outputs, outs)} for outs in got),
    )


def _timed(fn, *args) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - start) * 1e3


def _choice(chain, held, got, slice_name, name, label, sizes, enc_ms, dec_ms) -> CodecChoice:
    """The choice of ``label`` for tensor ``name``, from what its round trips gave (``got``, the
    final outputs) and their sizes and times (medians)."""
    effect = _change(chain, held, got)
    return CodecChoice(
        slice=slice_name,
        tensor=name,
        codec=label,
        raw_bytes=held[0][name].numpy().nbytes,
        bytes=int(np.mean(sizes)),
        error=effect.error,
        top1_change=effect.top1_change,
        cosine=effect.cosine,
        encode_ms=float(np.median(enc_ms)),
        decode_ms=float(np.median(dec_ms)),
    )


def _measure(chain, k, name, held, label, slice_name, ae=None) -> CodecChoice:
    """Round trips of tensor ``name`` through ``label``: its runtime codec, carrying the code of
    ``ae`` (an autoencoder) where given."""
    from mopar.codec import get_codec

    codec = get_codec(code_codec(label) if ae is not None else label)
    got, sizes, enc_ms, dec_ms = [], [], [], []
    with torch.no_grad():
        for values in held:
            a, e = _timed(ae.encoder, values[name]) if ae is not None else (values[name], 0.0)
            a = a.numpy()
            data, e2 = _timed(codec.encode, a)
            sent, d2 = _timed(functools.partial(codec.decode, dtype=a.dtype, shape=a.shape), data)
            back = torch.from_numpy(np.array(sent))
            back, d = _timed(ae.decoder, back) if ae is not None else (back, 0.0)
            sizes.append(len(data))
            enc_ms.append(e + e2)
            dec_ms.append(d + d2)
            got.append(chain.final(values, k, {name: back}))
    return _choice(chain, held, got, slice_name, name, label, sizes, enc_ms, dec_ms)


def _train_ae(chain, k, name, train, ratio, budget_s, seed) -> tuple[AutoEncoder, TrainReport]:
    """An autoencoder for tensor ``name`` (made by slice ``k``), distilled on the training
    samples: the model's final outputs with the decoded tensor against the uncompressed ones,
    its code carried by `AE_CARRIER`."""
    acts = torch.cat([v[name] for v in train])
    ae = make_autoencoder(tuple(acts.shape), ratio, seed=seed, activations=acts)

    def downstream(decoded: torch.Tensor, i: int) -> list[torch.Tensor]:
        return chain.final(train[i], k, {name: decoded.reshape(train[i][name].shape)})

    with _no_weight_grads(chain.slices[k + 1 :]):
        report = train_autoencoder(
            ae,
            acts,
            samples=len(train),
            downstream=downstream,
            targets=[[v[o] for o in chain.outputs] for v in train],
            carry=functools.partial(_through, AE_CARRIER),
            budget_s=budget_s,
            seed=seed,
        )
    ae.eval()
    return ae, report


@contextlib.contextmanager
def _no_weight_grads(slices) -> Iterator[None]:
    """Within: the slices' weights need no gradient, so backpropagating through them to an
    autoencoder computes (and keeps) none for them."""
    params = [p for s in slices for p in s.gm.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def _fit_together(chain, choices, held, budget, aes) -> list[CodecChoice]:
    """Measure every lossy choice applied at once; while the outputs leave the budget, send the
    tensor with the largest error of its own uncompressed instead."""
    choices = list(choices)
    while any(c.error > 0 for c in choices):

        def carry(s, values):
            for c in choices:
                if c.slice == s.name and c.error > 0:
                    values[c.tensor] = roundtrip(c, values[c.tensor], aes)

        with torch.no_grad():
            got = [chain.coded(values, carry) for values in held]
        if budget.admits(_change(chain, held, got)):
            break
        worst = max(range(len(choices)), key=lambda i: choices[i].error)
        choices[worst] = dataclasses.replace(
            choices[worst],
            codec="none",
            bytes=choices[worst].raw_bytes,
            error=0.0,
            top1_change=0.0 if choices[worst].top1_change is not None else None,
            cosine=1.0 if choices[worst].cosine is not None else None,
            encode_ms=0.0,
            decode_ms=0.0,
        )
    return choices


def roundtrip(
    choice: CodecChoice, value: torch.Tensor, aes: dict[str, AutoEncoder]
) -> torch.Tensor:
    """``value`` after the codec of ``choice`` (and its autoencoder from ``aes``) carried it."""
    if _is_ae(choice.codec):
        ae = aes[_ae_key(choice.tensor, choice.codec)]
        return ae.decoder(_through(code_codec(choice.codec), ae.encoder(value)))
    return _through(choice.codec, value)


def _through(name: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` encoded and decoded by the runtime codec ``name``."""
    from mopar.codec import get_codec

    a = value.detach().numpy()
    codec = get_codec(name)
    return torch.from_numpy(np.array(codec.decode(codec.encode(a), dtype=a.dtype, shape=a.shape)))


class _Coded(nn.Module):
    """A slice with encoders on the outputs it hands on and decoders on the inputs it reads."""

    def __init__(
        self,
        gm: nn.Module,
        inputs: Sequence[str],
        outputs: Sequence[str],
        encoders: dict[str, nn.Module],
        decoders: dict[str, nn.Module],
    ):
        super().__init__()
        self.gm = gm
        self.inputs, self.outputs = tuple(inputs), tuple(outputs)
        self.encoders = nn.ModuleDict({_key(k): v for k, v in encoders.items()})
        self.decoders = nn.ModuleDict({_key(k): v for k, v in decoders.items()})

    def forward(self, *args: torch.Tensor):
        args = tuple(
            self.decoders[_key(n)](a) if _key(n) in self.decoders else a
            for n, a in zip(self.inputs, args)
        )
        outs = self.gm(*args)
        return tuple(
            self.encoders[_key(n)](o) if _key(n) in self.encoders else o
            for n, o in zip(self.outputs, outs)
        )


def _key(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)


def _insert(slices, choices: Sequence[CodecChoice], aes) -> tuple[Any, ...]:
    """The slices with each chosen autoencoder split across its cut."""
    chosen = {c.tensor: aes[_ae_key(c.tensor, c.codec)] for c in choices if _is_ae(c.codec)}
    if not chosen:
        return tuple(slices)
    out = []
    for s in slices:
        enc = {t.name: chosen[t.name].encoder for t in s.outputs if t.name in chosen}
        dec = {t.name: chosen[t.name].decoder for t in s.inputs if t.name in chosen}
        if enc or dec:
            s = dataclasses.replace(
                s,
                gm=_Coded(
                    s.gm, [t.name for t in s.inputs], [t.name for t in s.outputs], enc, dec
                ).eval(),
            )
        out.append(s)
    return tuple(out)
