"""Helpers shared by the example model factories: seeded construction and weight initialisation.

The examples are untrained. Their weights are drawn from a seeded generator with
variance-preserving schemes (He/Kaiming for convolutions and linear layers) so that activations
keep a sensible scale through the whole network and the logits are neither all-zero nor huge:
that keeps numeric comparisons between the eager model and its compiled slices meaningful.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import nn

__all__ = ["seeded", "build", "scaled", "he_init", "param_count"]

M = TypeVar("M", bound=nn.Module)


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU generator for the duration of the block and restore it afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def build(
    make: Callable[[], M], *, seed: int, init: Callable[[nn.Module], None] | None = None
) -> M:
    """Construct ``make()`` (and run ``init`` on it) under `seeded`, then return it in eval mode."""
    with seeded(seed):
        model = make()
        if init is not None:
            init(model)
    return model.eval()


def scaled(channels: int, width: float, *, minimum: int = 8, multiple: int = 1) -> int:
    """``channels * width`` rounded to a multiple of ``multiple`` and at least ``minimum``."""
    if width <= 0:
        raise ValueError(f"width must be positive, got {width}")
    c = max(minimum, int(round(channels * width)))
    return max(multiple, int(round(c / multiple)) * multiple)


def he_init(model: nn.Module) -> None:
    """He-normal (fan-in, ReLU gain) weights and zero biases for every conv and linear layer.

    Batch-norm layers get weight 1, bias 0 and running statistics (0, 1), so in eval mode they
    start as the identity (the residual nets then scale their last batch norm down themselves).
    """
    for m in model.modules():
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Linear)):
            fan_in = m.weight[0].numel()
            nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / fan_in))
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
            m.reset_running_stats()


def param_count(model: nn.Module) -> int:
    """Number of parameters (buffers excluded)."""
    return sum(p.numel() for p in model.parameters())
