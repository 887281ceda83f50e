"""Tiny models for the tests, importable as ``tests.models:<factory>`` by ``mopar compile``.

Every factory takes no arguments and returns a seeded module in ``eval()`` mode. The classes live
here (not in conftest.py) so that pickles of them can be loaded again and the CLI can import the
factories from the repository root.

Hand-built modules, each with the input spec it is meant for:

* ``skipnet`` (``x=1x3x8x8:float32``): a residual skip from the stem across the middle
* ``blocknet`` (``x=1x3x8x8:float32``): a residual add inside a container block's forward
* ``twice`` (``x=1x3x8x8:float32``): one ReLU module called twice
* ``conv_only`` (``x=1x3x8x8:float32``): a lone Conv2d(3, 8, 3)
* ``linear_only`` (``x=1x16:float32``): a lone Linear(16, 32)
* ``mlp`` (``x=1x16:float32``): four Linear layers, for --slices limits
* ``branchy`` (``x=1x3x8x8:float32``): ``if x.sum() > 0`` in a submodule (untraceable)
* ``numpy_call`` (``x=1x3x8x8:float32``): ``x.numpy()`` in a submodule (untraceable)
* ``scalar_out`` (``x=1x16:float32``): a 0-d output tensor
* ``relu_rename`` (``x=1x3x8x8:float32``): a slice output whose name the exporter reuses

Third-party transformers (random weights, tiny configs, eager attention), for in-process tests of
the phases: ``bert``, ``gpt2``. The model zoo (examples/zoo.py, tests/test_end_to_end.py) hands many more
architectures over the way users do.
"""

from __future__ import annotations

import torch
from torch import nn

SEED = 0


def _seeded(make):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = make()
    return model.eval()


# --- hand-built modules -------------------------------------------------------------------------


class SkipNet(nn.Module):
    """stem -> act -> mid1 -> mid2 -> (+ stem's activation) -> head.

    Layers (leaf modules): stem, act, mid1, mid2 (which also owns the root's ``add``), head.
    The activation of ``act`` is read again by the add at the end: a skip across the middle.
    """

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.ReLU()
        self.mid1 = nn.Conv2d(8, 8, 3, padding=1)
        self.mid2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.act(self.stem(x))
        b = self.mid2(torch.tanh(self.mid1(a)))
        return self.head(b + a)


class Block(nn.Module):
    """A container whose own forward holds a residual add around two leaf modules."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)
        self.bn = nn.BatchNorm2d(ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)) + x


class BlockNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = Block(8)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)))


class Twice(nn.Module):
    """One ReLU module called twice: two layers, ``relu`` and ``relu#1``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv2(self.relu(self.conv1(x))))


class ConvOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class LinearOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class MLP(nn.Module):
    """Four Linear layers and nothing else: exactly four layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 32)
        self.fc4 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc4(self.fc3(self.fc2(self.fc1(x))))


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x - 1


class Branchy(nn.Module):
    """``stage.gate`` branches on a tensor value: torch.export cannot capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.stage = nn.Module()
        self.stage.gate = DataDependent()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage.gate(self.conv(x))


class ToNumpy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(x.numpy() * 2.0)


class NumpyCall(nn.Module):
    """``bridge`` leaves torch for numpy: torch.export cannot capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.bridge = ToNumpy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bridge(self.conv(x))


class ScalarOut(nn.Module):
    """Returns a 0-d tensor (a mean), as a loss or a score head would."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))).mean()


class Add(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


class ReluRename(nn.Module):
    """Six conv/ReLU steps through one shared ReLU, then a skip into a ``merge`` module.

    FX names the ReLUs ``relu``, ``relu_1``, ... Cut before ``act#2`` and before ``merge``: the
    middle slice then starts with ``relu_2`` (its first ReLU, handed on as the skip) and also
    computes ``relu_4`` internally. Re-tracing that slice on its own numbers its ReLUs from zero,
    so its third ReLU is called ``relu_2`` too.
    """

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(
            [nn.Conv2d(3 if i == 0 else 4, 4, 3, padding=1) for i in range(6)]
        )
        self.act = nn.ReLU()
        self.merge = Add()
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.convs[0](x)
        h = self.convs[1](self.act(h))
        h = self.convs[2](self.act(h))
        skip = self.act(h)
        h = self.convs[3](skip)
        h = self.convs[4](self.act(h))
        h = self.convs[5](self.act(h))
        return self.head(self.merge(h, skip))


class Balloon(nn.Module):
    """Small weights, one big intermediate: 64 x 2^18 float32 (64 MB) while it serves a request,
    so a function holding it needs far more memory serving than idle (an OOM kill mid-request)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 64)
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = self.fc(x).unsqueeze(-1).expand(1, 64, 1 << 18) * 1.5
        return self.out(big.amax(-1))  # exact in any order, unlike a mean


def skipnet() -> nn.Module:
    return _seeded(SkipNet)


def balloon() -> nn.Module:
    return _seeded(Balloon)


def blocknet() -> nn.Module:
    def make() -> nn.Module:
        model = BlockNet()
        # Non-trivial batch-norm statistics, so the block is not an identity-plus-conv.
        model.block.bn.running_mean.uniform_(-0.5, 0.5)
        model.block.bn.running_var.uniform_(0.5, 1.5)
        return model

    return _seeded(make)


def twice() -> nn.Module:
    return _seeded(Twice)


def conv_only() -> nn.Module:
    return _seeded(ConvOnly)


def linear_only() -> nn.Module:
    return _seeded(LinearOnly)


def mlp() -> nn.Module:
    return _seeded(MLP)


def branchy() -> nn.Module:
    return _seeded(Branchy)


def numpy_call() -> nn.Module:
    return _seeded(NumpyCall)


def scalar_out() -> nn.Module:
    return _seeded(ScalarOut)


def relu_rename() -> nn.Module:
    return _seeded(ReluRename)


def not_a_module() -> dict:
    """A factory that returns something other than an nn.Module."""
    return {"weights": torch.zeros(2)}


# --- third-party transformers, from tiny configs ------------------------------------------------

TEXT_INPUTS = ("input_ids=1x16:int64:0..100", "attention_mask=1x16:int64:1..2")


def bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    return _seeded(lambda: BertModel(config))


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(
        vocab_size=100,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
        attn_implementation="eager",
    )
    return _seeded(lambda: GPT2Model(config))
