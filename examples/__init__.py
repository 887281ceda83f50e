"""Example models for mopar: the paper's four model families, in plain torch with seeded weights.

Importing this package imports nothing heavy: `EXAMPLES` names each model's factory as a
``"module:function"`` string (the form ``mopar compile`` takes) together with the input specs to
compile it with. Every factory returns an untrained, seeded, deterministic module in ``eval()``
mode; the full-size factories take keyword-only size knobs, and each has a zero-argument
``<name>_tiny`` companion small enough for fast tests.

==========  ================================================  =============================
family      models                                            module
==========  ================================================  =============================
cnn         resnet50, vgg16, inception_v3, convnext_tiny      `examples.cnn`
rnn         lstm_cnn, gru_cnn (CRNN: conv stack -> BiLSTM/GRU)  `examples.rnn`
gcn         gcn (Kipf), graphsage (mean aggregator)           `examples.gcn`
transformer bert_mini, bert_small, distilbert, bert (HF,   `examples.transformer`
            random init)
==========  ================================================  =============================

`examples.zoo` is the model zoo: third-party architectures (``transformers`` models from tiny
configs, real-weight EfficientNet-Lite0 and MiniLM) each handed to mopar as a user would, as a
.pt2, TorchScript or factory; ``python -m examples.zoo --doc docs/models.md`` measures them all.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Example", "EXAMPLES"]


@dataclass(frozen=True, kw_only=True)
class Example:
    """One example model.

    Attributes:
        name: registry key, e.g. ``"resnet50"``.
        family: ``"cnn"``, ``"rnn"``, ``"gcn"`` or ``"transformer"``.
        factory: ``"module:function"`` of the full-size model, e.g. ``"examples.cnn:resnet50"``.
        tiny_factory: ``"module:function"`` of the small test variant.
        inputs: ``--input`` specs (``NAME=DIMxDIM:DTYPE[:LOW..HIGH]``) for the full-size model.
        tiny_inputs: ``--input`` specs for the tiny variant.
    """

    name: str
    family: str
    factory: str
    tiny_factory: str
    inputs: tuple[str, ...]
    tiny_inputs: tuple[str, ...]


def _ex(name: str, family: str, inputs: tuple[str, ...], tiny_inputs: tuple[str, ...]) -> Example:
    module = f"examples.{family}"
    return Example(
        name=name,
        family=family,
        factory=f"{module}:{name}",
        tiny_factory=f"{module}:{name}_tiny",
        inputs=inputs,
        tiny_inputs=tiny_inputs,
    )


_TEXT = ("input_ids=1x128:int64:0..30000", "attention_mask=1x128:int64:1..2")
_TEXT_TINY = ("input_ids=1x128:int64:0..1000", "attention_mask=1x128:int64:1..2")

EXAMPLES: dict[str, Example] = {
    e.name: e
    for e in (
        _ex("resnet50", "cnn", ("x=1x3x224x224:float32",), ("x=1x3x64x64:float32",)),
        _ex("vgg16", "cnn", ("x=1x3x224x224:float32",), ("x=1x3x64x64:float32",)),
        _ex("inception_v3", "cnn", ("x=1x3x299x299:float32",), ("x=1x3x96x96:float32",)),
        _ex("convnext_tiny", "cnn", ("x=1x3x224x224:float32",), ("x=1x3x64x64:float32",)),
        _ex("lstm_cnn", "rnn", ("x=1x1x32x128:float32",), ("x=1x1x32x64:float32",)),
        _ex("gru_cnn", "rnn", ("x=1x1x32x128:float32",), ("x=1x1x32x64:float32",)),
        _ex(
            "gcn",
            "gcn",
            ("x=1x2708x1433:float32", "adj=1x2708x2708:float32"),
            ("x=1x32x16:float32", "adj=1x32x32:float32"),
        ),
        _ex(
            "graphsage",
            "gcn",
            ("x=1x2708x1433:float32", "adj=1x2708x2708:float32"),
            ("x=1x32x16:float32", "adj=1x32x32:float32"),
        ),
        _ex("bert", "transformer", _TEXT, _TEXT_TINY),
        _ex("distilbert", "transformer", _TEXT, _TEXT_TINY),
        _ex("bert_mini", "transformer", _TEXT, _TEXT_TINY),
        _ex("bert_small", "transformer", _TEXT, _TEXT_TINY),
    )
}
