"""16-bit floating types: a bfloat16 or float16 model computes in float32, its weights kept.

numpy has no bfloat16, and onnxruntime's CPU provider has next to no bfloat16 kernels (no
MatMul); for the float16 operators it has no kernel for, it casts the weights to float32 copies
itself, at load (a 542M Llama in float16 held 2,085 MB for 1,034 MB of weights). A bfloat16 or
float16 model is therefore rewritten once, at capture (`float32_compute`):

* every weight stays in its type, two bytes a parameter, and is cast to float32 right before
  the operator that computes with it; an embedding table's rows are cast after the lookup;
* every tensor it computes, hands across a cut or returns is float32, and a 16-bit input is
  taken as float32.

onnxruntime would fold those casts into float32 copies of the weights at load; the function's
session turns that folding off and runs each cast just before its user, so that one layer's
float32 copy is live at a time (`mopar.emit.session`). The price is the casts' time, which the
plan's notes give as measured (docs/exportable.md, "float16 and bfloat16").

The reference stays the model's own output, computed in bfloat16 and widened to float32
(`to_numpy`); the check's tolerance follows that output's dtype (`mopar.config.Tolerance`).
Other types numpy lacks (the ``float8`` types) are refused (`check_dtypes`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from mopar.config import Tolerance
from mopar.errors import CaptureError

__all__ = [
    "CARRIED",
    "Widening",
    "check_dtypes",
    "default_tolerance",
    "dtype_name",
    "float32_compute",
    "numpy_dtype",
    "rounded_in",
    "to_numpy",
    "to_program",
]

CARRIED = {torch.bfloat16: torch.float32, torch.float16: torch.float32}
"""The type a tensor of each type numpy lacks is computed in and handed over in."""

_EMBEDDING = torch.ops.aten.embedding.default


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``."""
    return str(dtype).removeprefix("torch.")


def check_dtypes(ep: torch.export.ExportedProgram) -> None:
    """Refuse a program with a tensor that numpy cannot hold and mopar does not compute in a
    wider type (the ``float8`` types); bfloat16 passes (`CARRIED`).

    Raises:
        CaptureError: naming the input, weight or value, and the fix.
    """
    sig = ep.graph_signature
    kinds = {
        **{k: f"input {k}" for k in sig.user_inputs},
        **{k: f"parameter {v}" for k, v in sig.inputs_to_parameters.items()},
        **{k: f"buffer {v}" for k, v in sig.inputs_to_buffers.items()},
    }
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and not _numpy_holds(val.dtype):
            if val.dtype in CARRIED:
                continue
            what = kinds.get(node.name, f"value {node.name}")
            raise CaptureError(
                f"the model's {what} is {dtype_name(val.dtype)}, which mopar cannot run: numpy "
                "has no such type and onnxruntime no CPU kernels for it. Fix: cast the model "
                "with .bfloat16(), .half() or .float() before handing it over"
            )


@functools.cache
def _numpy_holds(dtype: torch.dtype) -> bool:
    try:
        torch.empty(0, dtype=dtype).numpy()
    except TypeError:
        return False
    return True


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy type a tensor of ``dtype`` is handed over in (float32 for bfloat16)."""
    return torch.empty(0, dtype=CARRIED.get(dtype, dtype)).numpy().dtype


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` as numpy; a bfloat16 one widened to float32, exactly (every bfloat16 value
    is a float32 value)."""
    tensor = tensor.detach()
    if tensor.dtype in CARRIED:
        tensor = tensor.to(CARRIED[tensor.dtype])
    return tensor.numpy()


def to_program(gm: fx.GraphModule, flat_inputs: list[np.ndarray]) -> list[torch.Tensor]:
    """``flat_inputs`` as tensors of the types ``gm``'s placeholders were traced with: a
    float32 array given for a bfloat16 input is rounded to bfloat16, as the model takes it."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tensors = []
    for node, array in zip(placeholders, flat_inputs, strict=True):
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype in CARRIED:
            tensor = tensor.to(val.dtype)
        tensors.append(tensor)
    return tensors


@dataclass(frozen=True, kw_only=True)
class Widening:
    """What `float32_compute` changed.

    Attributes:
        dtype: the type computed in float32 (``bfloat16``), or "" where nothing was.
        cast_bytes: bytes of the weights held in ``dtype`` and cast to float32 where used.
        kept_bytes: bytes of the embedding tables (rows cast after the lookup).
        inputs: the inputs now taken as float32.
    """

    dtype: str = ""
    cast_bytes: int = 0
    kept_bytes: int = 0
    inputs: tuple[str, ...] = ()

    @property
    def note(self) -> str:
        """The plan's note: what is computed in float32, and what is held in ``dtype``."""
        if not self.dtype:
            return ""
        parts = [
            f"{_mb(self.cast_bytes)} of weights stay {self.dtype} and are cast to float32 "
            f"where they are computed with (not {_mb(2 * self.cast_bytes)} of float32)"
            if self.cast_bytes
            else "",
            f"{_mb(self.kept_bytes)} of embedding tables stay {self.dtype} (a lookup casts "
            "only its rows)"
            if self.kept_bytes
            else "",
            f"inputs {', '.join(self.inputs)} are taken as float32" if self.inputs else "",
            "outputs and the tensors handed between functions are float32",
        ]
        return (
            f"{self.dtype} model computed in float32 (onnxruntime's CPU provider computes "
            f"{self.dtype} in float32): {'; '.join(p for p in parts if p)}"
        )


