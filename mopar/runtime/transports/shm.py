"""The shm store: frames as files in a tmpfs folder that sender and receiver share.

Locally that is a folder under /dev/shm; on Kubernetes, the hostPath tmpfs ``/dev/shm/mopar``
that the bundle's ``k8s/`` patch mounts into co-located function pods. Files are written under a
temporary name and renamed, so a reader never sees half a frame; names are random and checked
against a strict pattern, so a reference can never point outside the folder. A frame that does
not fit in the folder's tmpfs is a 507 that says how to make room, and leaves nothing behind.
"""

from __future__ import annotations

import errno
import os
import re
import uuid
from pathlib import Path

from mopar.runtime.transports.http import Body, HopError, body_parts

__all__ = ["ShmStore", "DEFAULT_SHM_DIR"]

DEFAULT_SHM_DIR = "/dev/shm/mopar"
_NAME_RE = re.compile(r"^(f|hs)-[0-9a-f]{32}$")


class ShmStore:
    """Put and take frames in ``folder`` (created unless ``create`` is False)."""

    scheme = "shm"

    def __init__(self, folder: str = "", *, create: bool = True) -> None:
        self.folder = Path(folder or DEFAULT_SHM_DIR)
        if create:
            self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        if not _NAME_RE.match(name):
            raise ValueError(f"shm reference {name!r} is not a mopar frame name")
        return self.folder / name

    def _write(self, name: str, data: Body) -> None:
        """Write ``data`` to the file ``name`` at once (under a temporary name, then renamed).

        Raises:
            HopError: (507) the folder's file system has no room for it.
        """
        path = self._path(name)
        tmp = path.with_name(f".{name}.tmp")
        parts = body_parts(data)
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno != errno.ENOSPC:
                raise
            stat = os.statvfs(self.folder)
            raise HopError(
                f"no room in {self.folder} for a frame of {sum(map(len, parts))} bytes "
                f"({stat.f_bavail * stat.f_frsize} bytes free); free space there or "
                "make its tmpfs larger (`docker run --shm-size=2g`, or the node's "
                "/dev/shm on Kubernetes)",
                status=507,
            ) from None
        os.replace(tmp, path)

    def put(self, data: Body) -> str:
        name = f"f-{uuid.uuid4().hex}"
        self._write(name, data)
        return name

    def take(self, name: str) -> bytes:
        path = self._path(name)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ValueError(
                f"shm frame {name!r} does not exist in {self.folder}: already "
                "consumed, or the sender is not co-located"
            ) from None
        path.unlink(missing_ok=True)
        return data

    def discard(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def handshake_file(self, token: str) -> tuple[str, str]:
        """Write a handshake file holding ``token``; return (its name, the token)."""
        name = f"hs-{uuid.uuid4().hex}"
        self._write(name, token.encode())
        return name, token

    def holds(self, name: str, token: str) -> bool:
        """Whether the handshake file ``name`` is here and holds ``token``."""
        try:
            return self._path(name).read_bytes() == token.encode()
        except (OSError, ValueError):
            return False
