"""Expert activation traces: how many tokens each expert of each MoE layer receives.

MoE-Infinity calls this the expert activation matrix: layers x experts, counted on calibration
data. mopar counts two things per expert: the tokens routed to it, and the requests (samples of
the captured input shape) in which it received at least one token -- the share of requests that
invoke its function. Without calibration data the trace is assumed: every token picks ``k`` of
``E`` experts uniformly, and a plan says so.

Calibration token data (``--calibration F.npz``) holds arrays by model input name whose first
axis lists sequences. Each is cut into requests of the captured shape: a ``(N, L)`` array for an
input captured as ``(B, S)`` gives ``N * (L // S) // B`` requests of ``B`` windows of ``S``
tokens. An input the file lacks takes the captured example's value (an all-ones attention
mask, say), and a note says so.

A measured trace also says how well each layer's experts can be predicted one layer ahead, for
pre-warming their functions (MoE-Infinity, MoEless): layer l's router is applied to layer l-1's
hidden states, and the experts it picks are compared with the ones layer l's router picks a
layer later. The predictor has no fitted parameters, so every traced request is held out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mopar.errors import InputSpecError, Option

if TYPE_CHECKING:
    from torch import fx

    from mopar.ir.moe import MoeBlock

__all__ = [
    "ExpertTrace",
    "Experts",
    "experts_for",
    "assumed_trace",
    "trace_experts",
    "request_samples",
]


@dataclass(frozen=True, kw_only=True)
class ExpertTrace:
    """The activation matrix of a model's MoE layers.

    Attributes:
        layers: the experts layers' names.
        top_k: k per layer.
        tokens: per layer, the tokens each expert received (summed over requests).
        invoked: per layer, the share of requests in which each expert received a token.
        requests: how many requests were traced (0: assumed, not measured).
        tokens_per_request: T, tokens per request at the captured shape.
        source: where it comes from (a calibration file, or "assumed: uniform routing").
        prewarm: per layer, (precision, recall, token hit rate) of the experts predicted from
            the layer before (None: the first layer, an assumed trace, or a router that reads
            more than the hidden states). Per request, precision is the share of predicted
            experts that tokens reached, recall the share of reached experts that were
            predicted (pre-warming warms experts, whichever token they serve); the token hit
            rate is the share of (token, choice) pairs predicted exactly.
    """

    layers: tuple[str, ...]
    top_k: tuple[int, ...]
    tokens: tuple[tuple[float, ...], ...]
    invoked: tuple[tuple[float, ...], ...]
    requests: int
    tokens_per_request: int
    source: str
    prewarm: tuple[tuple[float, float, float] | None, ...] = ()

    @property
    def measured(self) -> bool:
        return self.requests > 0

    def layer(self, name: str) -> int:
        return self.layers.index(name)

    def share(self, name: str) -> np.ndarray:
        """Each expert's share of the layer's routed tokens (sums to 1)."""
        t = np.asarray(self.tokens[self.layer(name)], dtype=float)
        return t / t.sum() if t.sum() else np.full(t.size, 1.0 / t.size)

    def expected_tokens(self, name: str) -> np.ndarray:
        """Each expert's expected tokens per request."""
        i = self.layer(name)
        return self.share(name) * self.tokens_per_request * self.top_k[i]

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "requests": self.requests,
            "tokens_per_request": self.tokens_per_request,
            "layers": [
                {
                    "layer": name,
                    "top_k": k,
                    "tokens": list(t),
                    "invoked": list(p),
                    **(
                        {"prewarm": {"precision": w[0], "recall": w[1], "token_hit_rate": w[2]}}
                        if w
                        else {}
                    ),
                }
                for name, k, t, p, w in zip(
                    self.layers, self.top_k, self.tokens, self.invoked, self._prewarm()
                )
            ],
        }

    def _prewarm(self) -> tuple:
        return self.prewarm or (None,) * len(self.layers)


@dataclass(frozen=True, kw_only=True)
class Experts:
    """A mixture-of-experts model's blocks and their activation trace: what the planner places
    experts with (`mopar.planner.experts.place_experts`)."""

    blocks: tuple[MoeBlock, ...]
    trace: ExpertTrace


def experts_for(
    blocks: Sequence[MoeBlock],
    gm: fx.GraphModule,
    inputs: Mapping[str, np.ndarray],
    calibration: Path | None,
) -> Experts | None:
    """The blocks with their trace: measured by running ``gm`` on the requests of the
    ``calibration`` token data when given, else assumed uniform. None without blocks.

    Tracing runs the model, so a compile does it once and hands the result to every planning
    round (`mopar.pipeline.profile`)."""
    if not blocks:
        return None
    if calibration is None:
        return Experts(blocks=tuple(blocks), trace=assumed_trace(blocks))
    samples, _ = request_samples(Path(calibration), inputs)
    trace = trace_experts(
        gm, blocks, samples, source=f"{len(samples)} requests of {Path(calibration).name}"
    )
    return Experts(blocks=tuple(blocks), trace=trace)


def assumed_trace(blocks: Sequence) -> ExpertTrace:
    """Uniform routing: each token picks ``k`` of ``E`` experts, each expert equally likely."""
    tokens, invoked = [], []
    t = blocks[0].tokens if blocks else 0
    for b in blocks:
        e, k = b.num_experts, b.top_k
        tokens.append(tuple([b.tokens * k / e] * e))
        invoked.append(tuple([1.0 - (1.0 - k / e) ** b.tokens] * e))
    return ExpertTrace(
        layers=tuple(b.name for b in blocks),
        top_k=tuple(b.top_k for b in blocks),
        tokens=tuple(tokens),
        invoked=tuple(invoked),
        requests=0,
        tokens_per_request=t,
        source="assumed: uniform routing (pass --calibration with token data to measure it)",
    )


