"""A ``.pt2``'s stored tensors as views of the file, mapped copy-on-write, not copies of it.

``torch.export.load`` reads every weight record into memory of its own: on a 1.08 GB bfloat16
decoder that is 1.16 GB of anonymous memory, the weights and 80 MB that it keeps after the
records are read. Mapped, the weights are the file's pages in the page cache, touched as capture
and export read them, and nothing more: the compile's child peaks 0.09x the weights lower
(docs/benchmarks.md). A page is copied only where something writes to it (``MAP_PRIVATE``).

`mapped_weights` gives torch's archive loader a mapping version of the one function that turns
weight and constant records into tensors (``_build_file_map`` of
``torch.export.pt2_archive._package``), for the length of one load. It maps only an archive whose
records are all stored (torch never compresses them), each at an offset its element size
divides; any other archive, or a torch whose function differs, loads as torch loads it.

Once a tensor's bytes are written elsewhere (the export's external data), `release` hands its pages
back to the kernel (``MADV_PAGEOUT``): the export then holds one weight at a time, not all of them,
and a later read of the tensor faults its pages in again from the file. A page something wrote to
is not dropped (without swap it stays; with swap it is swapped out).

The file must not be rewritten in place while the program lives (replacing it by a rename is
safe: the mapping keeps the old file), as for ``torch.load(..., mmap=True)``.
"""

from __future__ import annotations

import contextlib
import inspect
import mmap
import os
import sys
import weakref
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.export.pt2_archive import _package

__all__ = ["mapped_weights", "release"]

_LOADER = "_build_file_map"
_SIGNATURE = ("archive_reader", "config", "base_dir")
_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21)  # Linux 5.4 and later; Python 3.11 lacks the name


@dataclass(frozen=True)
class _Mapping:
    view: weakref.ref[mmap.mmap]
    start: int  # its first byte's address
    length: int


_MAPPINGS: list[_Mapping] = []
"""The files `mapped_weights` mapped, while a tensor still holds them (`release` reads it)."""


@contextlib.contextmanager
def mapped_weights(path: Path) -> Iterator[bool]:
    """While it is open, ``torch.export.load(path)`` makes its weight and constant tensors views
    of ``path`` mapped copy-on-write. Yields whether it does (False: torch reads them)."""
    original = getattr(_package, _LOADER, None)
    if original is None or tuple(inspect.signature(original).parameters) != _SIGNATURE:
        yield False
        return
    with zipfile.ZipFile(path) as archive:
        if any(info.compress_type != zipfile.ZIP_STORED for info in archive.infolist()):
            yield False
            return
    with open(path, "rb") as file:
        view = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    setattr(_package, _LOADER, _mapping(view, original))
    try:
        yield True
    finally:
        setattr(_package, _LOADER, original)


def _mapping(view: mmap.mmap, original: Callable[..., dict[str, torch.Tensor]]) -> Callable:
    def build_file_map(archive_reader: Any, config: Any, base_dir: str) -> dict[str, torch.Tensor]:
        reader = archive_reader.archive_file
        records = {
            meta.path_name: meta.tensor_meta
            for meta in config.config.values()
            if not meta.use_pickle
        }
        placed: dict[str, tuple[Any, torch.dtype, int, int]] = {}
        for name, meta in records.items():
            if meta is None:  # torch's own loader says what is wrong
                return original(archive_reader, config, base_dir)
            record = os.path.join(base_dir, name)
            dtype = _package.deserialize_scalar_type(meta.dtype)
            offset, size = reader.get_record_offset(record), reader.get_record_size(record)
            if offset % dtype.itemsize or size % dtype.itemsize:
                return original(archive_reader, config, base_dir)
            placed[name] = (meta, dtype, offset, size)
        tensors = {name: _tensor(view, *where) for name, where in placed.items()}
        _remember(view, tensors.values(), placed.values())
        return tensors

    return build_file_map


def _tensor(view: mmap.mmap, meta: Any, dtype: torch.dtype, offset: int, size: int) -> torch.Tensor:
    """One record's tensor, flat as torch's own loader makes it."""
    if size == 0:
        tensor = torch.zeros(_package.deserialize_size(meta.sizes), dtype=dtype)
    else:
        tensor = torch.frombuffer(view, dtype=dtype, count=size // dtype.itemsize, offset=offset)
    device = _package.deserialize_device(meta.device)
    if device != torch.device("cpu"):
        tensor = tensor.to(device)
    return tensor.requires_grad_(True) if meta.requires_grad else tensor


def _remember(view: mmap.mmap, tensors: Iterable[torch.Tensor], placed: Iterable[tuple]) -> None:
    for tensor, (_, _, offset, size) in zip(tensors, placed, strict=True):
        if size:
            start = tensor.untyped_storage().data_ptr() - offset
            _MAPPINGS[:] = [m for m in _MAPPINGS if m.view() is not None and m.start != start]
            _MAPPINGS.append(_Mapping(weakref.ref(view), start, len(view)))
            return


def release(tensor: torch.Tensor) -> bool:
    """Hand back to the kernel the pages of ``tensor``'s storage, where `mapped_weights` mapped it
    from a file, that nothing wrote to; its values stay, read from the file again at the next
    use. Returns whether it is such a tensor (False: nothing is done)."""
    storage = tensor.untyped_storage()
    address, nbytes = storage.data_ptr(), storage.nbytes()
    for mapping in _MAPPINGS:
        view = mapping.view()
        if view is None or not mapping.start <= address < mapping.start + mapping.length:
            continue
        first = -(-(address - mapping.start) // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (address - mapping.start + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > first and sys.platform == "linux":
            with contextlib.suppress(OSError):  # a kernel before 5.4: the pages stay
                view.madvise(_PAGEOUT, first, end - first)
        return True
    return False
