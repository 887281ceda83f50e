"""Read a bundle's manifest (``plan.json``) without the compiler: plain JSON, no torch."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mopar.codec import CodecError, get_codec
from mopar.errors import BundleError, InputSpecError, MoparError, Part
from mopar.runtime.dispatch import HOT_DIR, WARM_DIR
from mopar.runtime.function import FUNCTION_NAME_RE

__all__ = [
    "BUNDLE_FORMAT_VERSION",
    "WEIGHTS_FILE",
    "BundleSlice",
    "BundleManifest",
    "read_manifest",
    "read_npz",
    "read_reference",
]

BUNDLE_FORMAT_VERSION = 2
"""2: the plan is a graph (plan format 3: functions and edges), ``io.functions``."""
WEIGHTS_FILE = "model.onnx.data"
"""A function's weights, beside its ``model.onnx``, when it has any (ONNX external data)."""


@dataclass(frozen=True, kw_only=True)
class BundleSlice:
    """A slice as the runtime sees it: its folder, tensors in and out, and allocated memory (MB).

    Attributes:
        codecs: the codec name (`mopar.codec.get_codec`) each output tensor is written with;
            an output not named here is written raw (codec none).
        dispatch: a dispatch function's layer (`mopar.runtime.dispatch.DispatchSpec` as a
            dict): it calls the expert functions its ``callees`` name, and its model is the
            rest of the layer, run on their summed answers.
        called: an expert function, run only when its dispatch calls it.
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    memory_mb: int
    codecs: Mapping[str, str] = field(default_factory=dict)
    dispatch: Mapping | None = None
    called: bool = False


@dataclass(frozen=True, kw_only=True)
class BundleManifest:
    """What `mopar run` needs from ``plan.json``.

    Attributes:
        root: the bundle folder.
        model: the model's name.
        inputs: public names of the model inputs (also their value names).
        outputs: (public name, value name) of each model output.
        slices: the slices in topological order.
        input_types: name -> (shape, dtype name) of each model input, as compiled.
    """

    root: Path
    model: str
    inputs: tuple[str, ...]
    outputs: tuple[tuple[str, str], ...]
    slices: tuple[BundleSlice, ...]
    input_types: Mapping[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)

    def check_inputs(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Refuse inputs the bundle cannot take before any slice starts.

        Raises:
            InputSpecError: an input is missing, or its shape or dtype is not the compiled one.
        """
        missing = [n for n in self.inputs if n not in arrays]
        if missing:
            raise InputSpecError(
                f"input file lacks {missing}; the bundle's inputs are {list(self.inputs)}"
            )
        for name, (shape, dtype) in self.input_types.items():
            got = arrays[name]
            if tuple(got.shape) != tuple(shape) or got.dtype.newbyteorder("=") != np.dtype(dtype):
                raise InputSpecError(
                    f"input {name!r} is {got.dtype.name} {list(got.shape)}, and the bundle was "
                    f"compiled for {dtype} {list(shape)}; pass arrays of that shape and dtype, "
                    "or recompile with this input"
                )

    def function_dir(self, s: BundleSlice) -> Path:
        return self.root / "functions" / s.name


