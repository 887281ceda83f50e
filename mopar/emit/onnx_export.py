"""Export slice modules to ONNX and check them: `onnx.checker`, then onnxruntime vs the model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch

from mopar._quiet import quiet_libraries
from mopar.errors import CaptureError, VerificationError
from mopar.rewrite import SliceModule
from mopar.config import Tolerance
from mopar.runtime.check import Comparison, compare_outputs

__all__ = ["run_slices_torch", "export_slice", "verify_chain"]



def run_slices_torch(
    slices: tuple[SliceModule, ...], inputs: dict[str, np.ndarray]
) -> dict[str, torch.Tensor]:
    """Run the slice modules in order on ``inputs``; return every tensor by value name."""
    values = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in inputs.items()}
    with torch.no_grad():
        for s in slices:
            results = s.gm(*[values[t.name] for t in s.inputs])
            values.update(zip((t.name for t in s.outputs), results))
    return values


def export_slice(s: SliceModule, values: dict[str, torch.Tensor], path: Path, *, opset: int | None) -> None:
    """Export one slice to ``path`` (weights embedded) and run ``onnx.checker`` on it."""
    # Tensors cross a cut as contiguous buffers, so trace each slice on contiguous inputs too.
    args = tuple(values[t.name].contiguous() for t in s.inputs)
    try:
        with quiet_libraries():
            program = torch.onnx.export(
                s.gm, args, dynamo=True, input_names=[t.name for t in s.inputs],
                output_names=[t.name for t in s.outputs], external_data=False,
                opset_version=opset, optimize=True, verbose=False,
            )
    except Exception as exc:
        reason = " ".join(str(exc).split())[:400]
        raise CaptureError(
            f"slice {s.name} cannot be exported to ONNX: {reason}. Fix: try another --slices "
            "count, or report the op above if it is a standard one"
        ) from exc
    program.save(str(path), external_data=False)
    onnx.checker.check_model(str(path), full_check=True)


def verify_chain(
    model_paths: list[Path],
    slices: tuple[SliceModule, ...],
    inputs: dict[str, np.ndarray],
    reference: dict[str, np.ndarray],
    output_values: dict[str, str],
    *,
    tolerance: Tolerance,
) -> Comparison:
    """Chain the ONNX slices in onnxruntime and compare with the original model's outputs.

    Raises `VerificationError`, naming the output, when they are not within ``tolerance``.
    """
    import onnxruntime as ort

    values = dict(inputs)
    for path, s in zip(model_paths, slices):
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        out = session.run([t.name for t in s.outputs], {t.name: values[t.name] for t in s.inputs})
        values.update(zip((t.name for t in s.outputs), out))
    got = {pub: values[value] for pub, value in output_values.items()}
    checked = compare_outputs(got, reference, tolerance)
    if not checked.passed:
        raise VerificationError(
            f"the chained ONNX slices: {checked.describe(tolerance)}; pass a wider --rtol/--atol "
            "if that is expected, try another --slices count, or report it"
        )
    return checked
