"""A bundle as the runner sees it (`BundleManifest`, from its `mopar.bundle.document`), and the
``.npz`` files it reads (inputs and the reference). No torch."""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mopar.bundle.dispatch import DispatchSpec
from mopar.bundle.document import BundleDocument, IoTensor, read_document
from mopar.bundle.function import value_outside
from mopar.bundle.layout import (
    FUNCTION_FILE,
    FUNCTIONS_DIR,
    HOT_DIR,
    MODEL_FILE,
    PLAN_FILE,
    REFERENCE_FILE,
    WARM_DIR,
    WEIGHTS_FILE,
)
from mopar.errors import BundleError, InputSpecError, MoparError, Part

__all__ = [
    "BundleSlice",
    "BundleManifest",
    "manifest_of",
    "read_manifest",
    "read_npz",
    "read_reference",
]


@dataclass(frozen=True, kw_only=True)
class BundleSlice:
    """A slice as the runtime sees it: its folder, tensors in and out, and allocated memory (MB).

    Attributes:
        codecs: the codec name (`mopar.codec.get_codec`) each output tensor is written with;
            an output not named here is written raw (codec none).
        dispatch: a dispatch function's layer: it calls the expert functions its ``callees``
            name, and its model is the rest of the layer, run on their summed answers.
        called: an expert function, run only when its dispatch calls it.
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    memory_mb: int
    codecs: Mapping[str, str] = field(default_factory=dict)
    dispatch: DispatchSpec | None = None
    called: bool = False


@dataclass(frozen=True, kw_only=True)
class BundleManifest:
    """What `mopar run` needs of a bundle: its ``plan.json`` (`document`) as the runner sees it.

    Attributes:
        root: the bundle folder.
        model: the model's name.
        inputs: public names of the model inputs (also their value names).
        outputs: (public name, value name) of each model output.
        slices: the slices in topological order.
        input_types: each model input by name, as compiled (its shape, or range of shapes,
            and dtype).
        document: the bundle's ``plan.json``.
    """

    root: Path
    model: str
    inputs: tuple[str, ...]
    outputs: tuple[tuple[str, str], ...]
    slices: tuple[BundleSlice, ...]
    input_types: Mapping[str, IoTensor] = field(default_factory=dict)
    document: BundleDocument

    def check_inputs(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Refuse inputs the bundle cannot take before any slice starts.

        Raises:
            InputSpecError: an input is missing, its shape or dtype is not the compiled one, or
                it holds an index outside the embedding it indexes.
        """
        missing = [n for n in self.inputs if n not in arrays]
        if missing:
            raise InputSpecError(
                f"input file lacks {missing}; the bundle's inputs are {list(self.inputs)}"
            )
        for t in self.input_types.values():
            got = arrays[t.name]
            if not t.fits(tuple(got.shape)) or got.dtype.newbyteorder("=") != np.dtype(t.dtype):
                raise InputSpecError(
                    f"input {t.name!r} is {got.dtype.name} {list(got.shape)}, and the bundle was "
                    f"compiled for {t.describe()}; pass arrays of that shape and dtype, "
                    "or recompile with this input (--dynamic for a range of sizes)"
                )
            if (bad := value_outside(got, t.value_range)) is not None:
                low, high = t.value_range
                raise InputSpecError(
                    f"input {t.name!r} holds {bad}, and it indexes an embedding of {high + 1} "
                    f"rows (the model would refuse it); pass values from {low} to {high}"
                )

    def function_dir(self, s: BundleSlice) -> Path:
        return self.root / FUNCTIONS_DIR / s.name