def _mb(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.3g} MB" if nbytes >= 1 << 17 else f"{nbytes / 1024:.3g} KB"


def float32_compute(gm: fx.GraphModule) -> tuple[fx.GraphModule, Widening]:
    """``gm`` computing in float32 where it computed in a type of `CARRIED`: each weight of
    that type kept, and cast to float32 before each user (an embedding's rows after the lookup),
    each input of that type taken as float32, and each operator asked for that type (a
    ``.to(torch.bfloat16)``, a ``torch.full(..., dtype=torch.bfloat16)``) given float32.

    Returns ``gm`` itself where it has none; else a new module, with ``gm`` untouched (it
    still computes the model's own output) and each node's ``val`` of the type it now has.
    """
    dtype = _lowered(gm)
    if dtype is None:
        return gm, Widening()
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    out = fx.GraphModule(gm, graph)  # new owner modules; the weights are gm's, not copies
    cast = kept = 0
    lookups: set[fx.Node] = set()
    for node in list(graph.nodes):
        value = _attr(out, node.target) if node.op == "get_attr" else None
        if isinstance(value, fx.GraphModule):  # a higher-order operator's body
            body, inner = float32_compute(value)
            _set_attr(out, str(node.target), body)
            cast, kept = cast + inner.cast_bytes, kept + inner.kept_bytes
        elif _is_lowered(value):
            found = _keep_tables(graph, node)
            lookups.update(found)
            kept += value.nbytes if found else 0
            if len(found) < len(node.users):
                cast += value.nbytes
                _cast_at_use(graph, node)
        elif node.op != "get_attr" and node not in lookups:
            node.args, node.kwargs = pytree.tree_map(_widened, (node.args, node.kwargs))
            node.meta["val"] = pytree.tree_map(_widened_val, node.meta.get("val"))
            node.target = _float32_kernel(node)
    out.recompile()
    inputs = tuple(
        n.name for n in gm.graph.nodes if n.op == "placeholder" and _is_lowered(n.meta.get("val"))
    )
    return out, Widening(dtype=dtype_name(dtype), cast_bytes=cast, kept_bytes=kept, inputs=inputs)


def _float32_kernel(node: fx.Node) -> Any:
    """The operator ``node`` computes with in float32: transformers' own grouped matmul where
    a bfloat16 mixture of experts called aten's, whose kernel takes bfloat16 only (the same
    product, by the same offsets; transformers registers it, and uses it itself in float32)."""
    if node.target is not torch.ops.aten._grouped_mm.default or len(node.args) != 3:
        return node.target
    with contextlib.suppress(ImportError):  # registers transformers::grouped_mm_fallback
        importlib.import_module("transformers.integrations.moe")
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is None or node.kwargs:
        raise CaptureError(
            f"operator {node.name} (aten._grouped_mm) computes in bfloat16 only, and this "
            "model computes in float32; load it in float32 (dtype=torch.float32) and export "
            "it again"
        )
    return fallback.default


def _lowered(gm: fx.GraphModule) -> torch.dtype | None:
    """The type of `CARRIED` that ``gm`` (or a body of its higher-order operators) holds, takes
    or asks for, if any."""
    for node in gm.graph.nodes:
        value = _attr(gm, node.target) if node.op == "get_attr" else node.meta.get("val")
        if isinstance(value, fx.GraphModule) and (inner := _lowered(value)) is not None:
            return inner
        if _is_lowered(value):
            return value.dtype
        if node.op == "call_function":
            asked = [
                a
                for a in pytree.tree_leaves((node.args, node.kwargs))
                if isinstance(a, torch.dtype) and a in CARRIED
            ]
            if asked:
                return asked[0]
    return None


