"""Graph neural network examples on a dense adjacency matrix, in plain torch with seeded weights.

Inputs: ``x`` node features ``(batch, N, F)`` float32 and ``adj`` adjacency ``(batch, N, N)``
float32. ``adj`` is read as a weighted graph: the models use ``|adj|``, so a 0/1 adjacency means
what it says and any real tensor (such as the random normal inputs a compile draws) is a valid
graph. The output is per-node logits ``(batch, N, num_classes)``.

- ``gcn``: Kipf & Welling GCN, ``H' = relu(Â H W + b)`` with ``Â = D^-1/2 (|A| + I) D^-1/2``
  computed inside the model; 4 layers, 512 hidden, 7 classes: 1,263,111 parameters.
- ``graphsage``: GraphSAGE with the mean aggregator,
  ``H' = relu(H W_self + mean_N(H) W_neigh + b)``; 4 layers, 512 hidden, 7 classes:
  2,524,679 parameters.

Full-size inputs are Cora-shaped: ``x`` 1x2708x1433, ``adj`` 1x2708x2708. The ``<name>_tiny``
companions use 4 layers of width 32 on ``x`` 1x32x16 and ``adj`` 1x32x32. The weights are
untrained He-normal draws from a seeded generator; dropout is inactive (``eval()`` mode).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from examples._common import build

__all__ = ["gcn", "gcn_tiny", "graphsage", "graphsage_tiny"]


class NormalizeAdjacency(nn.Module):
    """Â = D^-1/2 (|A| + I) D^-1/2 with D the row sums of |A| + I (Kipf & Welling, 2017)."""

    def forward(self, adj: torch.Tensor) -> torch.Tensor:
        n = adj.shape[-1]
        a = adj.abs() + torch.eye(n, dtype=adj.dtype, device=adj.device)
        d = a.sum(dim=-1).rsqrt()  # >= 1 before rsqrt thanks to the self-loop
        return d.unsqueeze(-1) * a * d.unsqueeze(-2)


class GCNConv(nn.Module):
    """One graph convolution ``Â (H W) + b``."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, h: torch.Tensor, adj_norm: torch.Tensor) -> torch.Tensor:
        return torch.matmul(adj_norm, self.linear(h)) + self.bias


class GCN(nn.Module):
    """Stack of `GCNConv` layers with ReLU and dropout in between."""

    def __init__(
        self, *, in_features: int, hidden: int, num_layers: int, num_classes: int, dropout: float
    ) -> None:
        super().__init__()
        dims = [in_features] + [hidden] * (num_layers - 1) + [num_classes]
        self.normalize = NormalizeAdjacency()
        self.convs = nn.ModuleList(GCNConv(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.acts = nn.ModuleList(nn.ReLU() for _ in range(num_layers - 1))
        self.drops = nn.ModuleList(nn.Dropout(dropout) for _ in range(num_layers - 1))

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        a = self.normalize(adj)
        h = x
        for i, conv in enumerate(self.convs):
            h = conv(h, a)
            if i < len(self.acts):
                h = self.drops[i](self.acts[i](h))
        return h


class MeanAggregate(nn.Module):
    """Weighted neighbour mean ``(|A| H) / max(deg, 1)`` (isolated nodes aggregate to 0)."""

    def forward(self, h: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        a = adj.abs()
        deg = a.sum(dim=-1, keepdim=True).clamp(min=1.0)
        return torch.matmul(a, h) / deg


class SAGEConv(nn.Module):
    """GraphSAGE layer with mean aggregation: ``H W_self + mean_N(H) W_neigh + b``."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.aggregate = MeanAggregate()
        self.lin_self = nn.Linear(in_features, out_features)
        self.lin_neigh = nn.Linear(in_features, out_features, bias=False)

    def forward(self, h: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return self.lin_self(h) + self.lin_neigh(self.aggregate(h, adj))


class GraphSAGE(nn.Module):
    """Stack of `SAGEConv` layers with ReLU and dropout in between."""

    def __init__(
        self, *, in_features: int, hidden: int, num_layers: int, num_classes: int, dropout: float
    ) -> None:
        super().__init__()
        dims = [in_features] + [hidden] * (num_layers - 1) + [num_classes]
        self.convs = nn.ModuleList(SAGEConv(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.acts = nn.ModuleList(nn.ReLU() for _ in range(num_layers - 1))
        self.drops = nn.ModuleList(nn.Dropout(dropout) for _ in range(num_layers - 1))

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        h = x
        for i, conv in enumerate(self.convs):
            h = conv(h, adj)
            if i < len(self.acts):
                h = self.drops[i](self.acts[i](h))
        return h


def _init_graph(model: nn.Module) -> None:
    """He-normal weights, zero biases; the SAGE halves share the variance budget of a layer."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            scale = 0.5 if isinstance(model, GraphSAGE) else 1.0
            nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 * scale / m.in_features))
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def _check(num_layers: int) -> None:
    if num_layers < 1:
        raise ValueError(f"num_layers must be at least 1, got {num_layers}")


def gcn(
    *,
    in_features: int = 1433,
    hidden: int = 512,
    num_layers: int = 4,
    num_classes: int = 7,
    dropout: float = 0.5,
    seed: int = 0,
) -> nn.Module:
    """Kipf GCN (1.26M parameters at the defaults); inputs ``x`` 1xNx1433, ``adj`` 1xNxN."""
    _check(num_layers)
    return build(
        lambda: GCN(
            in_features=in_features,
            hidden=hidden,
            num_layers=num_layers,
            num_classes=num_classes,
            dropout=dropout,
        ),
        seed=seed,
        init=_init_graph,
    )


def gcn_tiny() -> nn.Module:
    """4-layer GCN of width 32 (~2.8k parameters); inputs ``x`` 1x32x16, ``adj`` 1x32x32."""
    return gcn(in_features=16, hidden=32, num_layers=4, num_classes=4)


def graphsage(
    *,
    in_features: int = 1433,
    hidden: int = 512,
    num_layers: int = 4,
    num_classes: int = 7,
    dropout: float = 0.5,
    seed: int = 0,
) -> nn.Module:
    """Mean-aggregator GraphSAGE (2.52M parameters at the defaults); ``x`` 1xNx1433, ``adj``
    1xNxN."""
    _check(num_layers)
    return build(
        lambda: GraphSAGE(
            in_features=in_features,
            hidden=hidden,
            num_layers=num_layers,
            num_classes=num_classes,
            dropout=dropout,
        ),
        seed=seed,
        init=_init_graph,
    )


def graphsage_tiny() -> nn.Module:
    """4-layer GraphSAGE of width 32 (~5.5k parameters); inputs ``x`` 1x32x16, ``adj`` 1x32x32."""
    return graphsage(in_features=16, hidden=32, num_layers=4, num_classes=4)
