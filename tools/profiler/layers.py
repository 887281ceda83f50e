"""The layers of the `examples` models as profiler samples: one ONNX model per layer.

`model_layers` captures an example, splits it with a plan of one slice per layer (the rewrite
that compiling uses), and runs the slices in torch once, so every layer has real inputs. Each
`LayerSample` then exports its layer on demand (`LayerSample.export`): exporting is the slow part,
about 2 s a layer, so layers that compute the same thing on the same shapes (the twelve encoder
layers of BERT) share one export, keyed by a structural `signature` of their graph.

Features come from `mopar.profile.features.layer_features`, the function the planner applies to
a user's model, so that the features of a measured layer and of a predicted one are alike.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["LayerSample", "ModelLayers", "model_layers", "export", "signature", "model_key"]

_SAMPLE_FORMAT = 1  # part of every layer sample id


def model_key(factory: str, inputs: tuple[str, ...]) -> str:
    """The ``config`` column of a model's layer rows: its factory and input specs, as JSON."""
    return json.dumps({"factory": factory, "inputs": list(inputs)}, sort_keys=True)


@dataclass(frozen=True, kw_only=True)
class LayerSample:
    """One layer of an example model.

    Attributes:
        sample_id: stable id from the model, its inputs and the layer's name and position.
        model: the example's name (``resnet50``).
        model_family: the example's family (``cnn``).
        config: `model_key` of the model.
        layer: the layer's name.
        layer_index: its position in topological order.
        model_layers: layers in the model.
        features: `mopar.profile.features.layer_features` of the layer.
        signature: structural hash; layers with equal signatures share an export.
        inputs: the slice's input tensors as arrays, by ONNX input name.
    """

    sample_id: str
    model: str
    model_family: str
    config: str
    layer: str
    layer_index: int
    model_layers: int
    features: dict[str, Any]
    signature: str
    inputs: dict[str, np.ndarray] = field(repr=False)
    _slice: Any = field(repr=False)
    _values: Any = field(repr=False)


@dataclass(frozen=True, kw_only=True)
class ModelLayers:
    """The layers of one example model, ready to export and measure."""

    model: str
    config: str
    layers: tuple[LayerSample, ...]


def model_layers(name: str, *, tiny: bool) -> ModelLayers:
    """Capture example ``name`` (its ``_tiny`` variant if ``tiny``) and list its layers.

    Raises:
        KeyError: ``name`` is not in `examples.EXAMPLES`.
    """
    from examples import EXAMPLES
    from mopar import api
    from mopar.emit.onnx_export import run_slices_torch
    from mopar.plan import Function, Plan
    from mopar.profile.features import layer_features
    from mopar.rewrite import split_by_plan

    ex = EXAMPLES[name]
    factory, specs = (ex.tiny_factory, ex.tiny_inputs) if tiny else (ex.factory, ex.inputs)
    analysis = api.analyze(factory, list(specs))
    lg = analysis.layers
    plan = Plan(
        model=name,
        strategy="one-slice-per-layer",
        memory_source="none",
        functions=tuple(
            Function(name=f"l{i}", layers=(lay.name,), memory_mb=0)
            for i, lay in enumerate(lg.layers)
        ),
    )
    slices = split_by_plan(lg, plan)
    values = run_slices_torch(slices, analysis.captured.inputs)
    config = model_key(factory, tuple(specs))
    samples = []
    for lay, s in zip(lg.layers, slices):
        key = json.dumps(
            {"v": _SAMPLE_FORMAT, "model": config, "layer": lay.name, "index": lay.index},
            sort_keys=True,
        )
        samples.append(
            LayerSample(
                sample_id=hashlib.sha1(key.encode()).hexdigest()[:16],
                model=name,
                model_family=ex.family,
                config=config,
                layer=lay.name,
                layer_index=lay.index,
                model_layers=len(lg.layers),
                features=layer_features(lay, lg),
                signature=signature(s),
                inputs={t.name: values[t.name].contiguous().numpy() for t in s.inputs},
                _slice=s,
                _values=values,
            )
        )
    return ModelLayers(model=name, config=config, layers=tuple(samples))


def export(sample: LayerSample, path: Path) -> tuple[str, ...]:
    """Export the layer to ``path`` (checked); return its distinct ONNX op types, in graph order."""
    import onnx

    from mopar.emit.onnx_export import try_export_slice

    failure = try_export_slice(sample._slice, sample._values, path, opset=None)
    if failure is not None:
        raise RuntimeError(f"layer {failure.slice} does not export: {failure.reason[:300]}")
    model = onnx.load(str(path))
    return tuple(dict.fromkeys(n.op_type for n in model.graph.node))


def signature(s: Any) -> str:
    """A hash of a slice's structure: ops, their wiring, and every tensor's shape and dtype.

    Two slices with equal signatures export to the same ONNX graph up to names and weight values,
    so they cost the same to run.
    """
    import torch
    from torch import fx

    def shape(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), str(v.dtype))
        if isinstance(v, (list, tuple)):
            return tuple(shape(x) for x in v)
        return repr(v) if isinstance(v, (int, float, bool, str, type(None))) else type(v).__name__

    index: dict[fx.Node, int] = {}
    parts: list[Any] = []
    for i, node in enumerate(s.gm.graph.nodes):
        index[node] = i
        if node.op == "get_attr":
            obj: Any = s.gm
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
            parts.append(("attr", shape(obj)))
        elif node.op == "placeholder":
            parts.append(("input", shape(node.meta.get("val"))))
        else:
            args = fx.node.map_arg((node.args, node.kwargs), lambda a: ("node", index[a]))
            parts.append((node.op, str(node.target), shape(node.meta.get("val")), repr(args)))
    return hashlib.sha1(repr(parts).encode()).hexdigest()
