"""Files and folders made through `tempfile` get the modes a plain ``open`` or ``mkdir`` gives.

`tempfile.mkstemp` makes a file 0600 and `tempfile.mkdtemp` a folder 0700, whatever the umask:
right for a secret, wrong for a bundle or a chart that is renamed into place for others to read.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["as_if_made", "umask"]


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
