"""Recurrent example models: CRNN-style text-line recognisers, in plain torch with seeded weights.

A CNN (the CRNN conv stack: seven 3x3/2x2 convolutions, four max pools that halve the height
four times but the width only twice) turns a ``1x1x32xW`` grey image into a ``512 x W/4`` feature
map; its width axis is read as a sequence by a two-layer bidirectional recurrent net
(``nn.LSTM`` or ``nn.GRU``, ``batch_first``), and a linear head scores every time step
(``num_classes=37``: 26 letters, 10 digits and the CTC blank). The output is logits of shape
``(batch, W/4 - 1, num_classes)``.

=============  =============================  ==========  ===============
factory        recurrent part                 parameters  input ``x``
=============  =============================  ==========  ===============
``lstm_cnn``   2-layer BiLSTM, 256 per side    8,722,981  1x1x32x128
``gru_cnn``    2-layer BiGRU, 256 per side     7,934,501  1x1x32x128
=============  =============================  ==========  ===============

Each has a ``<name>_tiny`` companion (width 1/8, 32-wide recurrence, input 1x1x32x64; ~0.13M
parameters).
The weights are untrained: He-normal convolutions and PyTorch's default recurrent init, drawn
from a seeded generator. Models are returned in ``eval()`` mode.
"""

from __future__ import annotations

import torch
from torch import nn

from examples._common import build, he_init, scaled

__all__ = ["lstm_cnn", "lstm_cnn_tiny", "gru_cnn", "gru_cnn_tiny"]


def _conv(in_ch: int, out_ch: int, kernel: int, padding: int, bn: bool) -> list[nn.Module]:
    mods: list[nn.Module] = [nn.Conv2d(in_ch, out_ch, kernel, padding=padding, bias=not bn)]
    if bn:
        mods.append(nn.BatchNorm2d(out_ch))
    mods.append(nn.ReLU())
    return mods


class CRNN(nn.Module):
    """Conv feature extractor -> (batch, width, channels) sequence -> RNN -> per-step classifier."""

    def __init__(
        self,
        *,
        cell: str,
        in_channels: int,
        width: float,
        hidden: int,
        num_layers: int,
        bidirectional: bool,
        num_classes: int,
    ) -> None:
        super().__init__()
        c = [scaled(n, width) for n in (64, 128, 256, 256, 512, 512, 512)]
        self.features = nn.Sequential(
            *_conv(in_channels, c[0], 3, 1, bn=False),
            nn.MaxPool2d(2, 2),  # H/2, W/2
            *_conv(c[0], c[1], 3, 1, bn=False),
            nn.MaxPool2d(2, 2),  # H/4, W/4
            *_conv(c[1], c[2], 3, 1, bn=True),
            *_conv(c[2], c[3], 3, 1, bn=False),
            nn.MaxPool2d((2, 1), (2, 1)),  # H/8
            *_conv(c[3], c[4], 3, 1, bn=True),
            *_conv(c[4], c[5], 3, 1, bn=False),
            nn.MaxPool2d((2, 1), (2, 1)),  # H/16
            *_conv(c[5], c[6], 2, 0, bn=True),  # H/16 - 1, W/4 - 1
        )
        rnn_cls = {"lstm": nn.LSTM, "gru": nn.GRU}[cell]
        self.rnn = rnn_cls(
            c[6], hidden, num_layers=num_layers, batch_first=True, bidirectional=bidirectional
        )
        self.classifier = nn.Linear(hidden * (2 if bidirectional else 1), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.features(x)  # (B, C, H', T)
        seq = f.mean(dim=2).permute(0, 2, 1)  # (B, T, C): the width axis is the sequence
        out, _ = self.rnn(seq)
        return self.classifier(out)  # (B, T, num_classes)


def _crnn(
    cell: str,
    *,
    width: float,
    hidden: int,
    num_layers: int,
    bidirectional: bool,
    in_channels: int,
    num_classes: int,
    seed: int,
) -> nn.Module:
    return build(
        lambda: CRNN(
            cell=cell,
            in_channels=in_channels,
            width=width,
            hidden=hidden,
            num_layers=num_layers,
            bidirectional=bidirectional,
            num_classes=num_classes,
        ),
        seed=seed,
        init=he_init,  # conv/linear only: the RNN keeps PyTorch's default (seeded) init
    )


def lstm_cnn(
    *,
    width: float = 1.0,
    hidden: int = 256,
    num_layers: int = 2,
    bidirectional: bool = True,
    in_channels: int = 1,
    num_classes: int = 37,
    seed: int = 0,
) -> nn.Module:
    """CRNN with a BiLSTM (8.7M parameters at the defaults); input ``x`` 1x1x32x128."""
    return _crnn(
        "lstm",
        width=width,
        hidden=hidden,
        num_layers=num_layers,
        bidirectional=bidirectional,
        in_channels=in_channels,
        num_classes=num_classes,
        seed=seed,
    )


def lstm_cnn_tiny() -> nn.Module:
    """CRNN-LSTM at width 1/8 with a 32-wide 2-layer BiLSTM (~0.14M parameters); x 1x1x32x64."""
    return lstm_cnn(width=0.125, hidden=32)


def gru_cnn(
    *,
    width: float = 1.0,
    hidden: int = 256,
    num_layers: int = 2,
    bidirectional: bool = True,
    in_channels: int = 1,
    num_classes: int = 37,
    seed: int = 0,
) -> nn.Module:
    """CRNN with a BiGRU (7.9M parameters at the defaults); input ``x`` 1x1x32x128."""
    return _crnn(
        "gru",
        width=width,
        hidden=hidden,
        num_layers=num_layers,
        bidirectional=bidirectional,
        in_channels=in_channels,
        num_classes=num_classes,
        seed=seed,
    )


def gru_cnn_tiny() -> nn.Module:
    """CRNN-GRU at width 1/8 with a 32-wide 2-layer BiGRU (~0.13M parameters); x 1x1x32x64."""
    return gru_cnn(width=0.125, hidden=32)