def manifest_of(root: Path, document: BundleDocument) -> BundleManifest:
    """The runner's view of the bundle at ``root`` whose ``plan.json`` is ``document`` (read
    back, or the compiler's own before it writes it)."""
    if document.io is None:
        raise BundleError(f"{str(root)!r} has no io section in its {PLAN_FILE}; recompile")
    io, memory = document.io, document.memory_mb()
    return BundleManifest(
        root=Path(root),
        model=document.plan["model"],
        inputs=tuple(t.name for t in io.inputs),
        outputs=tuple((t.name, t.value) for t in io.outputs),
        slices=tuple(
            BundleSlice(
                name=f.name,
                inputs=tuple(t.name for t in f.inputs),
                outputs=tuple(t.name for t in f.outputs),
                memory_mb=memory[f.name],
                codecs=f.codecs,
                dispatch=f.dispatch,
                called=f.rows,
            )
            for f in io.functions
        ),
        input_types={t.name: t for t in io.inputs},
        document=document,
    )


def read_manifest(root: Path) -> BundleManifest:
    """Read the bundle at ``root``; raise `BundleError` naming the fix when it is absent,
    stale, stopped early or lacks a function's files."""
    _contained(root, Path(root) / PLAN_FILE)
    document = read_document(root)
    if document.until:
        raise BundleError(
            f"bundle {str(root)!r} stops after stage {document.until!r} (mopar "
            f"compile --until {document.until}); compile it without --until "
            "to run it"
        )
    try:
        manifest = manifest_of(root, document)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as exc:
        raise BundleError(
            f"{str(Path(root) / PLAN_FILE)!r} is malformed ({type(exc).__name__}: {exc}); recompile"
        ) from None
    for s, entry in zip(manifest.slices, document.io.functions):
        # a function's files sit at fixed names in its folder; plan.json only says which exist
        files = (
            MODEL_FILE,
            *((WEIGHTS_FILE,) if entry.weights is not None else ()),
            *(
                f"{folder}/{MODEL_FILE}"
                for folder, experts in ((HOT_DIR, "hot"), (WARM_DIR, "warm"))
                if s.dispatch is not None and getattr(s.dispatch, experts)
            ),
        )
        for name in (*files, FUNCTION_FILE):
            _contained(root, manifest.function_dir(s) / name)
            if not (manifest.function_dir(s) / name).is_file():
                raise BundleError(
                    f"bundle is incomplete: {FUNCTIONS_DIR}/{s.name}/{name} is missing; recompile"
                )
    _contained(root, Path(root) / REFERENCE_FILE)
    return manifest


def _contained(root: Path, path: Path) -> None:
    """Refuse ``path`` where it, or a folder on its way, is a link that leaves the bundle at
    ``root``: a bundle is data, and `mopar run` reads nothing outside it."""
    inside = Path(root).resolve()
    if path.resolve() != inside and inside not in path.resolve().parents:
        relative = path.relative_to(root) if path.is_relative_to(root) else path
        raise BundleError(
            f"bundle {str(root)!r} links {str(relative)!r} to {str(path.resolve())!r}, outside "
            "the bundle; a bundle must hold its own files: copy them in, or recompile"
        )


def read_npz(path: Path, error: type[MoparError], name: Part) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` of numbers, never unpickled; anything else raises ``error``
    with a message naming the file as ``name``."""
    fix = "write it with numpy.savez(path, name=array, ...)"
    if not zipfile.is_zipfile(path):  # also a missing file; np.load would try to unpickle it
        what = "is not an .npz (a zip of .npy arrays)" if Path(path).exists() else "does not exist"
        raise error(name, f" {what}; {fix}")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise error(name, f" is not a readable .npz of arrays ({exc}); {fix}") from None
    for key, array in arrays.items():
        if not isinstance(array, np.ndarray) or array.dtype.kind not in "biuf":
            what = (
                f"holds {array.dtype} values, not numbers"
                if isinstance(array, np.ndarray)
                else "is not an .npy array"
            )
            raise error(name, f": {key!r} {what}; {fix}, of float, int or bool arrays")
    return arrays


def read_reference(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Split an ``.npz`` into inputs (``input.*`` or bare keys) and expected outputs (``output.*``)."""
    arrays = read_npz(path, BundleError, repr(str(path)))
    inputs = {k.removeprefix("input."): v for k, v in arrays.items() if not k.startswith("output.")}
    outputs = {k.removeprefix("output."): v for k, v in arrays.items() if k.startswith("output.")}
    return inputs, outputs
