"""Reusable shared-memory tensor buffers: one file per edge and request slot, mapped once.

The shm runner (`mopar.runner.shm_session`) hands a tensor from one process to the next through a
file in its per-run tmpfs folder. Creating, writing and unlinking a fresh file per request costs
a page fault per page every time; here each file is created once, grown (never shrunk) when a
larger payload comes, kept mapped by both ends, and overwritten in place by the next request in
its slot. Writers copy straight into the mapping (`mopar.runtime.wire.write_into`); readers get a
numpy view over it (`read_from`), which onnxruntime takes without a further copy.

Ordering is the caller's: a slot is written only when no process still reads it (the runner's
pipes say when).

A file's pages are allocated when it grows, before they are mapped (`posix_fallocate`): a page
of a full tmpfs first touched through a mapping is a SIGBUS that kills the process, where this
is a `ShmFullError` that says how to make room.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import numpy as np

from mopar.errors import ShmFullError
from mopar.runtime.wire import DATA_OFFSET, prepare_payload, read_from, write_into

__all__ = ["BufferPool", "no_room"]

_PAGE = mmap.PAGESIZE


def _round_up(n: int) -> int:
    return max(_PAGE, -(-n // _PAGE) * _PAGE)


def _allocate(fd: int, size: int, folder: Path) -> None:
    """Grow the file ``fd`` in ``folder`` to ``size`` bytes, all of them allocated.

    Raises:
        ShmFullError: the file system has no room for them.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise no_room(folder, f"a tensor buffer of {size} bytes") from None


def no_room(folder: Path, what: str) -> ShmFullError:
    """The error of a full tmpfs: ``folder`` had no room for ``what``; how to make room."""
    existing = Path(os.path.realpath(folder))
    while not existing.exists():
        existing = existing.parent
    mount = existing
    while not os.path.ismount(mount):
        mount = mount.parent
    stat = os.statvfs(existing)
    return ShmFullError(
        f"no room in {folder} for {what} "
        f"({stat.f_bavail * stat.f_frsize} bytes free on {mount}); free space on {mount} or "
        f"make it larger (`mount -o remount,size=2g {mount}`, or `docker run --shm-size=2g`)"
    )


class _Mapped:
    """One file kept open and mapped; remapped when it has grown."""

    def __init__(self, path: Path) -> None:
        self.folder = path.parent
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.map: mmap.mmap | None = None
        self.view: memoryview | None = None
        self.size = 0

    def remap(self, size: int) -> memoryview:
        if os.fstat(self.fd).st_size < size:
            _allocate(self.fd, size, self.folder)
        size = os.fstat(self.fd).st_size
        if size and size != self.size:
            # An old map may still back arrays handed out; it is dropped, not closed, and goes
            # when they do.
            self.map = mmap.mmap(self.fd, size)
            self.view = memoryview(self.map)
            self.size = size
        return self.view

    def close(self) -> None:
        os.close(self.fd)


class BufferPool:
    """The buffers one process uses in a folder, by file name (the name was checked by the caller)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._files: dict[str, _Mapped] = {}

    def _mapped(self, name: str) -> _Mapped:
        m = self._files.get(name)
        if m is None:
            m = self._files[name] = _Mapped(self.folder / name)
        return m

    def write(self, name: str, array: np.ndarray, codec: str = "none") -> None:
        """Write ``array`` (encoded with ``codec``) into the buffer ``name``, growing it if needed.

        Raises:
            ShmFullError: the folder's file system has no room to grow the buffer.
        """
        array, codec_obj, section = prepare_payload(array, codec)
        length = array.nbytes if section is None else len(section)
        m = self._mapped(name)
        view = (
            m.view if m.size >= DATA_OFFSET + length else m.remap(_round_up(DATA_OFFSET + length))
        )
        write_into(view, array, codec_obj, section)

    def read(self, name: str) -> np.ndarray:
        """The tensor in buffer ``name``: a view over it for codec none, valid until it is rewritten."""
        m = self._mapped(name)
        view = m.view if m.size else m.remap(0)
        if view is None or m.size < DATA_OFFSET:
            raise FileNotFoundError(f"buffer {name} holds no tensor")
        try:
            return read_from(view)
        except Exception:
            # The writer may have grown the file since this end mapped it.
            size = os.fstat(m.fd).st_size
            if size == m.size:
                raise
            return read_from(m.remap(size))

    def keep_only(self, names: set[str]) -> None:
        """Let go of every buffer but ``names``: their mappings go once no array uses them.

        A worker keeps only its current request's buffers, so its resident memory holds one
        request's tensors however many request slots the run has, as a function's would.
        """
        for name in [n for n in self._files if n not in names]:
            self._files.pop(name).close()

    def close(self) -> None:
        for m in self._files.values():
            m.close()
        self._files.clear()
