"""Which operator samples to measure: per op variant, how many and how their configs are drawn.

Read `Limits` (the bounds a sample must respect), `SWEEP` (op -> variant -> count and a draw of
its config), then `sweep`. Configs are drawn log-uniformly over the sizes that real models use
(channels 3..2048, spatial 4..224, features 16..25088, sequences 1..1024, batches 1..8, ...);
a draw over the limits is rejected and drawn again, so the largest samples stay within a few
seconds and a few hundred MB each.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from tools.profiler.ops import BUILDERS, OpSample

__all__ = ["Limits", "QUICK", "SWEEP", "OP_ALIASES", "sweep"]


# --- limits and draws -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Bounds a drawn sample must respect (larger draws are rejected and redrawn).

    Attributes:
        max_flops: forward FLOPs.
        max_param_bytes: bytes of weights.
        max_tensor_bytes: bytes of any one input or output.
        per_variant: samples per variant, as a multiple of the variant's `SWEEP` count.
    """

    max_flops: float = 4e9
    max_param_bytes: int = 512 << 20
    max_tensor_bytes: int = 256 << 20
    per_variant: float = 1.0


QUICK = Limits(max_flops=2e7, max_param_bytes=1 << 20, max_tensor_bytes=1 << 20, per_variant=0.0)


def _log(rng: np.random.Generator, lo: int, hi: int) -> int:
    """An integer drawn log-uniformly from [lo, hi]."""
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _pick(rng: np.random.Generator, values: Sequence[int]) -> int:
    return int(values[rng.integers(len(values))])


_BATCH = (1, 1, 1, 1, 2, 4, 8)
Draw = Callable[[np.random.Generator], dict[str, int]]


def _draw_conv(variant: str) -> Draw:
    def draw(r: np.random.Generator) -> dict[str, int]:
        c = {"batch": _pick(r, _BATCH), "stride": _pick(r, (1, 1, 2))}
        if variant == "regular":
            c |= {
                "cin": _log(r, 3, 1024),
                "cout": _log(r, 8, 1024),
                "size": _log(r, 7, 224),
                "kernel": _pick(r, (1, 1, 3, 3, 3, 5, 7)),
                "groups": 1,
            }
        elif variant == "depthwise":
            ch = _log(r, 16, 2048)
            c |= {
                "cin": ch,
                "cout": ch,
                "groups": ch,
                "size": _log(r, 7, 112),
                "kernel": _pick(r, (3, 5, 7)),
            }
        else:
            g = _pick(r, (2, 4, 8, 16, 32))
            c |= {
                "cin": g * _log(r, 2, 128),
                "cout": g * _log(r, 2, 128),
                "groups": g,
                "size": _log(r, 7, 112),
                "kernel": _pick(r, (1, 3, 3)),
            }
        return c

    return draw


def _rnn_draw(r: np.random.Generator) -> dict[str, int]:
    return {
        "seq": _log(r, 2, 256),
        "batch": _pick(r, _BATCH),
        "input": _log(r, 8, 1024),
        "hidden": _log(r, 8, 1024),
        "directions": _pick(r, (1, 2)),
    }


def _spatial(r: np.random.Generator) -> dict[str, int]:
    return {
        "batch": _pick(r, _BATCH),
        "channels": _log(r, 8, 1024),
        "size": _log(r, 4, 224),
        "kernel": _pick(r, (2, 3)),
        "stride": _pick(r, (1, 2, 2)),
    }


def _elementwise_draw(r: np.random.Generator) -> dict[str, int]:
    if r.integers(2):
        return {
            "rank": 4,
            "batch": _pick(r, _BATCH),
            "channels": _log(r, 8, 1024),
            "size": _log(r, 4, 224),
        }
    return {
        "rank": 3,
        "batch": _pick(r, _BATCH),
        "seq": _log(r, 1, 512),
        "channels": _log(r, 16, 4096),
    }


