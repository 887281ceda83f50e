"""A tensor in a file, as the profiler hands inputs to its measuring process
(`tools.profiler.probe`): one `mopar.runtime.wire` payload, written atomically."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from mopar.codec import Codec
from mopar.runtime.wire import decode, encode

__all__ = ["read_tensor", "write_tensor"]


def write_tensor(path: Path, array: np.ndarray, codec: str | Codec = "none") -> None:
    """Write ``array`` to ``path`` atomically: a temporary name in the same folder, then rename.

    Args:
        path: the file to (over)write.
        array: the tensor.
        codec: a codec or its name; the file records it, so `read_tensor` needs no hint.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(encode(array, codec))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_tensor(path: Path) -> np.ndarray:
    """Read a tensor written by `write_tensor`, validating its header before decoding it."""
    return decode(path.read_bytes())
