"""Files and folders mopar writes: their modes, who owns a scratch folder, and what a written
folder holds.

Three concerns, in this order:

- Modes and atomic writes: `tempfile.mkstemp` makes a file 0600 and `tempfile.mkdtemp` a folder 0700, whatever the
  umask: right for a secret, wrong for a bundle or a chart that is renamed into place for others
  to read (`as_if_made`).
- Owned folders: a scratch or staging folder carries its owner's PID and lock (`owned_folder`),
  so that a later process removes the ones a killed process left (`sweep_leftovers`) and
  nothing else.
- Records: a folder mopar wrote lists its files (`record_files`), so that replacing it later
  (``--force``) can tell that it holds nothing mopar did not write (`unrecorded`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "OWNER_FILE",
    "RECORD_FILE",
    "OwnedFolder",
    "as_if_made",
    "owned_folder",
    "record_files",
    "sweep_leftovers",
    "umask",
    "unrecorded",
]

log = logging.getLogger(__name__)


def umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``/proc``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere the only way to read it is to set it, and set it back
    os.umask(mask)
    return mask


def as_if_made(path: str | os.PathLike[str]) -> None:
    """Give ``path`` the mode ``mkdir`` (a folder) or ``open`` (a file) gives under the umask:
    0o777 or 0o666 less the umask's bits."""
    full = 0o777 if Path(path).is_dir() else 0o666
    os.chmod(path, full & ~umask())


# --- folders a process owns, and the leftovers of dead owners ------------------------------------

OWNER_FILE = ".mopar-owner"
"""The marker in a folder `owned_folder` made: the owner's PID, and a lock the owner holds."""


class OwnedFolder:
    """A folder this process made and holds (`owned_folder`).

    Its `OWNER_FILE` holds the owner's PID and is locked (``flock``) by the owner for the
    folder's life. The kernel drops the lock when the owner dies, however it dies (SIGKILL
    included), so a lock that can be taken on a marker still in place means a dead owner
    (`sweep_leftovers`). The owner unlinks the marker before it lets go of the lock, so a live
    owner's folder is never taken for a leftover.
    """

    def __init__(self, parent: Path, prefix: str, suffix: str, *, made: Path | None = None) -> None:
        self.path = made or Path(
            tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", suffix=suffix, dir=parent)
        )
        try:
            # Locked under a temporary name, then renamed: the marker is never seen unlocked.
            fd, name = tempfile.mkstemp(dir=self.path, prefix=".owner-")
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, f"{os.getpid()}\n".encode())
            os.rename(name, self.path / OWNER_FILE)
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        self._fd: int | None = fd

    def release(self) -> None:
        """Let go of the folder, which stays: unlink the marker, then drop the lock."""
        if self._fd is None:
            return
        (self.path / OWNER_FILE).unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None

    def remove(self) -> None:
        """Delete the folder (the marker goes with it, before the lock), unless released."""
        if self._fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        self.release()


@contextlib.contextmanager
def owned_folder(
    parent: str | os.PathLike[str], prefix: str, suffix: str = "", *, adopt: Path | None = None
) -> Iterator[OwnedFolder]:
    """A new folder in ``parent``, named ``<prefix><pid>-<random><suffix>``, that this process
    owns until the block ends: then it is deleted, unless `OwnedFolder.release` let go of it. Should
    the process die first, a later `sweep_leftovers` of the same ``prefix`` and ``suffix``
    removes it. ``adopt``: instead, a folder another mopar process made so and released to
    this one."""
    owned = OwnedFolder(Path(parent), prefix, suffix, made=adopt)
    try:
        yield owned
    finally:
        owned.remove()


def sweep_leftovers(parent: str | os.PathLike[str], prefix: str, suffix: str = "") -> list[Path]:
    """Remove the folders in ``parent`` named ``<prefix>*<suffix>`` that `owned_folder` made
    for a process that is gone; return them.

    Only a real folder (not a link) of this user that holds a marker whose lock can be taken is
    removed: a live owner holds its lock, and a folder without a marker was not made by
    `owned_folder` (or was released by its owner), so both stay.
    """
    try:
        entries = [
            e for e in os.scandir(parent) if e.name.startswith(prefix) and e.name.endswith(suffix)
        ]
    except OSError:
        return []
    removed = []
    for entry in entries:
        if len(entry.name) > len(prefix) + len(suffix) and _dead_owner(entry):
            removed.append(Path(entry.path))
    return removed


def _dead_owner(entry: os.DirEntry) -> bool:
    """Remove ``entry`` if its owner is dead, holding the owner's lock meanwhile."""
    try:
        if (
            not entry.is_dir(follow_symlinks=False)
            or entry.stat(follow_symlinks=False).st_uid != os.geteuid()
        ):
            return False
        folder = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fd = os.open(OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder)
    except OSError:
        return False
    finally:
        os.close(folder)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_nlink == 0:  # released or removed by its owner meanwhile
            return False
        shutil.rmtree(entry.path, ignore_errors=True)
        log.info("removed %s, left by a mopar process that is gone", entry.path)
        return True
    except OSError:  # held: the owner lives (or this file system cannot lock: keep it)
        return False
    finally:
        os.close(fd)


# --- a folder's record of the files its writer put there -----------------------------------------

RECORD_FILE = ".mopar-files.json"
"""What `record_files` writes: the relative paths of the folder's files and folders."""


def record_files(folder: str | os.PathLike[str]) -> None:
    """Write ``folder``'s `RECORD_FILE`: every file and folder under it now, by relative path."""
    root = Path(folder)
    paths = sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.name not in (RECORD_FILE, OWNER_FILE)
    )
    (root / RECORD_FILE).write_text(json.dumps({"files": paths}, indent=1) + "\n")


def unrecorded(folder: str | os.PathLike[str]) -> list[str] | None:
    """The relative paths under ``folder`` its `RECORD_FILE` does not list (Python's
    ``__pycache__`` folders aside), or None when it has no readable record."""
    root = Path(folder)
    try:
        listed = json.loads((root / RECORD_FILE).read_text())["files"]
        if not isinstance(listed, list):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    known = set(map(str, listed)) | {RECORD_FILE}
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in [*dirnames, *filenames]:
            rel = str((Path(dirpath) / name).relative_to(root))
            if rel not in known:
                found.append(rel)
    return sorted(found)
