"""The shm store: frames as files in a tmpfs folder that sender and receiver share.

Locally that is a folder under /dev/shm; on Kubernetes, the hostPath tmpfs ``/dev/shm/mopar``
that the bundle's ``k8s/`` patch mounts into co-located function pods. Files are written under a
temporary name and renamed, so a reader never sees half a frame; names are random and checked
against a strict pattern, so a reference can never point outside the folder.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

from mopar.runtime.transports.http import Body, body_parts

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
        path = self._path(name)
        tmp = path.with_name(f".{name}.tmp")
        with open(tmp, "wb") as f:
            for part in body_parts(data):
                f.write(part)
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
            raise ValueError(f"shm frame {name!r} does not exist in {self.folder}: already "
                             "consumed, or the sender is not co-located") from None
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