# op -> {variant: (samples in a full sweep, how to draw its config)}
SWEEP: dict[str, dict[str, tuple[int, Draw]]] = {
    "conv": {
        v: (n, _draw_conv(v)) for v, n in (("regular", 240), ("depthwise", 80), ("grouped", 60))
    },
    "gemm": {
        "2d": (
            110,
            lambda r: {
                "batch": _log(r, 1, 256),
                "in_features": _log(r, 16, 25088),
                "out_features": _log(r, 16, 8192),
            },
        ),
        "3d": (
            90,
            lambda r: {
                "batch": _pick(r, (1, 1, 2, 4)),
                "seq": _log(r, 1, 512),
                "in_features": _log(r, 32, 4096),
                "out_features": _log(r, 32, 4096),
            },
        ),
    },
    "batched_matmul": {
        "3d": (
            90,
            lambda r: {
                "batch": _log(r, 1, 64),
                "m": _log(r, 8, 4096),
                "k": _log(r, 8, 4096),
                "n": _log(r, 8, 1024),
            },
        )
    },
    "attention": {
        "sdpa": (
            80,
            lambda r: {
                "batch": _pick(r, (1, 1, 2, 4)),
                "heads": _pick(r, (1, 2, 4, 8, 12, 16)),
                "seq": _log(r, 8, 1024),
                "head_dim": _pick(r, (16, 32, 64, 128)),
            },
        )
    },
    "lstm": {"onnx": (70, _rnn_draw)},
    "gru": {"onnx": (60, _rnn_draw)},
    "layer_norm": {
        "last_axis": (
            50,
            lambda r: {
                "batch": _pick(r, _BATCH),
                "seq": _log(r, 1, 1024),
                "channels": _log(r, 32, 4096),
            },
        )
    },
    "batch_norm": {
        "nchw": (
            50,
            lambda r: {
                "batch": _pick(r, _BATCH),
                "channels": _log(r, 8, 2048),
                "size": _log(r, 4, 224),
            },
        )
    },
    "pool": {
        "max": (35, _spatial),
        "avg": (25, _spatial),
        "global": (
            20,
            lambda r: {k: v for k, v in _spatial(r).items() if k not in ("kernel", "stride")},
        ),
    },
    "embedding": {
        "gather": (
            50,
            lambda r: {
                "vocab": _log(r, 100, 250000),
                "dim": _log(r, 16, 1024),
                "batch": _pick(r, _BATCH),
                "seq": _log(r, 1, 512),
            },
        )
    },
    "softmax": {
        "last_axis": (
            50,
            lambda r: {"batch": _log(r, 1, 64), "rows": _log(r, 1, 1024), "cols": _log(r, 8, 4096)},
        )
    },
    "elementwise": {
        v: (n, _elementwise_draw)
        for v, n in (("add", 30), ("mul", 25), ("relu", 30), ("gelu", 25), ("sigmoid", 20))
    },
}

OP_ALIASES: dict[str, tuple[str, ...]] = {
    "matmul": ("gemm", "batched_matmul"),
    "linear": ("gemm",),
    "bmm": ("batched_matmul",),
    "gather": ("embedding",),
    "layernorm": ("layer_norm",),
    "batchnorm": ("batch_norm",),
    "rnn": ("lstm", "gru"),
    "norm": ("layer_norm", "batch_norm"),
}


def _fits(s: OpSample, limits: Limits) -> bool:
    return (
        s.flops <= limits.max_flops
        and s.param_bytes <= limits.max_param_bytes
        and all(0 < t.nbytes <= limits.max_tensor_bytes for t in (*s.inputs, *s.outputs))
    )


def _stable_seed(*parts: object) -> int:
    return int(hashlib.sha1(repr(parts).encode()).hexdigest()[:15], 16)


def sweep(
    ops: Sequence[str] | None = None,
    *,
    limits: Limits = Limits(),
    seed: int = 0,
    quick_count: int = 2,
) -> Iterator[OpSample]:
    """The samples of ``ops`` (default: all of `SWEEP`), op by op, variant by variant.

    Each variant draws from its own generator seeded by (seed, op, variant), so the samples of one
    variant do not change when another's count does, and a larger count extends a smaller one.
    With ``limits.per_variant == 0`` (the quick mode), each variant yields ``quick_count``.
    """
    for op in ops or tuple(SWEEP):
        builder = BUILDERS[op]
        for variant, (count, draw) in SWEEP[op].items():
            want = max(1, round(count * limits.per_variant)) if limits.per_variant else quick_count
            rng = np.random.default_rng(_stable_seed(seed, op, variant))
            seen: set[str] = set()
            for _ in range(want * 500):
                if len(seen) >= want:
                    break
                sample = builder(variant, draw(rng))
                if _fits(sample, limits) and sample.sample_id not in seen:
                    seen.add(sample.sample_id)
                    yield sample
