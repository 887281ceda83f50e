"""The model's weights out of the compiler's memory while its functions are served.

Serving a plan starts one process per function, and together they hold every weight of the
model again. For a model whose weights are a large part of the machine's memory, the
compiler's own torch copy then doubles the compile's peak. `released` writes every weight
tensor the compile holds (the captured graph's, each unit's, the experts', and every other live
tensor on one of their storages) to one scratch file, empties the tensors in place, and puts
them back when the block ends: the same tensor objects, so every module that shares them sees
them again. A storage is freed only when every tensor on it is emptied, so all are; the
tensors that shared a storage share the one it is read back into.

Small models are left alone (`RELEASE_FROM_MB`): the write and the read back cost more than
the memory is worth.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mopar.pipeline.serving import RELEASE_FROM_MB
from mopar.runner.worker import trim_heap

__all__ = ["released", "weight_tensors"]

log = logging.getLogger(__name__)

MB = float(1 << 20)


def weight_tensors(roots: Iterable[Any]) -> list[torch.Tensor]:
    """Every distinct tensor object held as a parameter, buffer or tensor attribute of the
    modules in ``roots`` (modules, or mappings and sequences of them), by identity."""
    found: dict[int, torch.Tensor] = {}

    def visit(obj: Any) -> None:
        if isinstance(obj, nn.Module):
            for module in obj.modules():
                for value in (
                    *module._parameters.values(),
                    *module._buffers.values(),
                    *module.__dict__.values(),
                ):
                    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                        found.setdefault(id(value), value)
        elif isinstance(obj, dict):
            for value in obj.values():
                visit(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                visit(value)

    for root in roots:
        visit(root)
    return list(found.values())


@contextlib.contextmanager
def released(
    roots: Iterable[Any], scratch: Path, *, from_mb: float = RELEASE_FROM_MB
) -> Iterator[float]:
    """Inside the block, the weights of ``roots`` (`weight_tensors`) are on disk in a file
    under ``scratch`` and their tensors are empty; they are read back on every exit path.
    Yields the MB released (0: under ``from_mb``, nothing was done)."""
    tensors = [t for t in weight_tensors(roots) if t.numel()]
    if sum(t.numel() * t.element_size() for t in tensors) / MB < from_mb:
        yield 0.0
        return
    tensors = _sharing(tensors)
    storages = _storages(tensors)
    total = sum(nbytes for nbytes, _ in storages.values()) / MB
    with tempfile.TemporaryDirectory(dir=scratch, prefix=".weights-") as folder:
        path = Path(folder) / "weights.bin"
        views = _write(storages, path)
        with torch.no_grad():
            for t in tensors:
                t.set_(torch.empty(0, dtype=t.dtype))
        trim_heap()
        log.info("released %.0f MB of weights to %s while the functions are served", total, path)
        try:
            yield total
        finally:
            _read(views, path)


def _sharing(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` and every other live tensor object on one of their storages (the loaded
    program's own state dict, a module's copy of the same parameter): a storage is freed
    only when no tensor holds it."""
    storages = {_storage(t) for t in tensors}
    found = {id(t): t for t in tensors}
    for obj in gc.get_objects():  # plain tensors and parameters: a fake tensor has no storage
        if type(obj) in (torch.Tensor, nn.Parameter) and id(obj) not in found and obj.numel():
            with contextlib.suppress(RuntimeError, NotImplementedError):
                if obj.device.type == "cpu" and _storage(obj) in storages:
                    found[id(obj)] = obj
    return list(found.values())


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _storages(tensors: list[torch.Tensor]) -> dict[int, tuple[int, list[torch.Tensor]]]:
    """Each storage (by address): its bytes, and the tensors on it."""
    found: dict[int, tuple[int, list[torch.Tensor]]] = {}
    for t in tensors:
        found.setdefault(_storage(t), (t.untyped_storage().nbytes(), []))[1].append(t)
    return found


_View = tuple[torch.Tensor, int, torch.Size, tuple[int, ...]]  # tensor, offset, size, stride


def _write(
    storages: dict[int, tuple[int, list[torch.Tensor]]], path: Path
) -> list[tuple[int, int, list[_View]]]:
    """Each storage's bytes, one after another; returns (offset in the file, bytes, the views
    of it) of each, a view being what `torch.Tensor.set_` needs to put a tensor back on it."""
    layout, offset = [], 0
    with path.open("wb") as f:
        for nbytes, tensors in storages.values():
            whole = torch.empty(0, dtype=torch.uint8).set_(tensors[0].untyped_storage())
            f.write(memoryview(whole.numpy()))
            views = [(t, t.storage_offset(), t.shape, t.stride()) for t in tensors]
            layout.append((offset, nbytes, views))
            offset += nbytes
    return layout


def _read(layout: list[tuple[int, int, list[_View]]], path: Path) -> None:
    """Each storage read back into memory of its own, its tensors on it as they were (two
    tensors that shared a storage share the new one)."""
    with path.open("rb") as f, torch.no_grad():
        for offset, nbytes, views in layout:
            f.seek(offset)
            raw = bytearray(nbytes)  # the storage from now on (frombuffer keeps it alive)
            f.readinto(raw)
            storage = torch.frombuffer(raw, dtype=torch.uint8).untyped_storage()
            for t, at, size, stride in views:
                t.set_(storage, at, size, stride)
