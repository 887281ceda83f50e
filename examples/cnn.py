"""Convolutional example models, written in plain torch (no torchvision), with seeded weights.

- ``resnet50``: ResNet-50 v1.5 (stride on the 3x3 of each bottleneck), 25,557,032 parameters,
  input ``x`` 1x3x224x224.
- ``vgg16``: VGG-16 (configuration D, no batch norm), 138,357,544 parameters, ``x`` 1x3x224x224.
- ``inception_v3``: Inception-v3 without the auxiliary head (parallel conv branches concatenated
  in 11 mixed blocks), 23,834,568 parameters, ``x`` 1x3x299x299.
- ``convnext_tiny``: ConvNeXt-T (depths 3-3-9-3, dims 96-768; depthwise 7x7, LayerNorm, MLP,
  layer scale), 28,589,128 parameters, ``x`` 1x3x224x224.

Every factory takes keyword-only size knobs (``width`` scales every channel count) whose
defaults give the full-size model above, plus ``num_classes`` and ``seed``; each has a
``<name>_tiny`` companion (0.1M-0.6M parameters, small input) for fast
tests. All models are returned in ``eval()`` mode and output logits of shape
``(batch, num_classes)``.

The weights are untrained: He-normal draws from a seeded generator. Batch norms start as the
identity (running statistics 0/1); the last batch norm of each residual branch is scaled by
``1/sqrt(number of blocks)`` and ConvNeXt's layer scale starts at 0.1 (the paper's 1e-6 would
make every block a no-op) so that every block changes the output by a visible amount.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from examples._common import build, he_init, scaled

__all__ = [
    "resnet50",
    "resnet50_tiny",
    "vgg16",
    "vgg16_tiny",
    "inception_v3",
    "inception_v3_tiny",
    "convnext_tiny",
    "convnext_tiny_tiny",
]


# --------------------------------------------------------------------------------------------
# ResNet-50
# --------------------------------------------------------------------------------------------


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (strided) -> 1x1 expand, plus an identity or projection shortcut."""

    expansion = 4

    def __init__(self, in_ch: int, mid: int, stride: int) -> None:
        super().__init__()
        out_ch = mid * self.expansion
        self.conv1 = nn.Conv2d(in_ch, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(mid, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.shortcut: nn.Module
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )
        else:
            self.shortcut = nn.Identity()
        self.relu3 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu1(self.bn1(self.conv1(x)))
        y = self.relu2(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu3(y + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet with bottleneck blocks: stem, four stages, global average pool, linear head."""

    def __init__(self, *, layers: Sequence[int], width: float, num_classes: int) -> None:
        super().__init__()
        stem = scaled(64, width)
        self.stem = nn.Sequential(
            nn.Conv2d(3, stem, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(stem),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        in_ch = stem
        stages = []
        for i, n in enumerate(layers):
            mid = scaled(64 * 2**i, width)
            blocks = []
            for j in range(n):
                blocks.append(Bottleneck(in_ch, mid, stride=2 if (i > 0 and j == 0) else 1))
                in_ch = mid * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.flatten(self.pool(x)))


def _init_resnet(model: nn.Module) -> None:
    he_init(model)
    blocks = [m for m in model.modules() if isinstance(m, Bottleneck)]
    for b in blocks:
        nn.init.constant_(b.bn3.weight, 1.0 / math.sqrt(len(blocks)))


def resnet50(
    *,
    width: float = 1.0,
    layers: Sequence[int] = (3, 4, 6, 3),
    num_classes: int = 1000,
    seed: int = 0,
) -> nn.Module:
    """ResNet-50 (25.6M parameters at the defaults); input ``x`` 1x3x224x224."""
    if len(layers) != 4:
        raise ValueError(f"layers must give the block count of 4 stages, got {tuple(layers)}")
    return build(
        lambda: ResNet(layers=layers, width=width, num_classes=num_classes),
        seed=seed,
        init=_init_resnet,
    )


def resnet50_tiny() -> nn.Module:
    """ResNet-50 at width 1/8 with one block per stage (~0.13M parameters); input 1x3x64x64."""
    return resnet50(width=0.125, layers=(1, 1, 1, 1), num_classes=10)


# --------------------------------------------------------------------------------------------
# VGG-16
# --------------------------------------------------------------------------------------------

_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG(nn.Module):
    """Plain conv/ReLU stack with max pools, then a three-layer MLP classifier."""

    def __init__(
        self, *, width: float, hidden: int, pool_size: int, num_classes: int, batch_norm: bool
    ) -> None:
        super().__init__()
        feats: list[nn.Module] = []
        in_ch = 3
        for v in _VGG16:
            if v == "M":
                feats.append(nn.MaxPool2d(2, stride=2))
                continue
            out_ch = scaled(int(v), width)
            feats.append(nn.Conv2d(in_ch, out_ch, 3, padding=1))
            if batch_norm:
                feats.append(nn.BatchNorm2d(out_ch))
            feats.append(nn.ReLU())
            in_ch = out_ch
        self.features = nn.Sequential(*feats)
        self.pool = nn.AdaptiveAvgPool2d(pool_size)
        self.flatten = nn.Flatten(1)
        self.classifier = nn.Sequential(
            nn.Linear(in_ch * pool_size * pool_size, hidden),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.flatten(self.pool(self.features(x))))


def vgg16(
    *,
    width: float = 1.0,
    hidden: int = 4096,
    pool_size: int = 7,
    batch_norm: bool = False,
    num_classes: int = 1000,
    seed: int = 0,
) -> nn.Module:
    """VGG-16 (138.4M parameters at the defaults); input ``x`` 1x3x224x224.

    ``pool_size`` is the side of the adaptive average pool before the classifier; keep it equal
    to input side / 32 (7 for 224) so that the pool is the identity.
    """
    return build(
        lambda: VGG(
            width=width,
            hidden=hidden,
            pool_size=pool_size,
            num_classes=num_classes,
            batch_norm=batch_norm,
        ),
        seed=seed,
        init=he_init,
    )


def vgg16_tiny() -> nn.Module:
    """VGG-16 at width 1/8 with a 128-wide classifier (~0.28M parameters); input 1x3x64x64."""
    return vgg16(width=0.125, hidden=128, pool_size=2, num_classes=10)


# --------------------------------------------------------------------------------------------
# Inception-v3
# --------------------------------------------------------------------------------------------


class ConvBN(nn.Module):
    """Convolution (no bias) -> batch norm (eps 1e-3) -> ReLU, the Inception building block."""

    def __init__(self, in_ch: int, out_ch: int, kernel, stride=1, padding=0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(out_ch, eps=1e-3)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


class InceptionA(nn.Module):
    """35x35 block: 1x1 | 1x1->5x5 | 1x1->3x3->3x3 | avgpool->1x1, concatenated."""

    def __init__(self, in_ch: int, pool_ch: int, w: float) -> None:
        super().__init__()
        c = lambda n: scaled(n, w)  # noqa: E731
        self.b1 = ConvBN(in_ch, c(64), 1)
        self.b5 = nn.Sequential(ConvBN(in_ch, c(48), 1), ConvBN(c(48), c(64), 5, padding=2))
        self.b3 = nn.Sequential(
            ConvBN(in_ch, c(64), 1),
            ConvBN(c(64), c(96), 3, padding=1),
            ConvBN(c(96), c(96), 3, padding=1),
        )
        self.bp = nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1), ConvBN(in_ch, pool_ch, 1))
        self.out_ch = c(64) + c(64) + c(96) + pool_ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b5(x), self.b3(x), self.bp(x)], dim=1)


class InceptionB(nn.Module):
    """35->17 grid reduction: strided 3x3 | 1x1->3x3->strided 3x3 | max pool, concatenated."""

    def __init__(self, in_ch: int, w: float) -> None:
        super().__init__()
        c = lambda n: scaled(n, w)  # noqa: E731
        self.b3 = ConvBN(in_ch, c(384), 3, stride=2)
        self.b3dbl = nn.Sequential(
            ConvBN(in_ch, c(64), 1),
            ConvBN(c(64), c(96), 3, padding=1),
            ConvBN(c(96), c(96), 3, stride=2),
        )
        self.bp = nn.MaxPool2d(3, stride=2)
        self.out_ch = c(384) + c(96) + in_ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b3(x), self.b3dbl(x), self.bp(x)], dim=1)


class InceptionC(nn.Module):
    """17x17 block with factorised 7x7 convolutions (1x7 and 7x1)."""

    def __init__(self, in_ch: int, c7: int, w: float) -> None:
        super().__init__()
        c = lambda n: scaled(n, w)  # noqa: E731
        m = c(c7)
        self.b1 = ConvBN(in_ch, c(192), 1)
        self.b7 = nn.Sequential(
            ConvBN(in_ch, m, 1),
            ConvBN(m, m, (1, 7), padding=(0, 3)),
            ConvBN(m, c(192), (7, 1), padding=(3, 0)),
        )
        self.b7dbl = nn.Sequential(
            ConvBN(in_ch, m, 1),
            ConvBN(m, m, (7, 1), padding=(3, 0)),
            ConvBN(m, m, (1, 7), padding=(0, 3)),
            ConvBN(m, m, (7, 1), padding=(3, 0)),
            ConvBN(m, c(192), (1, 7), padding=(0, 3)),
        )
        self.bp = nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1), ConvBN(in_ch, c(192), 1))
        self.out_ch = 4 * c(192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b7(x), self.b7dbl(x), self.bp(x)], dim=1)


class InceptionD(nn.Module):
    """17->8 grid reduction: 1x1->strided 3x3 | 1x1->1x7->7x1->strided 3x3 | max pool."""

    def __init__(self, in_ch: int, w: float) -> None:
        super().__init__()
        c = lambda n: scaled(n, w)  # noqa: E731
        self.b3 = nn.Sequential(ConvBN(in_ch, c(192), 1), ConvBN(c(192), c(320), 3, stride=2))
        self.b7x3 = nn.Sequential(
            ConvBN(in_ch, c(192), 1),
            ConvBN(c(192), c(192), (1, 7), padding=(0, 3)),
            ConvBN(c(192), c(192), (7, 1), padding=(3, 0)),
            ConvBN(c(192), c(192), 3, stride=2),
        )
        self.bp = nn.MaxPool2d(3, stride=2)
        self.out_ch = c(320) + c(192) + in_ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b3(x), self.b7x3(x), self.bp(x)], dim=1)


class InceptionE(nn.Module):
    """8x8 block whose 3x3 branches fan out into parallel 1x3 and 3x1 convolutions."""

    def __init__(self, in_ch: int, w: float) -> None:
        super().__init__()
        c = lambda n: scaled(n, w)  # noqa: E731
        self.b1 = ConvBN(in_ch, c(320), 1)
        self.b3_in = ConvBN(in_ch, c(384), 1)
        self.b3_a = ConvBN(c(384), c(384), (1, 3), padding=(0, 1))
        self.b3_b = ConvBN(c(384), c(384), (3, 1), padding=(1, 0))
        self.bd_in = nn.Sequential(ConvBN(in_ch, c(448), 1), ConvBN(c(448), c(384), 3, padding=1))
        self.bd_a = ConvBN(c(384), c(384), (1, 3), padding=(0, 1))
        self.bd_b = ConvBN(c(384), c(384), (3, 1), padding=(1, 0))
        self.bp = nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1), ConvBN(in_ch, c(192), 1))
        self.out_ch = c(320) + 4 * c(384) + c(192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.b3_in(x)
        d = self.bd_in(x)
        return torch.cat(
            [self.b1(x), self.b3_a(t), self.b3_b(t), self.bd_a(d), self.bd_b(d), self.bp(x)],
            dim=1,
        )


class InceptionV3(nn.Module):
    """Stem, ``a`` 35x35 blocks, reduction, ``c`` 17x17 blocks, reduction, ``e`` 8x8 blocks."""

    def __init__(self, *, blocks: Sequence[int], width: float, num_classes: int) -> None:
        super().__init__()
        n_a, n_c, n_e = blocks
        c = lambda n: scaled(n, width)  # noqa: E731
        self.stem = nn.Sequential(
            ConvBN(3, c(32), 3, stride=2),
            ConvBN(c(32), c(32), 3),
            ConvBN(c(32), c(64), 3, padding=1),
            nn.MaxPool2d(3, stride=2),
            ConvBN(c(64), c(80), 1),
            ConvBN(c(80), c(192), 3),
            nn.MaxPool2d(3, stride=2),
        )
        layers: list[nn.Module] = []
        in_ch = c(192)
        for i in range(n_a):  # Mixed_5b..5d: pool branch 32 wide in the first block, then 64
            layers.append(InceptionA(in_ch, c(32 if i == 0 else 64), width))
            in_ch = layers[-1].out_ch
        layers.append(InceptionB(in_ch, width))  # Mixed_6a
        in_ch = layers[-1].out_ch
        for i in range(n_c):  # Mixed_6b..6e: 7x7 branch width 128, 160, 160, 192
            c7 = 128 if i == 0 else (192 if i == n_c - 1 else 160)
            layers.append(InceptionC(in_ch, c7, width))
            in_ch = layers[-1].out_ch
        layers.append(InceptionD(in_ch, width))  # Mixed_7a
        in_ch = layers[-1].out_ch
        for _ in range(n_e):  # Mixed_7b, 7c
            layers.append(InceptionE(in_ch, width))
            in_ch = layers[-1].out_ch
        self.mixed = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(0.5)
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mixed(self.stem(x))
        return self.fc(self.flatten(self.dropout(self.pool(x))))


def inception_v3(
    *,
    width: float = 1.0,
    blocks: Sequence[int] = (3, 4, 2),
    num_classes: int = 1000,
    seed: int = 0,
) -> nn.Module:
    """Inception-v3 (23.8M parameters at the defaults); input ``x`` 1x3x299x299.

    ``blocks`` counts the 35x35 (A), 17x17 (C) and 8x8 (E) blocks; the two grid reductions are
    always there. Any input side of at least 75 works.
    """
    if len(blocks) != 3:
        raise ValueError(f"blocks must give the A, C and E block counts, got {tuple(blocks)}")
    return build(
        lambda: InceptionV3(blocks=blocks, width=width, num_classes=num_classes),
        seed=seed,
        init=he_init,
    )


def inception_v3_tiny() -> nn.Module:
    """Inception-v3 at width 1/8 with one A, C and E block (~0.16M parameters); input 1x3x96x96."""
    return inception_v3(width=0.125, blocks=(1, 1, 1), num_classes=10)


# --------------------------------------------------------------------------------------------
# ConvNeXt-T
# --------------------------------------------------------------------------------------------


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channel axis of an NCHW tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7 -> LayerNorm -> Linear 4x -> GELU -> Linear -> layer scale, plus residual."""

    def __init__(self, dim: int, layer_scale_init: float) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), float(layer_scale_init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)  # NCHW -> NHWC
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    """Patchify stem (4x4/4), four stages separated by LayerNorm + 2x2/2 downsampling convs."""

    def __init__(
        self, *, depths: Sequence[int], width: float, num_classes: int, layer_scale_init: float
    ) -> None:
        super().__init__()
        dims = [scaled(d, width) for d in (96, 192, 384, 768)]
        self.stem = nn.Sequential(
            nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0], eps=1e-6)
        )
        stages = []
        for i, depth in enumerate(depths):
            mods: list[nn.Module] = []
            if i > 0:
                mods += [LayerNorm2d(dims[i - 1], eps=1e-6), nn.Conv2d(dims[i - 1], dims[i], 2, 2)]
            mods += [ConvNeXtBlock(dims[i], layer_scale_init) for _ in range(depth)]
            stages.append(nn.Sequential(*mods))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = nn.Linear(dims[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(self.norm(self.flatten(self.pool(x))))


def convnext_tiny(
    *,
    width: float = 1.0,
    depths: Sequence[int] = (3, 3, 9, 3),
    layer_scale_init: float = 0.1,
    num_classes: int = 1000,
    seed: int = 0,
) -> nn.Module:
    """ConvNeXt-T (28.6M parameters at the defaults); input ``x`` 1x3x224x224."""
    if len(depths) != 4:
        raise ValueError(f"depths must give the block count of 4 stages, got {tuple(depths)}")
    return build(
        lambda: ConvNeXt(
            depths=depths, width=width, num_classes=num_classes, layer_scale_init=layer_scale_init
        ),
        seed=seed,
        init=he_init,
    )


def convnext_tiny_tiny() -> nn.Module:
    """ConvNeXt-T at width 1/4 with depths 1-1-2-1 (~0.59M parameters); input 1x3x64x64."""
    return convnext_tiny(width=0.25, depths=(1, 1, 2, 1), num_classes=10)