def read_manifest(root: Path) -> BundleManifest:
    """Parse ``root/plan.json``; raise `BundleError` naming the fix when it is absent or stale."""
    path = Path(root) / "plan.json"
    if not Path(root).is_dir():
        raise BundleError(f"bundle {str(root)!r} does not exist; create it with `mopar compile`")
    if not path.is_file():
        raise BundleError(
            f"{str(root)!r} has no plan.json, so it is not a mopar bundle; "
            "create it with `mopar compile MODEL --out DIR`"
        )
    try:
        data = json.loads(path.read_text())
        version = data["bundle_format_version"]
        if version != BUNDLE_FORMAT_VERSION:
            raise BundleError(
                f"bundle format {version} is not supported (expected "
                f"{BUNDLE_FORMAT_VERSION}); recompile with this mopar"
            )
        if data.get("until"):
            raise BundleError(
                f"bundle {str(root)!r} stops after stage {data['until']!r} (mopar "
                f"compile --until {data['until']}); compile it without --until "
                "to run it"
            )
        io = data["io"]
        memory = {f["name"]: f["memory_mb"] for f in data["plan"]["functions"]}
        _check_functions(path, [s["name"] for s in io["functions"]], memory)
        _check_verification(path, data.get("verification", {}))
        slices = tuple(
            BundleSlice(
                name=s["name"],
                inputs=tuple(t["name"] for t in s["inputs"]),
                outputs=tuple(t["name"] for t in s["outputs"]),
                memory_mb=memory[s["name"]],
                codecs=_codecs(s),
                dispatch=s.get("dispatch"),
                called=bool(s.get("rows")),
            )
            for s in io["functions"]
        )
        manifest = BundleManifest(
            root=Path(root),
            model=data["plan"]["model"],
            inputs=tuple(t["name"] for t in io["inputs"]),
            outputs=tuple((t["name"], t["value"]) for t in io["outputs"]),
            slices=slices,
            input_types={
                t["name"]: (tuple(int(d) for d in t["shape"]), np.dtype(str(t["dtype"])).name)
                for t in io["inputs"]
                if "shape" in t and "dtype" in t
            },
        )
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise BundleError(
            f"{str(path)!r} is malformed ({type(exc).__name__}: {exc}); recompile"
        ) from None
    for s, entry in zip(manifest.slices, io["functions"]):
        # a function's files sit at fixed names in its folder; plan.json only says which exist
        files = (
            "model.onnx",
            *((WEIGHTS_FILE,) if "weights" in entry else ()),
            *(
                f"{folder}/model.onnx"
                for folder, key in ((HOT_DIR, "hot"), (WARM_DIR, "warm"))
                if (s.dispatch or {}).get(key)
            ),
        )
        for name in files:
            if not (manifest.function_dir(s) / name).is_file():
                raise BundleError(
                    f"bundle is incomplete: functions/{s.name}/{name} is missing; recompile"
                )
    return manifest


def _check_functions(path: Path, names: list, memory: dict) -> None:
    """Each function ``io`` lists is a folder name and has a positive ``memory_mb`` in the plan."""
    for name in names:
        if not isinstance(name, str) or not FUNCTION_NAME_RE.match(name):
            raise BundleError(
                f"{str(path)!r} names function {name!r}, which is not a folder "
                f"name (expected {FUNCTION_NAME_RE.pattern}); recompile"
            )
        if name not in memory:
            raise BundleError(
                f"{str(path)!r} lists function {name!r} in io.functions, but the "
                f"plan has only {sorted(memory)}; recompile"
            )
        mb = memory[name]
        if type(mb) not in (int, float) or not mb > 0:  # NaN too
            raise BundleError(
                f"{str(path)!r} gives function {name} memory_mb {mb!r}, expected a "
                "positive number of MB; recompile"
            )


def _check_verification(path: Path, verification) -> None:
    """The tolerances `mopar run --check` takes from ``verification`` are numbers."""
    if not isinstance(verification, dict) or not all(
        type(verification.get(k, 0.0)) in (int, float) for k in ("rtol", "atol")
    ):
        raise BundleError(
            f"{str(path)!r} has verification {verification!r}, expected an object "
            "with numbers rtol and atol; recompile"
        )


def _codecs(s: dict) -> dict[str, str]:
    """A slice's ``codecs`` (absent: none), checked against its outputs and their dtypes."""
    given = s.get("codecs", {})
    if not isinstance(given, dict):
        raise BundleError(
            f"slice {s['name']}: codecs must map tensor names to codec names, "
            f"got {given!r}; fix plan.json or recompile"
        )
    dtypes = {t["name"]: t.get("dtype") for t in s["outputs"]}
    codecs = {}
    for tensor, name in given.items():
        if tensor not in dtypes:
            raise BundleError(
                f"slice {s['name']}: codecs names {tensor!r}, which is not one of "
                f"its outputs {list(dtypes)}; fix plan.json or recompile"
            )
        try:
            codec = get_codec(name)
        except CodecError as exc:
            raise BundleError(
                f"slice {s['name']}, tensor {tensor!r}: {exc}; fix plan.json or recompile"
            ) from None
        dtype = dtypes[tensor]
        if dtype is not None and not codec.supports(np.dtype(dtype)):
            raise BundleError(
                f"slice {s['name']}: codec {codec.name} cannot carry {tensor!r}, "
                f"a {dtype} tensor; use none or zstd for it in plan.json"
            )
        codecs[tensor] = codec.name
    return codecs


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
