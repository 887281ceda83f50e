"""`mopar compile`'s torch part in a child process, so that the rest runs without torch.

Once a compile's functions are exported, what is left needs no torch (`mopar.pipeline.finish`).
Where the command runs in a process of its own (``mopar`` or ``python -m mopar``, not a test's
click runner: `mark_process`) and the model's stored weights are large (`worth_a_child`), it
runs itself again as a child before importing torch
(`run_child`), as it was run, with a pipe to say where it staged the bundle
(`CHANNEL_ENV`). The child captures, plans and exports, and hands the staged folder to the
parent (`hand_to_parent`), or writes the whole bundle itself where the rest needs torch too.
The parent waits for the child to exit, then verifies, measures and emits: torch's libraries
and heap, 0.4-0.6 GB, are not held beside the functions it serves. A child, not a fork: a
process with threads (numpy's, onnxruntime's) does not fork safely.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Literal

__all__ = [
    "CHANNEL_ENV",
    "mark_process",
    "role",
    "worth_a_child",
    "run_child",
    "hand_to_parent",
]

CHANNEL_ENV = "MOPAR_COMPILE_CHANNEL"
"""The environment variable that tells a compile's child the pipe it answers its parent on."""

_ROLE: Literal["parent", "child"] | None = None
_CHANNEL: int | None = None


def mark_process() -> None:
    """Say that this process is mopar's own (`mopar.cli.main`): a compile's child, where its
    parent says so, and otherwise one that may start one."""
    global _ROLE, _CHANNEL
    channel = os.environ.pop(CHANNEL_ENV, None)  # not for this process's own children
    _ROLE = "parent" if channel is None else "child"
    _CHANNEL = None if channel is None else int(channel)


def role() -> Literal["parent", "child"] | None:
    """``parent``: a compile here runs its torch part in a child (`run_child`); ``child``: this
    is that child; None: the compile runs here whole (the Python API, a test's runner)."""
    return _ROLE


def worth_a_child(model: str) -> bool:
    """Whether ``model`` (a file, or a folder of weights) stores at least
    `mopar.pipeline.serving.RELEASE_FROM_MB` of weights: below, a second process's imports
    (1-2 s) cost more than the memory is worth. A factory's weights are known once it is
    built, in the process that builds it: no child."""
    from mopar.pipeline.serving import RELEASE_FROM_MB  # what every command imports stays light

    path = Path(model)
    if path.name == "config.json":  # a Hugging Face folder, named by its config
        path = path.parent
    if path.is_file():
        size = path.stat().st_size
    elif path.is_dir():
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    else:
        return False
    return size >= RELEASE_FROM_MB * (1 << 20)


def run_child() -> tuple[int, Path | None]:
    """Run this command again as a child, and wait for it: its exit code, and the folder it
    handed over (None: it handed none over, or it failed)."""
    read, write = os.pipe()
    env = {**os.environ, CHANNEL_ENV: str(write)}
    command = [sys.executable, *sys.orig_argv[1:]]  # as this process was run
    sys.stdout.flush()
    sys.stderr.flush()
    with subprocess.Popen(command, env=env, pass_fds=(write,)) as proc:
        os.close(write)
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the child is told, and says
        try:
            with os.fdopen(read, "rb") as channel:
                said = channel.read()
            code = proc.wait()
        finally:
            signal.signal(signal.SIGINT, previous)
    code = 128 - code if code < 0 else code  # killed by a signal: the shell's code for it
    staged = Path(os.fsdecode(said)) if said else None
    if staged is not None and code:  # handed over, then failed: the folder is mopar's
        shutil.rmtree(staged, ignore_errors=True)
        staged = None
    return code, staged


def hand_to_parent(staged: Path) -> None:
    """In the child: tell the parent the folder staged for it."""
    global _CHANNEL
    assert _CHANNEL is not None, "hand_to_parent is for a compile's child"
    os.write(_CHANNEL, os.fsencode(str(staged)))
    os.close(_CHANNEL)
    _CHANNEL = None
