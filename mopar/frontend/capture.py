"""Capture a loaded model with torch.export, bind its example inputs, and record the reference.

The result, `CapturedModel`, is what the rest of the compiler works on: a flat FX graph (one
placeholder per input tensor, one output per result tensor), the example inputs as numpy arrays
and the original model's outputs on them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import operator
import re
import sys
import threading
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from mopar._quiet import quiet_libraries
from mopar._text import few
from mopar.config import DynamicDim
from mopar.errors import CaptureError, InputSpecError, Option
from mopar.frontend import dtypes, dynamic
from mopar.frontend.load import LoadedModel

__all__ = ["CapturedModel", "capture", "input_names", "keep_last"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CapturedModel:
    """A model after torch.export, with named flat inputs and outputs.

    Attributes:
        name: the model's short name.
        gm: the exported graph as an FX GraphModule (parameters as get_attr nodes).
        input_names: public names of the flat inputs, in placeholder order.
        output_names: public names of the flat outputs, in output order.
        inputs: the example inputs, by public name.
        reference: the original model's outputs on `inputs`, by public name (none for a
            model without weights, which `mopar.frontend.shapes` captures).
        notes: what was assumed to read the example inputs; plans repeat them.
        dims: the input dimensions a bundle takes at any size in a range (none: every size is
            the example's).
        program: with ``dims``, the graph of ``gm`` with those dimensions symbolic (its tensor
            nodes named as ``gm``'s; `mopar.frontend.dynamic`), else None.
        ranges: the range of each symbol of ``program`` that stands for a dimension of
            ``dims``, by the symbol's name.
        index_ranges: the values an integer input may hold where it indexes an embedding's
            rows (0 to its rows - 1), by input name: torch refuses any other, onnxruntime
            would answer a row for a negative one.
        output_dtypes: the coarsest floating type each output was computed through, by name,
            where that is coarser than float32 (`mopar.frontend.dtypes.rounded_in`): a
            bfloat16 output's ``reference`` is float32, and a float32 output computed in
            float16 carries float16's rounding.
    """

    name: str
    gm: fx.GraphModule
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    inputs: dict[str, np.ndarray]
    reference: dict[str, np.ndarray]
    notes: tuple[str, ...] = ()
    dims: tuple[DynamicDim, ...] = ()
    program: fx.GraphModule | None = None
    ranges: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    index_ranges: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    output_dtypes: Mapping[str, str] = dataclasses.field(default_factory=dict)


def capture(
    model: LoadedModel,
    arrays: dict[str, np.ndarray] | None,
    *,
    notes: tuple[str, ...] = (),
    dims: tuple[DynamicDim, ...] = (),
) -> CapturedModel:
    """Export ``model`` on ``arrays`` (or on the inputs stored in a .pt2), with ``dims`` (and a
    .pt2's own bounded dynamic dimensions) left dynamic."""
    if model.exported is not None:
        dtypes.check_dtypes(model.exported)
        check_inference(model.exported, model)
        ep, inputs = model.exported, bind_pt2(model, arrays)
        own = tensor_inputs_only(ep.module(check_guards=False))  # the reference's types
        gm, widened = dtypes.float32_compute(own)
        dims, ranges, frozen = dynamic.program_ranges(
            gm, list(inputs), inputs, dims, lambda size: _bound(ep, size)
        )
        notes = (*notes, *frozen)
        program, gm = _static_pair(gm, list(inputs.values()), ranges)
        outputs_of = own if widened.dtype else gm
        out_names, reference = _program_outputs(ep, outputs_of, list(inputs.values()))
    else:
        module = model.module
        if module is None:
            raise CaptureError(f"model {model.name!r} has neither a module nor an exported program")
        with eval_mode(module) as trained:
            kwargs = bind_module(module, arrays, model.name)
            out = _eager(module, kwargs)
            inputs = {k: v.numpy() for k, v in kwargs.items()}
            ep = _export_dynamic(module, inputs, dims, is_script=model.kind == "torchscript")
        if trained:
            notes = (*notes, trained_note(model, trained))
        dtypes.check_dtypes(ep)
        out_names, reference = _flatten_outputs(out)
        own = tensor_inputs_only(ep.module(check_guards=False))
        gm, widened = dtypes.float32_compute(own)
        ranges = dynamic.symbol_ranges(gm, list(inputs), dims)
        program, gm = _static_pair(gm, list(inputs.values()), ranges)
    check_computes(gm, model.name, list(inputs))
    _check_graph_outputs(gm, len(reference))
    if widened.dtype:
        notes = (*notes, widened.note)
    if dims:
        shapes = ", ".join(
            f"{n} {list(inputs[n].shape)}" for n in dict.fromkeys(d.input for d in dims)
        )
        notes = (
            *notes,
            f"dynamic dimensions {', '.join(map(str, dims))}: planned at the example's sizes "
            f"({shapes}), functions sized at the largest, verified at the smallest, the middle "
            "and the largest",
        )
    return CapturedModel(
        name=model.name,
        gm=gm,
        input_names=tuple(inputs),
        output_names=out_names,
        inputs=inputs,
        reference=reference,
        notes=notes,
        dims=dims,
        program=program,
        ranges=ranges,
        index_ranges=index_ranges_of(gm, inputs),
        output_dtypes=dtypes.rounded_in(own, out_names),
    )


def keep_last(cm: CapturedModel) -> CapturedModel:
    """``cm`` answering with the last position alone (``--keep-positions last``): each output
    with positions (batch x positions x ..., rank 3 or more) cut to its last on axis 1, before
    the linear layer that makes it where one does (as transformers' ``logits_to_keep=1``: a
    decoder's head computes one row), and its reference likewise.

    Raises:
        InputSpecError: no output has positions, or the positions are dynamic.
    """
    from torch._guards import detect_fake_mode

    aten, graph = torch.ops.aten, cm.gm.graph
    vals = [n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    fake, kept = detect_fake_mode(vals), []
    for name, out in [] if cm.dims else zip(cm.output_names, graph.output_node().args[0]):
        if not isinstance(val := out.meta.get("val"), torch.Tensor) or val.dim() < 3:
            continue
        head = out.target is aten.linear.default and len(out.args[0].users) == 1
        src = out.args[0] if head else out
        with graph.inserting_after(src):
            last = graph.call_function(aten.slice.Tensor, (src, 1, -1, sys.maxsize))
        src.replace_all_uses_with(last, delete_user_cb=lambda user, last=last: user is not last)
        last.meta["nn_module_stack"] = dict(out.meta.get("nn_module_stack", {}))
        for n in (last, out) if head else (last,):
            args = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
            with fake or contextlib.nullcontext():
                n.meta["val"] = n.target(*args[0], **args[1])
        kept.append(name)
    if not kept:
        raise InputSpecError(
            Option("keep_positions", value="last"),
            " keeps the last position of outputs with positions (batch x positions x ...), and "
            f"{cm.name} has none of fixed size; leave it out",
        )
    cm.gm.recompile()
    return dataclasses.replace(
        cm,
        reference={k: v[:, -1:] if k in kept else v for k, v in cm.reference.items()},
        notes=(
            *cm.notes,
            f"answers with the last position alone of {', '.join(kept)} (--keep-positions last)",
        ),
    )


# --- the mode a model runs in --------------------------------------------------------------------


_MODES = threading.Lock()
"""Held while a module is in the mode `eval_mode` set: two threads capturing one module
would otherwise take each other's eval mode for the caller's, and leave it in eval mode."""


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[tuple[str, ...]]:
    """Run ``module`` in eval mode (BatchNorm on its running statistics, no Dropout), as a
    served model runs; yield the submodules that were training (``<root>``: the root), and give
    every submodule its own flag back on exit: a caller's module leaves as it came."""
    with _MODES:
        flags = [(m, m.training) for m in module.modules()]
        trained = tuple(name or "<root>" for name, m in module.named_modules() if m.training)
        module.eval()
        try:
            yield trained
        finally:
            for m, flag in flags:
                m.training = flag


def trained_note(model: LoadedModel, trained: tuple[str, ...]) -> str:
    whose = {"factory": f"factory {model.name!r} returned a model", "module": "the model was"}.get(
        model.kind, f"{model.name} was saved"
    )
    shown = few(trained)
    kept = " (the module passed in keeps its flags)" if model.kind == "module" else ""
    return (
        f"{whose} in training mode (modules training: {shown}); compiled in eval mode, as "
        f"model.eval() would run it: BatchNorm with its running statistics, no Dropout{kept}"
    )


_TRAINING_ARGS = ("training", "train")
"""The schema argument names that put an operator in training mode (batch_norm, dropout ...)."""

_RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")


def check_inference(ep: torch.export.ExportedProgram, model: LoadedModel) -> None:
    """Refuse a program exported in training mode: its BatchNorm normalises each request by
    its own batch, and its Dropout drops values at random, so no compiled slice can match it.

    Raises:
        CaptureError: naming the layers, and the fix (``model.eval()`` before the export).
    """
    found = [_layer_of(n) for n in ep.graph.nodes if _trains(n)]
    stats = [b for b in ep.graph_signature.buffers_to_mutate.values() if b.endswith(_RUNNING_STATS)]
    if not found and not stats:
        return
    what = f"{model.name}.pt2" if model.kind == "pt2" else "the ExportedProgram"
    layers = list(dict.fromkeys(found)) or [f"the BatchNorm of buffers {few(stats)}"]
    runs = f"{few(layers)} {'run' if len(layers) > 1 else 'runs'} as in training"
    updates = ", updating its running statistics" if stats else ""
    raise CaptureError(
        f"{what} was exported in training mode: {runs}{updates}, so its outputs depend on "
        "the batch and on chance; call model.eval() before torch.export.export, then save "
        "it again"
    )


def _trains(node: fx.Node) -> bool:
    """Whether ``node`` runs an operator in training mode (a dropout of p 0 drops nothing)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return False
    if "_with_update" in schema.name:  # aten._batch_norm_with_update: always training
        return True
    given = {a.name: node.args[i] for i, a in enumerate(schema.arguments) if i < len(node.args)}
    given.update(node.kwargs)
    if not any(given.get(name) is True for name in _TRAINING_ARGS):
        return False
    return not ("dropout" in schema.name and given.get("p") == 0)


def _layer_of(node: fx.Node) -> str:
    """``BatchNorm2d '1'``: the module that made ``node``, else the operator's name."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, kind = list(stack.values())[-1]
        return f"{str(kind).rsplit('.', 1)[-1]} {path!r}"
    return str(getattr(node.target, "__name__", node.target))


def check_computes(gm: fx.GraphModule, name: str, inputs: list[str]) -> None:
    """Refuse a model that computes nothing (``nn.Identity``, an empty ``nn.Sequential``):
    there is no function to make of it."""
    if any(n.op in ("call_function", "call_module", "call_method") for n in gm.graph.nodes):
        return
    raise CaptureError(
        f"model {name!r} computes nothing: its graph hands its inputs ({', '.join(inputs)}) "
        "straight back (an nn.Identity, an empty nn.Sequential); give a model that runs at "
        "least one operation"
    )


# --- embedding indices ---------------------------------------------------------------------------

_SAME_VALUES = frozenset(
    {
        "view",
        "reshape",
        "_unsafe_view",
        "unsqueeze",
        "squeeze",
        "flatten",
        "clone",
        "contiguous",
        "expand",
        "permute",
        "transpose",
        "t",
        "slice",
        "select",
        "alias",
    }
)
"""aten operators whose output holds only values of their first argument."""


def index_ranges_of(
    gm: fx.GraphModule, inputs: Mapping[str, np.ndarray]
) -> dict[str, tuple[int, int]]:
    """The integer inputs of ``gm`` that index an embedding's rows (through reshapes), each
    with the values it may hold: 0 to the fewest rows of the embeddings it indexes, less 1."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found: dict[str, tuple[int, int]] = {}
    for node, name in zip(placeholders, inputs):
        if not np.issubdtype(inputs[name].dtype, np.integer):
            continue
        rows = [r for r in _embedding_rows(gm, node) if r is not None]
        if rows:
            found[name] = (0, min(rows) - 1)
    return found


def _embedding_rows(gm: fx.GraphModule, node: fx.Node) -> Iterator[int | None]:
    """The rows of each embedding that ``node``'s values index, following reshapes (None: an
    embedding whose table is not a weight of ``gm``)."""
    for user in node.users:
        op = getattr(user.target, "_opname", None)
        if op == "embedding" and len(user.args) > 1 and user.args[1] is node:
            yield _rows(gm, user.args[0])
        elif op in _SAME_VALUES and user.args and user.args[0] is node:
            yield from _embedding_rows(gm, user)


def _rows(gm: fx.GraphModule, table: Any) -> int | None:
    """The first size of an embedding's table: from its traced value, else its weight."""
    if not isinstance(table, fx.Node):
        return None
    val = table.meta.get("val")
    if val is None and table.op == "get_attr":
        val = operator.attrgetter(table.target)(gm)
    return _size(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() else None


def _export_dynamic(
    module: nn.Module, inputs: dict[str, np.ndarray], dims: tuple[DynamicDim, ...], *, is_script
):
    """``module`` exported: on its example inputs, or, with ``dims``, on the example at the
    middle of their ranges (a size of 1 would fix a dimension) with those dimensions free."""
    if not dims:
        kwargs = {k: torch.from_numpy(v) for k, v in inputs.items()}
        return export_program(module, kwargs, is_script=is_script)
    if is_script:
        raise InputSpecError(
            "a TorchScript model compiles at its example's shapes only; export it with "
            "torch.export.export(..., dynamic_shapes=...) and pass the .pt2, or leave out ",
            Option("dynamic"),
        )
    dynamic.check_dims(dims, inputs)
    mid = dynamic.resized(inputs, dims, "mid")
    kwargs = {k: torch.from_numpy(v) for k, v in mid.items()}
    _eager(module, kwargs)  # a model that refuses the other sizes says so as it would anyway
    return export_program(
        module, kwargs, is_script=False, shapes=dynamic.module_shapes(dims, list(mid))
    )


def _bound(ep: torch.export.ExportedProgram, size: Any) -> tuple[int, int] | None:
    """The range a .pt2 was exported for a symbolic ``size`` (None where it has no finite
    upper bound)."""
    found = ep.range_constraints.get(size.node.expr)
    if found is None:
        return None
    try:
        lo, hi = int(found.lower), int(found.upper)
    except (TypeError, ValueError, OverflowError, AttributeError):  # int_oo fails to convert
        return None
    return (lo, hi) if hi < 2**31 else None


def _static_pair(
    gm: fx.GraphModule, flat_inputs: list[np.ndarray], ranges: Mapping[str, tuple[int, int]]
) -> tuple[fx.GraphModule | None, fx.GraphModule]:
    """(the program, the static graph) of ``gm``: without ``ranges``, no program and ``gm``
    at the example's sizes; with them, ``gm`` with only those symbols left symbolic, and a
    copy of it (sharing its weights) with every size the example's and its tensors' shapes
    propagated at the example's."""
    if not ranges:
        return None, _static_sizes(gm, flat_inputs)
    program = _static_sizes(gm, flat_inputs, keep=frozenset(ranges))
    graph = fx.Graph()
    graph.output(graph.graph_copy(program.graph, {}))
    static = _static_sizes(fx.GraphModule(program, graph), flat_inputs)
    _example_meta(static, flat_inputs)
    return program, static


def _example_meta(gm: fx.GraphModule, flat_inputs: list[np.ndarray]) -> None:
    """Set each node's ``val`` to a fake tensor of its shape on ``flat_inputs``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(torch.from_numpy(np.ascontiguousarray(a))) for a in flat_inputs]
    with torch.no_grad():
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)


def input_shapes(model: LoadedModel) -> dict[str, tuple[int, ...] | None]:
    """The names example inputs bind to, in order, each with the shape it was exported for
    (None for a module, which takes any)."""
    if model.exported is not None:
        return {
            name: tuple(_size(d) or 1 for d in val.shape) if val is not None else None
            for name, val in program_inputs(model.exported).items()
        }
    return dict.fromkeys(input_names(model))


def needed_inputs(model: LoadedModel) -> str:
    """The example inputs ``model`` needs, in words: forward()'s arguments without a default
    (the first few and a count), or, where every one has a default (transformers' models), its
    first; an exported program's inputs."""
    names = input_names(model)
    if model.exported is not None or model.module is None:
        return few(names)
    if isinstance(model.module, torch.jit.ScriptModule):
        args = model.module.forward.schema.arguments[1:]
        needed = [a.name for a in args if a.default_value is None and not a.kwarg_only]
    else:
        params = inspect.signature(model.module.forward).parameters.values()
        needed = [
            p.name
            for p in params
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
    if needed:
        return few(needed)
    return f"at least {names[0]} (every argument of forward() has a default)" if names else ""


def input_names(model: LoadedModel, *, positional: bool = False) -> tuple[str, ...]:
    """The names example inputs bind to, in order: a module's forward() parameters, or an
    exported program's user inputs.

    With ``positional``, only the names a positional example input can fill, as Python binds
    ``forward(*args)``: up to the first ``*args`` or keyword-only parameter.
    """
    if model.exported is not None:
        return tuple(program_inputs(model.exported))
    if model.module is None:
        return ()
    if not positional:
        return tuple(_signature_names(model.module))
    if isinstance(model.module, torch.jit.ScriptModule):
        return tuple(a.name for a in model.module.forward.schema.arguments[1:] if not a.kwarg_only)
    names = []
    for p in inspect.signature(model.module.forward).parameters.values():
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        names.append(p.name)
    return tuple(names)


def _signature_names(module: nn.Module) -> list[str]:
    if isinstance(module, torch.jit.ScriptModule):
        return [a.name for a in module.forward.schema.arguments[1:]]
    params = inspect.signature(module.forward).parameters.values()
    return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def bind_module(
    module: nn.Module, arrays: dict[str, np.ndarray] | None, name: str
) -> dict[str, torch.Tensor]:
    names = _signature_names(module)
    if not arrays:
        raise InputSpecError(
            f"model {name!r} needs example inputs for forward({few(names, 4)}); pass ",
            Option("example_args", cli="input", metavar="NAME=DIMxDIM:DTYPE"),
            " for each, or ",
            Option("example_args", cli="example-inputs", metavar="FILE.npz"),
        )
    unknown = [k for k in arrays if k not in names]
    if unknown:
        raise InputSpecError(
            f"input {unknown[0]!r} is not an argument of {name}.forward({', '.join(names)}); "
            "rename the ",
            Option("example_args", cli="input"),
            " to one of those",
        )
    # Keyword order follows forward()'s signature, which fixes the flat input order of the graph.
    return {k: torch.from_numpy(np.ascontiguousarray(arrays[k])) for k in names if k in arrays}


def program_inputs(ep: torch.export.ExportedProgram) -> dict[str, Any]:
    """An exported program's tensor user inputs by name (forward()'s parameter names, which
    ``ep.module()`` may rename: ``input`` becomes ``input_1``), each with its traced value.

    Inputs that are not tensors (``use_cache=False``) were specialised by the export: no
    request carries them."""
    values = user_input_values(ep)
    return {name: val for name, val in values.items() if isinstance(val, torch.Tensor)}


def user_input_values(ep: torch.export.ExportedProgram) -> dict[str, Any]:
    nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    return {
        name: nodes[name].meta.get("val")
        for name in ep.graph_signature.user_inputs
        if name in nodes
    }


def tensor_inputs_only(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with the placeholders of non-tensor inputs (``use_cache=False``, which the export
    specialised) folded into their users as constants, called with flat tensors only."""
    constants = [
        n
        for n in gm.graph.nodes
        if n.op == "placeholder" and not isinstance(n.meta.get("val"), torch.Tensor)
    ]
    if not constants:
        return gm
    for node in constants:
        value = node.meta.get("val")
        for user in list(node.users):
            user.args, user.kwargs = pytree.tree_map(
                lambda a, node=node, value=value: value if a is node else a,
                (user.args, user.kwargs),
            )
        gm.graph.erase_node(node)
    gm.graph._codegen = fx.graph.CodeGen()  # torch.export's pytree signature named them all
    gm.recompile()
    return gm


def _static_sizes(
    gm: fx.GraphModule, flat_inputs: list[np.ndarray], *, keep: frozenset[str] = frozenset()
) -> fx.GraphModule:
    """``gm`` with each symbolic size it computes (``sym_size`` of a dimension exported as
    dynamic, by ``dynamic_shapes=`` or by the TorchScript converter, and the arithmetic on it)
    replaced by its value on the example inputs, except those of the symbols named in ``keep``
    (the dimensions that stay dynamic).

    A size is no tensor, so it could not cross a cut between slices: a slice of a dynamic
    dimension computes its sizes from its own inputs (`mopar.ir.dynamic`)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    symbolic = {
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))
        and not free_unbacked_symbols(n.meta["val"])  # a data-dependent size varies per request
        and not {str(s) for s in n.meta["val"].node.expr.free_symbols} & keep
    }
    if not symbolic:
        return gm
    values: dict[fx.Node, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            if n in symbolic:
                values[n] = result
            return result

    with torch.no_grad():
        Recorder(gm).run(*[torch.from_numpy(np.ascontiguousarray(a)) for a in flat_inputs])
    # users first: a size computed from sizes is erased before the sizes it reads
    for node in [n for n in reversed(gm.graph.nodes) if n in symbolic]:
        for user in list(node.users):
            user.args, user.kwargs = pytree.tree_map(
                lambda a, node=node: values[node] if a is node else a, (user.args, user.kwargs)
            )
        gm.graph.erase_node(node)
    gm.recompile()
    return gm


def bind_pt2(model: LoadedModel, arrays: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    expected = program_inputs(model.exported)
    if not arrays:
        if model.stored_inputs is None:
            raise InputSpecError(
                f"{model.name}.pt2 carries no example inputs; pass ",
                Option("example_args", cli="input"),
                f" for {', '.join(expected)}",
            )
        # the stored leaves follow the program's user inputs, tensors or not (use_cache=False)
        leaves = dict(
            zip(user_input_values(model.exported), pytree.tree_leaves(model.stored_inputs))
        )
        return {name: dtypes.to_numpy(leaves[name]) for name in expected}
    if sorted(arrays) != sorted(expected):
        raise InputSpecError(
            f"inputs {sorted(arrays)} do not match the exported program's inputs "
            f"{sorted(expected)}; pass one input for each of those (",
            Option("example_args", cli="input"),
            ")",
        )
    for name, val in expected.items():
        got = arrays[name]
        sizes = [_size(d) for d in val.shape]  # None: dynamic in the program
        want_shape = tuple(g if w is None else w for w, g in zip(sizes, got.shape))
        want_dtype = dtypes.numpy_dtype(val.dtype).name
        exported_as = dtypes.dtype_name(val.dtype)
        if exported_as != want_dtype:  # bfloat16: given as float32
            exported_as = f"{exported_as} (given as {want_dtype})"
        if len(sizes) != got.ndim or tuple(got.shape) != want_shape or str(got.dtype) != want_dtype:
            exported = tuple("N" if w is None else w for w in sizes)
            shape = "x".join(map(str, exported))
            raise InputSpecError(
                f"input {name!r} has shape {tuple(got.shape)} {got.dtype}, but the .pt2 was "
                f"exported for [{', '.join(map(str, exported))}] {exported_as}"
                f"{' (N: any size)' if None in sizes else ''}; pass ",
                Option("example_args", cli="input", value=[f"{name}={shape}:{want_dtype}"]),
                " or export it again on example inputs of the shape you want",
            )
    return {name: arrays[name] for name in expected}


def _size(d: Any) -> int | None:
    """A program dimension's size: a number, or None where it is symbolic (read without
    ``int()``, which would tie the symbol to its example)."""
    if isinstance(d, int):
        return d
    return d.node.maybe_as_int()


def _eager(module: nn.Module, kwargs: dict[str, torch.Tensor]) -> Any:
    try:
        with torch.no_grad():
            return module(**kwargs)
    except Exception as exc:
        shapes = ", ".join(f"{k}={tuple(v.shape)}:{str(v.dtype)[6:]}" for k, v in kwargs.items())
        raise InputSpecError(
            f"the model rejects inputs {shapes}: {_reason(exc)}; fix the ",
            Option("example_args", cli="input"),
            " shapes or dtypes",
        ) from None


def export_program(
    module: nn.Module, kwargs: dict[str, torch.Tensor], *, is_script: bool, shapes: Any = None
):
    try:
        with quiet_libraries():
            if is_script:
                from torch._export.converter import TS2EPConverter

                return TS2EPConverter(module, tuple(kwargs.values())).convert()
            return torch.export.export(module, (), kwargs, strict=False, dynamic_shapes=shapes)
    except Exception as exc:
        where = _failing_module(module, exc)
        raise CaptureError(
            f"torch.export cannot capture the model{where}: {_reason(exc)}. {_suggest(exc)}"
        ) from exc


def _failing_module(root: nn.Module, exc: BaseException) -> str:
    """Name the innermost submodule of ``root`` whose forward() was running when export failed."""
    paths = {id(m): name for name, m in root.named_modules()}
    found = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in paths:
            found = (paths[id(owner)] or "<root>", type(owner).__name__, frame.f_lineno)
    if found is None:
        return ""
    return f" in module {found[0]!r} ({found[1]}.forward, line {found[2]})"


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    text = re.sub(
        r"\s*(For more information|Set TORCH_LOGS|from user code|If this type holds "
        r"tensors).*$",
        "",
        text,
    ).rstrip(".")
    return (text[:400] + "...") if len(text) > 400 else (text or type(exc).__name__)


def _suggest(exc: BaseException) -> str:
    text = str(exc)
    if "Constraints violated" in text:
        return (
            "Fix: the model does not take every size of a dynamic dimension's range; narrow the range, "
            "or leave that dimension at the example's size"
        )
    if "data-dependent" in text or "GuardOnDataDependent" in type(exc).__name__:
        return (
            "Fix: the forward() branches on tensor values; use torch.where / torch.cond, or "
            "move .item()/.tolist() out of forward()"
        )
    if found := re.search(r"Found <class '([\w.]+)'> in output", text):
        kind = found.group(1).rsplit(".", 1)[-1]
        if "Cache" in kind:  # transformers' key-value cache: use_cache=True
            return (
                f"Fix: the model returns its key-value cache ({kind}); set "
                "model.config.use_cache = False before handing it over"
            )
        return (
            f"Fix: return tensors (or tuples, lists or dicts of them) from forward(), not "
            f"{kind}, or register {kind} with torch.utils._pytree"
        )
    if "Unsupported" in text or "not supported" in text:
        return "Fix: replace the unsupported Python or op construct, or register a custom op"
    return (
        "Fix: make forward() traceable (no numpy or Python-side effects on tensor values), or "
        "export it yourself with torch.export.export and pass the .pt2"
    )


def _flatten_outputs(out: Any) -> tuple[tuple[str, ...], dict[str, np.ndarray]]:
    """The tensors of a model's output, each named by its key path in the output (``logits``,
    ``last_hidden_state``, ``a_b`` for ``out["a"]["b"]``), else ``output_<i>``."""
    leaves, _ = pytree.tree_flatten_with_path(out)
    names: list[str] = []
    arrays: dict[str, np.ndarray] = {}
    for i, (path, leaf) in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise CaptureError(
                f"model output {pytree.keystr(path) or i} is {type(leaf).__name__}, not a tensor; "
                "return only tensors from forward()"
            )
        name = leaf_name(path, i, arrays)
        names.append(name)
        arrays[name] = dtypes.to_numpy(leaf)
    return tuple(names), arrays


def leaf_name(path: tuple, i: int, taken: Mapping[str, Any]) -> str:
    """The public name of output leaf ``i`` at key ``path``: the path's keys joined by ``_``,
    or ``output_<i>`` where that is empty, does not start with a letter, or is taken."""
    name = re.sub(r"\W+", "_", pytree.keystr(path)).strip("_") or f"output_{i}"
    if not name[0].isalpha() or name in taken:
        name = f"output_{i}"
    return name


def _program_outputs(
    ep: torch.export.ExportedProgram, gm: fx.GraphModule, flat_inputs: list[np.ndarray]
) -> tuple[tuple[str, ...], dict[str, np.ndarray]]:
    """An exported program's tensor outputs on ``flat_inputs``, named as the module it was
    exported from names them (`_flatten_outputs`): by the keys of its output tree (a dict's
    keys, a ``ModelOutput``'s fields), else by position (``output_<i>``)."""
    with torch.no_grad():
        flat = pytree.tree_leaves(fx.Interpreter(gm).run(*dtypes.to_program(gm, flat_inputs)))
    paths = output_paths(ep, flat) or [()] * len(flat)
    names: list[str] = []
    arrays: dict[str, np.ndarray] = {}
    for path, leaf in zip(paths, flat, strict=True):
        if isinstance(leaf, torch.Tensor):
            name = leaf_name(path, len(names), arrays)
            names.append(name)
            arrays[name] = dtypes.to_numpy(leaf)
    return tuple(names), arrays


def output_paths(ep: torch.export.ExportedProgram, flat: list[Any]) -> list[tuple] | None:
    """The key path of each of ``flat``'s leaves in the program's output tree (its
    ``call_spec.out_spec``, which `torch.export.save` keeps); None where the program has no
    spec or this process cannot rebuild the tree (its type unregistered)."""
    try:
        spec = ep.call_spec.out_spec
        if spec is None or spec.num_leaves != len(flat):
            return None
        leaves, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten(flat, spec))
    except Exception:  # noqa: BLE001 - naming by position is the fallback, whatever failed
        log.debug("the output tree was not rebuilt; outputs named by position", exc_info=True)
        return None
    return [path for path, _ in leaves] if len(leaves) == len(flat) else None


def _check_graph_outputs(gm: fx.GraphModule, expected: int) -> None:
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    flat = pytree.tree_leaves(out_node.args[0])
    if len(flat) != expected:
        raise CaptureError(
            f"the exported graph has {len(flat)} outputs but the model returned {expected} tensors;"
            " return a flat tuple of tensors from forward()"
        )
