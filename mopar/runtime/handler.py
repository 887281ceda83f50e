"""mopar slice handler: runs one ONNX slice with onnxruntime.

This file is copied verbatim into every function of a bundle (``functions/<slice>/handler.py``)
and is what `mopar run` executes locally, so it imports only numpy and onnxruntime -- never torch,
never the compiler.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

__all__ = [
    "SliceHandler",
    "handler_class",
    "session_options",
    "fix_mmap_threshold",
    "threads_for",
    "SESSION_FILE",
    "saved_settings",
    "open_session",
]

SESSION_FILE = "session.json"
"""Beside a function's ``model.onnx``, where its session differs from the defaults: the
`session_options` keywords the compiler chose for its graph (`mopar.emit.session`)."""

_DTYPES = {
    "tensor(float)": "float32",
    "tensor(double)": "float64",
    "tensor(float16)": "float16",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int16)": "int16",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
}
"""numpy's name of each ONNX input type a request can carry."""

MMAP_THRESHOLD = 0
"""Bytes from which glibc serves an allocation by mmap (and returns it at free), when set; see
`fix_mmap_threshold`. 0 (the default) leaves glibc's own, which is faster; the
``MOPAR_MMAP_THRESHOLD`` environment variable of a function sets it."""


def fix_mmap_threshold(default: int = MMAP_THRESHOLD) -> int:
    """Pin glibc's mmap threshold, so that freed activations go back to the kernel.

    glibc starts at 128 KB but raises the threshold (up to 32 MB) each time a mapped block is
    freed; from then on blocks of that size come from the heap, which keeps them when they are
    freed. With the arena off, every run allocates its activations afresh, so a slice's RSS
    creeps up to several times its live tensors (a BERT-small slice: 320 MB for 111 MB).
    Setting the threshold with ``mallopt`` turns the raising off: measured on that slice's
    bundle (batch 8, 256 tokens, 11 functions, runs interleaved with the default), the sum of
    peak RSS fell to 0.52-0.65x, and p50 rose 1.11-1.14x (each run's activations are faulted in
    afresh). Hence off by default: set it where memory costs more than latency; the compiler
    sets it (``default``, from `SESSION_FILE`) for functions of large weights. Returns the
    threshold set, 0 when none was (not glibc, or not asked for).
    """
    import ctypes
    import ctypes.util

    value = int(os.environ.get("MOPAR_MMAP_THRESHOLD", default))
    if value <= 0:  # before find_library, which forks ldconfig: not on every cold start
        return 0
    name = ctypes.util.find_library("c")
    if not name:
        return 0
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return 0
    return value if mallopt(-3, value) == 1 else 0  # -3: M_MMAP_THRESHOLD


def threads_for(vcpus: float) -> int:
    """The onnxruntime intra-op threads of a function limited to ``vcpus``: one per whole vCPU,
    at least one (a thread beyond the CPU quota only waits for it, and a share below one vCPU
    slows the whole process alike, however many threads it has)."""
    return max(1, int(vcpus + 1e-9))


def session_options(
    intra_op_threads: int = 0,
    *,
    prepacking: bool = True,
    layouts: bool = True,
) -> ort.SessionOptions:
    """The onnxruntime options every slice runs under (the profiler measures under them too).

    Args:
        intra_op_threads: threads per operator; 0 lets onnxruntime choose (its default is the
            number of physical cores).
        prepacking: let MatMul and Gemm copy their constant weights into their kernels' layout.
        layouts: graph optimisations at ``all`` (the NCHWc layout, which copies convolution
            weights), else at ``extended``.
    """
    opts = ort.SessionOptions()
    opts.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if layouts
        else ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    )
    if not prepacking:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    # The arena keeps freed activation memory for reuse; a function sized to its peak is
    # better served by returning it, so peak RSS stays close to the live tensors.
    opts.enable_cpu_mem_arena = False
    opts.intra_op_num_threads = intra_op_threads
    # Idle intra-op threads otherwise spin for a while after each run, taking the CPU away
    # from the next slice when slices share cores (locally, or co-located pods).
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3
    return opts