def _is_lowered(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in CARRIED


def _keep_tables(graph: fx.Graph, weight: fx.Node) -> list[fx.Node]:
    """The embeddings that look ``weight`` up, each now followed by a cast of its rows to
    float32 (which takes the embedding's place for its users)."""
    lookups = [u for u in weight.users if u.target is _EMBEDDING and u.args[0] is weight]
    for lookup in lookups:
        with graph.inserting_after(lookup):
            cast = graph.call_function(
                torch.ops.aten._to_copy.default, (lookup,), {"dtype": torch.float32}
            )
        lookup.replace_all_uses_with(cast, delete_user_cb=lambda user, cast=cast: user is not cast)
        cast.meta = {**lookup.meta, "val": _widened_val(lookup.meta.get("val"))}
    return lookups


def _cast_at_use(graph: fx.Graph, node: fx.Node) -> None:
    """Cast ``node``'s weight to float32 right before each of its users other than lookups: it
    stays in its own type, and only the user computing with it sees float32."""
    for user in [u for u in node.users if u.target is not _EMBEDDING]:
        with graph.inserting_before(user):
            cast = graph.call_function(
                torch.ops.aten._to_copy.default, (node,), {"dtype": torch.float32}
            )
        cast.meta = {**user.meta, "val": _widened_val(node.meta.get("val"))}
        user.replace_input_with(node, cast)


def _attr(gm: nn.Module, target: Any) -> Any:
    obj: Any = gm
    for part in str(target).split("."):
        obj = getattr(obj, part, None)
    return obj


def _set_attr(gm: fx.GraphModule, target: str, value: Any) -> None:
    """Set ``target`` on ``gm``, whose owner modules `fx.GraphModule` made afresh: the module
    it was made from keeps its own."""
    owner, _, name = target.rpartition(".")
    module = _attr(gm, owner) if owner else gm
    if name in module._buffers:
        module._buffers[name] = value.data if isinstance(value, nn.Parameter) else value
    else:
        setattr(module, name, value)


def _widened(arg: Any) -> Any:
    return CARRIED.get(arg, arg) if isinstance(arg, torch.dtype) else arg


def _widened_val(val: Any) -> Any:
    return val.to(CARRIED[val.dtype]) if _is_lowered(val) else val


def rounded_in(gm: fx.GraphModule, names: tuple[str, ...]) -> dict[str, str]:
    """The coarsest floating type each floating output of ``gm`` (named ``names``, in order)
    was computed through, by name, where that is coarser than float32: ``{"logits":
    "bfloat16"}`` for a bfloat16 model, also where it returns its logits as float32 (each
    bfloat16 operator on the way rounded them to bfloat16's steps). Weights and inputs of such
    a type do not count: they are the same values on both sides of the check."""
    coarsest: dict[fx.Node, torch.dtype | None] = {}
    for node in gm.graph.nodes:
        vals = pytree.tree_leaves(node.meta.get("val")) if node.op == "call_function" else []
        own = [v.dtype for v in vals if _coarse(v)]
        came = [coarsest[a] for a in node.all_input_nodes if coarsest.get(a) is not None]
        coarsest[node] = min([*own, *came], key=_bits, default=None)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = pytree.tree_leaves(out.args[0])
    return {
        name: dtype_name(dtype)
        for name, leaf in zip(names, leaves, strict=True)
        if isinstance(leaf, fx.Node)
        and _floating(leaf.meta.get("val"))
        and (dtype := coarsest.get(leaf)) is not None
    }


def _coarse(value: Any) -> bool:
    """Whether ``value`` is a tensor of a floating type coarser than float32."""
    return _floating(value) and _bits(value.dtype) < 23


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


def _bits(dtype: torch.dtype) -> int:
    """Bits of ``dtype``'s significand after the point (7 for bfloat16, 10 for float16)."""
    return int(-math.log2(torch.finfo(dtype).eps))


def default_tolerance(reference: Mapping[str, np.ndarray], types: Mapping[str, str]) -> Tolerance:
    """`Tolerance.following` the outputs of ``reference``, each of its array's type unless
    ``types`` names a coarser one it was computed in (`rounded_in`)."""
    return Tolerance.following(
        {name: (types.get(name, a.dtype.name), _largest(a)) for name, a in reference.items()}
    )


def _largest(array: np.ndarray) -> float:
    """The largest finite |value| of ``array`` (0 where it has none, or is not a number)."""
    if not np.issubdtype(array.dtype, np.floating):
        return 0.0
    finite = np.abs(array[np.isfinite(array)])
    return float(finite.max()) if finite.size else 0.0
