"""Export slice modules to ONNX and check them with `onnx.checker` (onnxruntime against the
model: `mopar.runner.inprocess.verify_chain`).

Read in this order: `try_export_slice` (one slice; operators torch.onnx lacks get the
translations of `mopar.emit.onnx_ops`), `export_units` (every unit of a plan, stopping at the
first failure), then `failure_site` and `export_error` (what a failure is reported as).
Where a unit does not export, the pipeline moves a cut
(`mopar.planner.recut`), plans, rewrites and calls `export_units` again: this module only
carries out the plan it is given.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnxscript import ir as onnx_ir

from mopar._quiet import quiet_libraries
from mopar.bundle.layout import HOT_DIR, WARM_DIR, WEIGHTS_FILE
from mopar.emit.onnx_ops import translation_table
from mopar.emit.session import write_session
from mopar.errors import CaptureError, Option
from mopar.frontend.mapped import release
from mopar.ir import LayerGraph
from mopar.ir.dynamic import Dynamic
from mopar.plan import Plan
from mopar.rewrite import SliceModule

__all__ = [
    "ExportFailure",
    "run_slices_torch",
    "try_export_slice",
    "export_units",
    "keep_only",
    "failure_site",
    "export_error",
]

log = logging.getLogger(__name__)


def run_slices_torch(
    slices: tuple[SliceModule, ...],
    inputs: dict[str, np.ndarray],
    known: Mapping[str, np.ndarray] | None = None,
) -> dict[str, torch.Tensor]:
    """Run the slice modules in order on ``inputs``; return every tensor by value name.
    ``known``: values computed before (the model's outputs, by value name); a plain slice
    whose outputs are all known is not run. A 1 GB bfloat16 model's run cost 0.29 GB more
    than its weights (torch casts a weight to float32 for a CPU matmul), which the export
    stage then held at its peak."""
    values = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in inputs.items()}
    known = known or {}
    with torch.no_grad():
        for s in slices:
            plain = s.dispatch is None and s.feed is None and not s.rows
            if plain and all(t.name in known for t in s.outputs):
                values.update((t.name, torch.from_numpy(known[t.name])) for t in s.outputs)
                continue
            units = (s, s.dispatch.hot) if s.dispatch is not None and s.dispatch.hot else (s,)
            for u in units:  # a dispatch's hot experts run on what its feed made
                if u.feed is not None:
                    values.update(u.feed(values))
                results = u.gm(*[values[t.name] for t in u.inputs])
                values.update(zip((t.name for t in u.outputs), results))
    return values


@dataclass(frozen=True, kw_only=True)
class ExportFailure:
    """Why one slice did not export to ONNX.

    Attributes:
        slice: the slice's name.
        operator: the operator being translated when it failed (``aten.histc.default``), or ""
            when the exporter named none (it failed while tracing the slice, or the checker did).
        node: the FX node of that operator, or "".
        reason: the message of the exception it all started with, on one line.
    """

    slice: str
    operator: str
    node: str
    reason: str


@contextlib.contextmanager
def _torchlib_once() -> Iterator[None]:
    """Within: `torch.onnx.export` gets a copy of a table of ATen translations built once per
    process and opset, where it would build it again on every call (0.6 s of a slice's 2 s; it
    depends only on the installed torch and onnxscript). Where torch lays its exporter out
    otherwise, nothing changes."""
    try:
        from torch.onnx._internal.exporter._registration import ONNXRegistry
    except ImportError:
        yield
        return
    build = ONNXRegistry.__dict__.get("from_torchlib")
    if not isinstance(build, classmethod):
        yield
        return

    def copy(cls: type, opset_version: int | None = None) -> Any:
        if opset_version is None:
            opset_version = build.__func__.__defaults__[0]
        table = _torchlib(build, ONNXRegistry, opset_version)
        registry = cls()
        registry._opset_version = table._opset_version
        registry.functions = {k: list(v) for k, v in table.functions.items()}
        return registry

    ONNXRegistry.from_torchlib = classmethod(copy)  # type: ignore[assignment]
    try:
        yield
    finally:
        ONNXRegistry.from_torchlib = build  # type: ignore[assignment]


@functools.cache
def _torchlib(build: classmethod, registry: type, opset: int) -> Any:
    """The table torch's ``registry.from_torchlib`` (``build``) makes for ``opset``."""
    return build.__func__(registry, opset_version=opset)


def try_export_slice(
    s: SliceModule,
    values: dict[str, torch.Tensor],
    path: Path,
    *,
    opset: int | None,
    shapes: Dynamic | None = None,
) -> ExportFailure | None:
    """Export one slice to ``path`` and check it; return why it failed, or None when it did not.

    Operators torch.onnx does not know get the translations of `mopar.emit.onnx_ops`. With
    ``shapes``, the slice takes its dynamic dimensions at any size in their ranges.
    """
    # Tensors cross a cut as contiguous buffers, so trace each slice on contiguous inputs too.
    gm, args, dynamic = s.gm, tuple(values[t.name].contiguous() for t in s.inputs), None
    most = max((int(a.shape[0]) for a in args if a.dim()), default=1)  # scalars have no rows
    if s.rows and most > 1:  # an expert function: any number of tokens up to a request's
        rows = torch.export.Dim("rows", min=1, max=most)
        dynamic = tuple({0: rows} for _ in args)
    elif shapes is not None:
        gm, args, dynamic = shapes.slice(s.gm)
    try:
        with quiet_libraries(), _torchlib_once():
            program = torch.onnx.export(
                gm,
                args,
                dynamo=True,
                input_names=[t.name for t in s.inputs],
                output_names=[t.name for t in s.outputs],
                external_data=False,
                opset_version=opset,
                optimize=True,
                verbose=False,
                dynamic_shapes=dynamic,
                custom_translation_table=translation_table(_targets(s.gm)),
            )
        _save(program, path)
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:  # noqa: BLE001 - any exporter failure is this slice's failure
        operator, node = _failure_site(exc)
        log.info("slice %s did not export (operator %s): %s", s.name, operator or "?", exc)
        return ExportFailure(slice=s.name, operator=operator, node=node, reason=_root_reason(exc))
    return None


def _save(program, path: Path) -> None:
    """Write ``path`` with its weights in `WEIGHTS_FILE` beside it.

    onnxruntime reads weights kept as external data straight from the file's pages instead of
    first parsing a protobuf that holds them and then copying them out: measured on ResNet-50
    (98 MB of weights), a session's peak RSS fell from 305 to 216-242 MB and its load from 495
    to about 300 ms, at the same speed (docs/benchmarks.md). A slice without weights gets none.

    A weight mapped from a ``.pt2`` (`mopar.frontend.mapped`) is handed back to the kernel
    before the file is written, and again once its bytes are: the export reads one weight at a
    time into memory, not all of them beside those capture left resident.
    """

    def drop(tensor: Any) -> None:
        if isinstance(raw := getattr(tensor, "raw", None), torch.Tensor):
            release(raw)

    for value in program.model.graph.initializers.values():
        drop(value.const_value)
    written: list[Any] = []

    def wrote(tensor: Any, _info: Any) -> None:  # told before each tensor is written
        if written:
            drop(written.pop())
        written.append(tensor)

    onnx_ir.save(program.model, path, external_data=WEIGHTS_FILE, callback=wrote)
    if written:
        drop(written.pop())
    weights = path.with_name(WEIGHTS_FILE)
    if weights.is_file() and weights.stat().st_size == 0:
        weights.unlink()
    write_session(path)


def _targets(gm: torch.fx.GraphModule) -> set:
    """Every call_function target in ``gm`` and its sub-modules (higher-order ops' bodies)."""
    return {
        n.target
        for m in gm.modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
        if n.op == "call_function"
    }


# torch.onnx names the node it failed on: "Error when translating node %name : [...] =
# call_function[target=torch.ops.ns.op.overload](...)", or "While executing %name : ..." when a
# node failed while it traced the slice. The name is its own; often, not always, the slice's.
_NODE_RE = re.compile(r"(?:translating node|While executing) %(\w+)")
_TARGET_RE = re.compile(r"call_function\[target=(?:torch\.ops\.)?([\w.]+)\]")


def _root_reason(exc: BaseException) -> str:
    """The message of the exception that started it all, on one line (torch.onnx wraps the
    real reason in two or three layers of "Failed to convert ... Next steps")."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _failure_site(exc: BaseException) -> tuple[str, str]:
    """(operator, node) named by ``exc`` or the exceptions it was raised from; "" where none."""
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen)
        target = _TARGET_RE.search(text)
        if target:
            node = _NODE_RE.search(text)
            return target.group(1), node.group(1) if node else ""
        seen = seen.__cause__ or seen.__context__
    return "", ""


# --- exporting a plan's units: the pipeline's export stage drives it --------------------------------


def export_units(
    slices: tuple[SliceModule, ...],
    values: dict[str, torch.Tensor],
    folder: Path,
    *,
    opset: int | None,
    done: dict[str, SliceModule],
    progress: Callable[[str, int, int], None] | None = None,
    shapes: Dynamic | None = None,
) -> ExportFailure | None:
    """Export every unit to ``folder/<unit>/model.onnx``, skipping one that is the same as the
    unit last exported under its name (``done``, updated); return the first failure, or None.

    Args:
        slices: the plan's executable units, in plan order.
        values: every tensor on the example inputs, by value name (`run_slices_torch`).
        folder: where the unit folders go.
        opset: the ONNX opset (None: the exporter's default).
        done: the units exported so far by name, across the attempts of one compile.
        progress: told ``(unit name, index, unit count)`` before each export.
        shapes: the model's dynamic dimensions, where it has some.
    """
    for i, s in enumerate(slices):
        if progress is not None:
            progress(s.name, i, len(slices))
        if s.name in done and _same_slice(done[s.name], s):
            continue
        done.pop(s.name, None)
        target = folder / s.name / "model.onnx"
        target.parent.mkdir(parents=True, exist_ok=True)
        # a dispatch runs its layer's tail, its hot experts and the next layer's router; the
        # other experts are the functions it calls
        units = [(s.dispatch.tail if s.dispatch is not None else s, target)]
        if s.dispatch is not None:
            units += [
                (unit, target.parent / sub / "model.onnx")
                for unit, sub in ((s.dispatch.hot, HOT_DIR), (s.dispatch.warm, WARM_DIR))
                if unit is not None
            ]
        for unit, path in units:
            path.parent.mkdir(parents=True, exist_ok=True)
            failure = try_export_slice(unit, values, path, opset=opset, shapes=shapes)
            if failure is not None:
                return failure
        done[s.name] = s
    return None


def keep_only(folder: Path, keep: set[str]) -> None:
    """Remove the folders of units an earlier attempt had and the final plan does not."""
    for path in folder.iterdir():
        if path.name not in keep:
            shutil.rmtree(path)


def _same_slice(a: SliceModule, b: SliceModule) -> bool:
    """Whether two slice modules compute the same thing: same graph, I/O and tensors."""
    if (a.inputs, a.outputs, a.gm.code) != (b.inputs, b.outputs, b.gm.code):
        return False
    if (a.dispatch and a.dispatch.spec) != (b.dispatch and b.dispatch.spec):
        return False
    ta, tb = _tensors(a.gm), _tensors(b.gm)
    return ta.keys() == tb.keys() and all(
        ta[k] is tb[k]
        or (ta[k].shape == tb[k].shape and ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]))
        for k in ta
    )


def _tensors(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    found = dict(gm.named_parameters())
    found.update(gm.named_buffers())
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target not in found:
            obj = gm
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
            if isinstance(obj, torch.Tensor):
                found[str(node.target)] = obj
    return found


def failure_site(failure: ExportFailure, lg: LayerGraph, plan: Plan) -> tuple[int, str]:
    """The index, in ``plan``'s vertical cut, of the slice whose unit did not export, and
    "operator X in layer Y" for the failure, as precisely as the exporter named it."""
    vertical = [f.name for f in plan.vertical()]
    failing = vertical.index(plan.function(failure.slice).group or failure.slice)
    return failing, _site(failure, lg, plan.vertical()[failing].layers)


def _site(failure: ExportFailure, lg: LayerGraph, layers: tuple[str, ...]) -> str:
    if not failure.operator:
        return f"no operator named, in layers {layers[0]} .. {layers[-1]}"
    layer = lg.node_layer.get(failure.node)
    if layer not in layers:  # the exporter renamed the node: the first layer calling the op
        by_name = {n.name: n for n in lg.gm.graph.nodes}
        layer = next(
            (
                la
                for la in layers
                for n in lg.graph.nodes[la]["layer"].nodes
                if str(by_name[n].target).removeprefix("torch.ops.") == failure.operator
            ),
            f"{layers[0]} .. {layers[-1]}",
        )
    return f"operator {failure.operator} in layer {layer}"


def export_error(
    failure: ExportFailure,
    site: str,
    failing: int,
    cuts: tuple[int, ...],
    names: list[str],
    retries: int,
    max_moves: int,
) -> CaptureError:
    """The one-line error about the first failure: slice ``failing`` of the planner's ``cuts``,
    the operator and layer, the cuts around it and how many others were tried."""
    own = [k for k in (failing - 1, failing) if 0 <= k < len(cuts)]
    where = " and ".join(f"{names[cuts[k] - 1]} | {names[cuts[k]]}" for k in own)
    moved = (
        f"; moving its cut{'s' if len(own) > 1 else ''} ({where}) up to {max_moves} layers "
        f"either way did not help ({retries} other cuts tried)"
        if own
        else ""
    )
    other = ("try another ", Option("slices"), " count, ") if own else ()
    return CaptureError(
        f"slice {failure.slice} cannot be exported to ONNX: {site} ({failure.reason[:200]})"
        f"{moved}. Fix: ",
        *other,
        "add an ONNX translation for the operator to mopar.emit.onnx_ops, or report it",
    )