def open_session(
    model: Path,
    intra_op_threads: int,
    settings: dict[str, bool | int],
    *,
    profile_prefix: str | None = None,
) -> ort.InferenceSession:
    """The session of graph ``model`` under `saved_settings` ``settings`` (``mmap_threshold``
    aside: the process's, `fix_mmap_threshold`). ``folding`` False (a graph whose 16-bit
    weights are cast where used) makes it without constant folding, which would widen them all
    to float32 at load. ``profile_prefix``: profile its nodes into files of that prefix."""
    opts = session_options(
        intra_op_threads,
        prepacking=bool(settings.get("prepacking", True)),
        layouts=bool(settings.get("layouts", True)),
    )
    if profile_prefix is not None:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    off = [] if settings.get("folding", True) else ["ConstantFolding"]
    return ort.InferenceSession(
        str(model), opts, providers=["CPUExecutionProvider"], disabled_optimizers=off
    )


def saved_settings(path: Path) -> dict[str, bool | int]:
    """The settings of ``path`` (`SESSION_FILE`; none where it is absent)."""
    if not path.is_file():
        return {}
    try:
        settings = json.loads(path.read_text())
    except ValueError:
        settings = None
    kinds = {"prepacking": bool, "layouts": bool, "folding": bool, "mmap_threshold": int}
    if not isinstance(settings, dict) or not all(
        type(v) is kinds.get(k) for k, v in settings.items()
    ):
        raise ValueError(f"{str(path)!r} is not session settings: recompile the bundle")
    return settings


class SliceHandler:
    """Load ``model.onnx`` from a function folder and run it on named arrays."""

    def __init__(self, function_dir: str | os.PathLike, *, intra_op_threads: int = 0) -> None:
        model = Path(function_dir) / "model.onnx"
        settings = saved_settings(model.with_name(SESSION_FILE))
        self.mmap_threshold = fix_mmap_threshold(int(settings.pop("mmap_threshold", 0)))
        try:
            self.session = open_session(model, intra_op_threads, settings)
        except Exception as exc:  # onnxruntime raises its own types (InvalidProtobuf, Fail, ...)
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise ValueError(
                f"onnxruntime cannot load {str(model)!r} ({reason}); the file is "
                "damaged or incomplete: recompile the bundle"
            ) from None
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]

    def handle(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the slice; raise ValueError naming the tensor if an input is missing, of another
        dtype or misshapen."""
        feed = {}
        for name, meta in self.inputs.items():
            if name not in inputs:
                raise ValueError(
                    f"missing input tensor {name!r}; the slice needs {list(self.inputs)}"
                )
            array = inputs[name]
            if _DTYPES.get(meta.type, array.dtype.name) != array.dtype.name:
                raise ValueError(
                    f"input {name!r} is {array.dtype.name}, expected {_DTYPES[meta.type]}"
                )
            want = [d if isinstance(d, int) else None for d in meta.shape]
            if len(want) != array.ndim or any(
                w is not None and w != g for w, g in zip(want, array.shape)
            ):
                raise ValueError(
                    f"input {name!r} has shape {list(array.shape)}, expected {meta.shape}"
                )
            feed[name] = array
        results = self.session.run(self.output_names, feed)
        return dict(zip(self.output_names, results))


def handler_class() -> type:
    """The class that runs a slice: `SliceHandler`, or, where the environment's
    ``MOPAR_HANDLER`` names a Python file, the ``SliceHandler`` that file defines.

    A hook for fault injection (the tests' failing, hanging and dying slices) and for debugging.
    It comes from whoever starts the process, never from a bundle: `mopar run` runs no code a
    bundle ships.
    """
    path = os.environ.get("MOPAR_HANDLER", "")
    if not path:
        return SliceHandler
    import importlib.util

    spec = importlib.util.spec_from_file_location("mopar_handler_override", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"MOPAR_HANDLER={path!r} is not a Python file; unset it")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SliceHandler