def request_samples(
    path: Path, example: Mapping[str, np.ndarray]
) -> tuple[list[dict[str, np.ndarray]], tuple[str, ...]]:
    """Requests of the example's shapes cut from the sequences in ``path`` (an .npz)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise InputSpecError(
            Option("calibration", value=str(path), quoted=True),
            f" cannot be read as .npz ({exc}); pass an .npz of token arrays by input name",
        ) from None
    given = [k for k in example if k in arrays]
    if not given:
        raise InputSpecError(
            Option("calibration", value=str(path), quoted=True),
            f" has arrays {sorted(arrays)}, none of "
            f"them an input of the model ({', '.join(example)}); name them so",
        )
    notes = [
        f"expert trace: input {k!r} is not in {path.name}; every request uses the example's"
        for k in example
        if k not in arrays
    ]
    cut = {k: _windows(k, arrays[k], example[k]) for k in given}
    n = min(len(v) for v in cut.values())
    samples = [{k: (cut[k][i] if k in cut else v) for k, v in example.items()} for i in range(n)]
    return samples, tuple(notes)


def _windows(name: str, a: np.ndarray, ref: np.ndarray) -> list[np.ndarray]:
    if ref.ndim == 0 or (ref.ndim > 1 and (a.ndim != ref.ndim or a.shape[2:] != ref.shape[2:])):
        raise InputSpecError(
            Option("calibration"),
            f" {name} has shape {list(a.shape)}; expected sequences "
            f"(N, L) for an input captured as {list(ref.shape)}",
        )
    if ref.ndim == 1:
        rows = a.reshape(-1)
        width = ref.shape[0]
        return [
            rows[i : i + width].astype(ref.dtype) for i in range(0, rows.size - width + 1, width)
        ]
    batch, width = ref.shape[0], ref.shape[1]
    if a.shape[1] < width:
        raise InputSpecError(
            Option("calibration"),
            f" {name} holds sequences of {a.shape[1]} tokens; the "
            f"model was captured for {width}; pass longer sequences",
        )
    per = a.shape[1] // width
    windows = a[:, : per * width].reshape(a.shape[0] * per, width, *a.shape[2:])
    count = len(windows) // batch
    return [windows[i * batch : (i + 1) * batch].astype(ref.dtype) for i in range(count)]


@contextlib.contextmanager
def _fastest_threads(run):
    """Run the body at torch's thread count or at one thread, whichever runs ``run`` faster:
    a request of a small model is many tiny operators, which one thread runs several times
    faster than two that wait on each other (512 requests of the tiny Mixtral: 1.8 s against
    20 s on a loaded 2-core machine)."""
    import time

    import torch

    before = torch.get_num_threads()

    def timed() -> float:
        run()  # warm
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    many = timed()
    torch.set_num_threads(1)
    if timed() > many:
        torch.set_num_threads(before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def trace_experts(
    gm,
    blocks: Sequence,
    samples: Sequence[Mapping[str, np.ndarray]],
    *,
    source: str,
    limit: int = 512,
) -> ExpertTrace:
    """Run ``gm`` on each sample (at most ``limit``), count the experts each layer's router
    picked, and score the one-layer-ahead prediction of them (``prewarm``)."""
    import torch

    from mopar.ir.moe import probe, router_of

    counts = [np.zeros(b.num_experts) for b in blocks]
    hits = [np.zeros(b.num_experts) for b in blocks]
    seen_of = probe(gm, {b.index for b in blocks} | {b.hidden for b in blocks})
    ahead = [None] + [router_of(gm, b) for b in blocks[1:]]
    # experts per request: both reached and predicted, predicted, reached; per token: the
    # choices predicted, all choices
    scores = [np.zeros(5) for _ in blocks]
    used = list(samples)[:limit]
    args = [[torch.from_numpy(np.ascontiguousarray(v)) for v in s.values()] for s in used]
    with _fastest_threads(lambda: seen_of(args[0]) if args else None):
        for a in args:
            seen = seen_of(a)
            for i, (b, c, h) in enumerate(zip(blocks, counts, hits)):
                chosen = seen[b.index].reshape(-1).numpy()
                per = np.bincount(chosen, minlength=b.num_experts)[: b.num_experts]
                c += per
                h += per > 0
                before = seen[blocks[i - 1].hidden] if i else None
                if ahead[i] is not None and before.shape == seen[b.hidden].shape:
                    with torch.no_grad():
                        guess = ahead[i](before).reshape(-1, b.top_k).numpy()
                    actual = chosen.reshape(-1, b.top_k)
                    g, r = set(guess.reshape(-1).tolist()), set(chosen.tolist())
                    same = (guess[:, :, None] == actual[:, None, :]).any(axis=2).sum()
                    scores[i] += (len(g & r), len(g), len(r), same, actual.size)
    n = max(len(used), 1)
    prewarm = tuple(
        (round(float(s[0] / s[1]), 4), round(float(s[0] / s[2]), 4), round(float(s[3] / s[4]), 4))
        if s[1] and s[2]
        else None
        for s in scores
    )
    return ExpertTrace(
        layers=tuple(b.name for b in blocks),
        top_k=tuple(b.top_k for b in blocks),
        tokens=tuple(tuple(float(x) for x in c) for c in counts),
        invoked=tuple(tuple(float(x) / n for x in h) for h in hits),
        requests=len(used),
        tokens_per_request=blocks[0].tokens if blocks else 0,
        source=source,
        prewarm=prewarm,
    )
