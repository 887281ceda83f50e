"""Write a bundle atomically: build everything in a temporary sibling folder, then rename.

Layout::

    plan.json                        versioned manifest: plan, slice I/O, verification, layers
    reference.npz                    input.<name> and output.<name> arrays
    stack.yml                        faas-cli stack, one function per slice (`mopar.emit.openfaas`)
    template/mopar-onnx/             the OpenFaaS template, with mopar/: the torch-free runtime copy
    k8s/                             only when a cut uses shm: Profile, hostPath patches, apply.sh
    template.yaml                    AWS SAM, one image function per slice (`mopar.emit.sam`)
    Dockerfile.lambda                the Lambda image of a slice (build arg SLICE)
    functions/<slice>/model.onnx     the slice's graph (`mopar.emit.onnx_export`)
    functions/<slice>/model.onnx.data  its weights, ONNX external data (absent: it has none)
    functions/<slice>/handler.py     a copy of mopar/runtime/handler.py (`mopar run` shm loads it)
    functions/<slice>/function.json  what the slice receives, sends and returns
                                     (`mopar.bundle.function`)
    functions/<slice>/requirements.txt

This module writes the reference and each slice's handler and requirements, and stamps the
manifest with the versions that made it; `mopar.bundle` owns the manifest's and the function
specs' format, and the other files come from the modules named.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import shutil
import tempfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from mopar._files import as_if_made
from mopar.errors import BundleError, Option
from mopar.runtime import handler as handler_module

__all__ = ["staging_dir", "stamp", "write_function", "write_reference"]


@contextlib.contextmanager
def staging_dir(out: Path, *, force: bool) -> Iterator[Path]:
    """Yield an empty folder next to ``out``; on success rename it to ``out``, else delete it."""
    out = Path(out)
    if out.exists() and not force:
        raise BundleError(
            f"output {str(out)!r} already exists; pass ",
            Option("force", value=True),
            " to replace it",
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield tmp
        as_if_made(tmp)  # mkdtemp's 0700 would become the bundle's: give it mkdir's
        if out.exists():
            trash = out.with_name(f".{out.name}.old")
            shutil.rmtree(trash, ignore_errors=True)
            out.rename(trash)
            tmp.rename(out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


def write_function(folder: Path) -> None:
    """Add the handler and its pinned requirements next to a slice's ``model.onnx``."""
    shutil.copyfile(handler_module.__file__, folder / "handler.py")
    reqs = [
        f"onnxruntime=={_version('onnxruntime')}",
        f"numpy=={_version('numpy')}",
        f"zstandard=={_version('zstandard')}",
    ]
    (folder / "requirements.txt").write_text("\n".join(reqs) + "\n")


def write_reference(
    path: Path, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]
) -> None:
    arrays = {f"input.{k}": v for k, v in inputs.items()}
    arrays.update({f"output.{k}": v for k, v in outputs.items()})
    np.savez(path, **arrays)


def stamp() -> dict[str, Any]:
    """Which mopar writes a bundle, when, and with which torch, onnx and onnxruntime: the
    `mopar.bundle.document.BundleDocument` fields of those names."""
    return {
        "mopar_version": _version("mopar"),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": {d: _version(d) for d in ("torch", "onnx", "onnxruntime")},
    }
