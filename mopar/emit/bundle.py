"""Write a bundle atomically: build everything in a temporary sibling folder, then rename; and
refuse an output path that is not a bundle mopar wrote (`check_out`).

Layout::

    plan.json                        versioned manifest: plan, slice I/O, verification, layers
    reference.npz                    input.<name> and output.<name> arrays
    stack.yml                        faas-cli stack, one function per slice (`mopar.targets.openfaas.emit`)
    template/mopar-onnx/             the OpenFaaS template, with mopar/: the torch-free runtime copy
    k8s/                             only when a cut uses shm: Profile, hostPath patches, apply.sh
    template.yaml                    AWS SAM, one image function per slice (`mopar.targets.aws_lambda.emit`)
    Dockerfile.lambda                the Lambda image of a slice (build arg SLICE)
    functions/<slice>/model.onnx     the slice's graph (`mopar.emit.onnx_export`)
    functions/<slice>/model.onnx.data  its weights, ONNX external data (absent: it has none)
    functions/<slice>/handler.py     a copy of mopar/runtime/handler.py (`mopar run` shm loads it)
    functions/<slice>/function.json  what the slice receives, sends and returns
                                     (`mopar.bundle.function`)
    functions/<slice>/requirements.txt
    .mopar-files.json                every file and folder above, by relative path: what --force
                                     may delete when it replaces the bundle (`check_out`)

This module writes the reference and each slice's handler and requirements, and stamps the
manifest with the versions that made it; `mopar.bundle` owns the manifest's and the function
specs' format, and the other files come from the modules named.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mopar._files import as_if_made, owned_folder, record_files, sweep_leftovers, unrecorded
from mopar.bundle.document import read_document
from mopar.bundle.layout import PLAN_FILE
from mopar.errors import BundleError, Option, OptionError
from mopar.profile.store import version_of

__all__ = [
    "LEFTOVERS",
    "check_out",
    "pinned",
    "Staging",
    "staging_dir",
    "stamp",
    "write_function",
    "write_reference",
]


LEFTOVERS = (".partial", ".old", ".unsplit")
"""The suffixes of the folders a compile keeps beside ``out`` (``.<out>.<pid>-<random><suffix>``):
the bundle being written, the one it replaces, and the unsplit model of the latency check."""


def check_out(out: Path, *, force: bool) -> None:
    """Refuse an output path that cannot become the bundle folder: called before any work, and
    again just before the new bundle takes its place.

    ``out`` may be new (its nearest existing folder writable), or with ``force`` an empty
    folder or a bundle mopar wrote: its ``plan.json`` reads as this mopar's bundle document and
    it holds nothing but the files its compile recorded. Anything else is refused, never
    deleted.

    Raises:
        OptionError: a file, a link or a path under a file; a place that cannot be written; a
            folder that is not a bundle, or holds files mopar did not write, with ``force``.
        BundleError: ``out`` exists and ``force`` is not given.
    """
    out = Path(out)
    where = Option("out", value=str(out), quoted=True)
    blocked = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None or (out.exists() and not out.is_dir()):
        raise OptionError(
            where,
            f": {str(blocked or out)!r} is a file, not a folder; give a folder path for the bundle",
        )
    if os.path.lexists(out) and not force:
        raise BundleError(
            f"output {str(out)!r} already exists; pass ",
            Option("force", value=True),
            " to replace it",
        )
    if out.is_symlink():
        raise OptionError(where, " is a link; give the path of the folder itself")
    _check_writable(out, where)
    if out.is_dir():
        why = _not_a_bundle(out)
        if why:
            raise OptionError(
                where,
                f" {why}, and ",
                Option("force", value=True),
                " would delete it; give a new folder path, or move it away yourself",
            )


def _check_writable(out: Path, where: Option) -> None:
    """Make and remove a folder where the bundle will be written: the one true test of a
    read-only place (root passes every permission bit, but not a read-only file system)."""
    place = next(p for p in out.parents if p.exists())
    if out.is_dir() and not os.access(out, os.W_OK):  # moving a folder away needs its own write bit
        place = out
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".mopar-probe-", dir=place))
    except OSError as exc:
        raise OptionError(
            where,
            f" cannot be written: {exc.strerror} in {str(place)!r}; give a folder you can write to",
        ) from None


def _not_a_bundle(folder: Path) -> str | None:
    """Why a non-empty ``folder`` is not a bundle mopar wrote whole, or None (empty, or one)."""
    if not any(folder.iterdir()):
        return None
    if not (folder / PLAN_FILE).is_file():
        return f"is a folder that is not a mopar bundle (no {PLAN_FILE})"
    try:
        read_document(folder)
    except BundleError:
        return (
            f"is a folder that is not a mopar bundle (its {PLAN_FILE} is not this mopar's "
            "bundle document)"
        )
    extra = unrecorded(folder)
    if extra is None:
        return "is a bundle with no record of the files mopar wrote in it (an older mopar's)"
    if extra:
        shown = ", ".join(map(repr, extra[:3])) + (
            f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        )
        return f"is a bundle that holds files mopar did not write: {shown}"
    return None


class Staging:
    """The folder a bundle is written in before it is put in place (`staging_dir`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handed_over = False

    def hand_over(self) -> None:
        """Leave the folder as it is when the block ends, for another process to finish and
        put in place (`staging_dir` with ``adopt``)."""
        self.handed_over = True


@contextlib.contextmanager
def staging_dir(out: Path, *, force: bool, adopt: Path | None = None) -> Iterator[Staging]:
    """Yield an empty folder next to ``out`` (``adopt``: the folder another process staged and
    handed over, as it is); on success put it at ``out`` (replacing the old bundle there, with
    ``force``), else delete it; one handed over (`Staging.hand_over`) stays, released.
    Leftovers of killed compiles to ``out`` are removed first (`mopar._files.sweep_leftovers`)."""
    out = Path(out)
    check_out(out, force=force)
    out.parent.mkdir(parents=True, exist_ok=True)
    if adopt is None:
        for suffix in LEFTOVERS:
            sweep_leftovers(out.parent, f".{out.name}.", suffix)
    with owned_folder(out.parent, f".{out.name}.", ".partial", adopt=adopt) as staged:
        staging = Staging(staged.path)
        yield staging
        if staging.handed_over:
            staged.release()
            return
        as_if_made(staged.path)  # mkdtemp's 0700 would become the bundle's: give it mkdir's
        record_files(staged.path)
        check_out(out, force=force)  # someone may have written into it meanwhile
        staged.release()
        if not os.path.lexists(out):
            staged.path.rename(out)
            return
        # Killed between the two renames, the old bundle is a leftover to sweep and the new
        # one stays, whole, in the released .partial folder.
        with owned_folder(out.parent, f".{out.name}.", ".old") as trash:
            out.rename(trash.path / out.name)
            staged.path.rename(out)


def pinned(dists: Iterable[str]) -> list[str]:
    """``dists`` as requirements pinned to the versions installed here (a missing one as it is)."""
    return [f"{d}=={version_of(d)}" if version_of(d) else d for d in dists]


FUNCTION_REQUIREMENTS = ("onnxruntime", "numpy", "zstandard")
"""The distributions every function's ``requirements.txt`` pins."""
TOKENIZER_REQUIREMENT = "tokenizers"
"""What a main function that carries its model's tokenizer adds: it reads text with it."""


def write_function(folder: Path, *, tokenizer: bool = False) -> None:
    """Add the handler and its pinned requirements next to a slice's ``model.onnx``
    (``tokenizers`` too where the function reads text: a main function with a tokenizer)."""
    from mopar.runtime import handler  # here: it imports onnxruntime, which compile's parent
    # process (`mopar.cli.child`) leaves out while its child holds the model

    shutil.copyfile(handler.__file__, folder / "handler.py")
    dists = FUNCTION_REQUIREMENTS + ((TOKENIZER_REQUIREMENT,) if tokenizer else ())
    (folder / "requirements.txt").write_text("\n".join(pinned(dists)) + "\n")


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
        "mopar_version": version_of("mopar"),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": {d: version_of(d) for d in ("torch", "onnx", "onnxruntime")},
    }
