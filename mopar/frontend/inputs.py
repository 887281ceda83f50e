"""Example inputs: parse ``--input NAME=1x3x224x224:float32`` specs and ``--example-inputs FILE.npz``.

Specs are parsed into frozen `InputSpec` values at the CLI boundary; tensors are only materialised
by `make_example_inputs`, with a fixed seed so that compiles are reproducible.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from mopar.errors import InputSpecError, Option, Part
from mopar.runner.bundle import read_npz

__all__ = [
    "InputSpec",
    "parse_input_spec",
    "make_example_arrays",
    "load_example_npz",
    "fit_example_npz",
    "DTYPES",
]

# Name -> numpy dtype. Kept small on purpose: these are the dtypes a serving request carries.
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "float64": np.dtype(np.float64),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "bool": np.dtype(np.bool_),
}

_SPEC_RE = re.compile(
    r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<shape>\d+(?:x\d+)*)?:(?P<dtype>[a-z0-9]+)"
    r"(?::(?P<low>-?\d+)\.\.(?P<high>-?\d+))?$"
)
_EXAMPLE = "x=1x3x224x224:float32 or input_ids=1x128:int64:0..30000"


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """One model input, as given by ``--input``.

    Attributes:
        name: the forward() argument name.
        shape: dimensions, outermost first (``()`` for a scalar).
        dtype: a key of `DTYPES`.
        low: inclusive lower bound of random integer values (integer dtypes only).
        high: exclusive upper bound of random integer values (integer dtypes only).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    low: int = 0
    high: int = 2

    def __str__(self) -> str:
        shape = "x".join(str(d) for d in self.shape)
        rng = f":{self.low}..{self.high}" if self.dtype.startswith("int") else ""
        return f"{self.name}={shape}:{self.dtype}{rng}"


_INPUT = Option("example_args", cli="input")
"""The CLI's ``--input``: example inputs as spec strings."""

_NPZ = Option("example_args", cli="example-inputs")
"""The CLI's ``--example-inputs``: example inputs as an ``.npz``."""


def _bad(text: str) -> tuple[Part, ...]:
    return ("bad ", _INPUT, f" spec {text!r}:")


def parse_input_spec(text: str) -> InputSpec:
    """Parse ``NAME=DIMxDIM:DTYPE[:LOW..HIGH]``; raise `InputSpecError` naming the fix.

    ``LOW..HIGH`` bounds random integer values, HIGH exclusive (default ``0..2``).
    """
    m = _SPEC_RE.match(text.strip())
    if m is None:
        raise InputSpecError(*_bad(text), f" expected NAME=DIMxDIM...:DTYPE, e.g. {_EXAMPLE}")
    dtype = m["dtype"]
    if dtype not in DTYPES:
        raise InputSpecError(*_bad(text), f" dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    shape = tuple(int(d) for d in m["shape"].split("x")) if m["shape"] else ()
    if any(d == 0 for d in shape):
        raise InputSpecError(*_bad(text), " every dimension must be at least 1")
    low, high = (int(m["low"]), int(m["high"])) if m["low"] is not None else (0, 2)
    if m["low"] is not None and not dtype.startswith("int"):
        raise InputSpecError(*_bad(text), " a LOW..HIGH range needs an int dtype")
    if high <= low:
        raise InputSpecError(*_bad(text), f" range {low}..{high} is empty (HIGH is exclusive)")
    if dtype.startswith("int"):
        info = np.iinfo(DTYPES[dtype])
        if low < info.min or high - 1 > info.max:
            raise InputSpecError(
                *_bad(text),
                f" range {low}..{high} does not fit {dtype} "
                f"([{info.min}, {info.max}]); narrow the range or use int64",
            )
    spec = InputSpec(name=m["name"], shape=shape, dtype=dtype, low=low, high=high)
    _check_fits((spec,), _bad(text))
    return spec


def _check_fits(specs: tuple[InputSpec, ...], said: tuple[Part, ...]) -> None:
    """Refuse example inputs larger than this machine's memory, before they are allocated."""
    import psutil

    nbytes = sum(math.prod(s.shape) * DTYPES[s.dtype].itemsize for s in specs)
    memory = psutil.virtual_memory().total
    if nbytes > memory:
        raise InputSpecError(
            *said,
            f" {nbytes:.3g} bytes of example inputs is more than this machine's memory "
            f"({memory / (1 << 30):.1f} GB); give the shape the model takes, e.g. {_EXAMPLE}",
        )


def make_example_arrays(specs: tuple[InputSpec, ...], *, seed: int = 0) -> dict[str, np.ndarray]:
    """Materialise specs as seeded random arrays (normal floats, uniform ints in [low, high))."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise InputSpecError(_INPUT, f" names must be unique, got {names}")
    _check_fits(specs, (_INPUT, ":"))
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for spec in specs:
        dtype = DTYPES[spec.dtype]
        if dtype.kind == "f":
            out[spec.name] = rng.standard_normal(spec.shape).astype(dtype)
        elif dtype.kind == "b":
            out[spec.name] = rng.integers(0, 2, spec.shape).astype(bool)
        else:
            out[spec.name] = rng.integers(spec.low, spec.high, spec.shape).astype(dtype)
    return out


def load_example_npz(path: Path) -> dict[str, np.ndarray]:
    """Read example inputs from an ``.npz`` (keys are forward() argument names)."""
    if not path.is_file():
        raise InputSpecError(_NPZ, f" file {str(path)!r} does not exist")
    arrays = read_npz(path, InputSpecError, replace(_NPZ, value=str(path), quoted=True))
    arrays = {k.removeprefix("input."): v for k, v in arrays.items() if not k.startswith("output.")}
    if not arrays:
        raise InputSpecError(replace(_NPZ, value=str(path), quoted=True), " holds no arrays")
    return arrays


def fit_example_npz(
    arrays: dict[str, np.ndarray], wanted: dict[str, tuple[int, ...] | None], source: str
) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    """Read an .npz's ``arrays`` as the example inputs a user meant, and say what was assumed.

    ``wanted`` maps the model's input names, in order, to the shape each was exported for (None:
    any). One array whose key names no input is the first input. An array of N samples along
    the batch axis of an input exported for batch 1, (N, C, H, W) for (1, C, H, W), gives its
    first sample.
    """
    notes = []
    if len(arrays) == 1 and wanted and not set(arrays) & set(wanted):
        ((key, value),), name = arrays.items(), next(iter(wanted))
        arrays = {name: value}
        notes.append(f"example inputs: read the one array {key!r} of {source} as input {name!r}")
    fitted = dict(arrays)
    for name, shape in wanted.items():
        got = fitted.get(name)
        if got is None or shape is None or got.shape == shape:
            continue
        if got.ndim == len(shape) >= 1 and shape[0] == 1 and got.shape[1:] == shape[1:]:
            fitted[name] = got[:1]
            notes.append(
                f"example inputs: took the first of the {got.shape[0]} samples of {name} "
                f"in {source}; the model was exported for batch 1"
            )
    return fitted, tuple(notes)
