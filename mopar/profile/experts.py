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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mopar.errors import InputSpecError

__all__ = ["ExpertTrace", "assumed_trace", "trace_experts", "request_samples"]


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
    """

    layers: tuple[str, ...]
    top_k: tuple[int, ...]
    tokens: tuple[tuple[float, ...], ...]
    invoked: tuple[tuple[float, ...], ...]
    requests: int
    tokens_per_request: int
    source: str

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
        return {"source": self.source, "requests": self.requests,
                "tokens_per_request": self.tokens_per_request,
                "layers": [{"layer": name, "top_k": k, "tokens": list(t), "invoked": list(p)}
                           for name, k, t, p in zip(self.layers, self.top_k, self.tokens,
                                                    self.invoked)]}


def assumed_trace(blocks: Sequence) -> ExpertTrace:
    """Uniform routing: each token picks ``k`` of ``E`` experts, each expert equally likely."""
    tokens, invoked = [], []
    t = blocks[0].tokens if blocks else 0
    for b in blocks:
        e, k = b.num_experts, b.top_k
        tokens.append(tuple([b.tokens * k / e] * e))
        invoked.append(tuple([1.0 - (1.0 - k / e) ** b.tokens] * e))
    return ExpertTrace(layers=tuple(b.name for b in blocks), top_k=tuple(b.top_k for b in blocks),
                       tokens=tuple(tokens), invoked=tuple(invoked), requests=0,
                       tokens_per_request=t, source="assumed: uniform routing (pass --calibration "
                       "with token data to measure it)")


def request_samples(path: Path, example: Mapping[str, np.ndarray]
                    ) -> tuple[list[dict[str, np.ndarray]], tuple[str, ...]]:
    """Requests of the example's shapes cut from the sequences in ``path`` (an .npz)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise InputSpecError(f"--calibration {str(path)!r} cannot be read as .npz ({exc}); pass "
                             "an .npz of token arrays by input name") from None
    given = [k for k in example if k in arrays]
    if not given:
        raise InputSpecError(f"--calibration {str(path)!r} has arrays {sorted(arrays)}, none of "
                             f"them an input of the model ({', '.join(example)}); name them so")
    notes = [f"expert trace: input {k!r} is not in {path.name}; every request uses the example's"
             for k in example if k not in arrays]
    cut = {k: _windows(k, arrays[k], example[k]) for k in given}
    n = min(len(v) for v in cut.values())
    samples = [{k: (cut[k][i] if k in cut else v) for k, v in example.items()} for i in range(n)]
    return samples, tuple(notes)


def _windows(name: str, a: np.ndarray, ref: np.ndarray) -> list[np.ndarray]:
    if ref.ndim == 0 or (ref.ndim > 1 and (a.ndim != ref.ndim or a.shape[2:] != ref.shape[2:])):
        raise InputSpecError(f"--calibration {name} has shape {list(a.shape)}; expected sequences "
                             f"(N, L) for an input captured as {list(ref.shape)}")
    if ref.ndim == 1:
        rows = a.reshape(-1)
        width = ref.shape[0]
        return [rows[i:i + width].astype(ref.dtype) for i in range(0, rows.size - width + 1, width)]
    batch, width = ref.shape[0], ref.shape[1]
    if a.shape[1] < width:
        raise InputSpecError(f"--calibration {name} holds sequences of {a.shape[1]} tokens; the "
                             f"model was captured for {width}; pass longer sequences")
    per = a.shape[1] // width
    windows = a[:, : per * width].reshape(a.shape[0] * per, width, *a.shape[2:])
    count = len(windows) // batch
    return [windows[i * batch:(i + 1) * batch].astype(ref.dtype) for i in range(count)]


def trace_experts(gm, blocks: Sequence, samples: Sequence[Mapping[str, np.ndarray]], *,
                  source: str, limit: int = 512) -> ExpertTrace:
    """Run ``gm`` on each sample (at most ``limit``) and count the experts each layer's router
    picked."""
    import torch

    from mopar.ir.moe import record_nodes

    counts = [np.zeros(b.num_experts) for b in blocks]
    hits = [np.zeros(b.num_experts) for b in blocks]
    names = {b.index for b in blocks}
    used = list(samples)[:limit]
    for sample in used:
        args = [torch.from_numpy(np.ascontiguousarray(v)) for v in sample.values()]
        seen = record_nodes(gm, args, names)
        for b, c, h in zip(blocks, counts, hits):
            chosen = seen[b.index].reshape(-1).numpy()
            per = np.bincount(chosen, minlength=b.num_experts)[: b.num_experts]
            c += per
            h += per > 0
    n = max(len(used), 1)
    return ExpertTrace(layers=tuple(b.name for b in blocks), top_k=tuple(b.top_k for b in blocks),
                       tokens=tuple(tuple(float(x) for x in c) for c in counts),
                       invoked=tuple(tuple(float(x) / n for x in h) for h in hits),
                       requests=len(used), tokens_per_request=blocks[0].tokens if blocks else 0,
                       source=source)

