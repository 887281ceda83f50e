"""Container engines: find podman or docker, learn what this host lets it do, and run it.

Read `find_engine` first, then `Engine.ready_for`, which starts one throwaway container and works
around what the host refuses, each time saying so in one line (`Engine.notes`):

- an OCI runtime that fails on the host's cgroups (crun on a hybrid cgroup v1 host): podman is
  given ``--runtime runc`` when runc is installed;
- resource limits (rlimits) the host does not let a container set: podman is given a
  ``containers.conf`` with ``default_ulimits = []`` (through ``CONTAINERS_CONF``).

`cgroup_memory_file` finds the file the kernel keeps a container's peak memory in (cgroup v1 or
v2), which `mopar run --containers` reads.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mopar.errors import ContainerError

__all__ = ["ENGINES", "Engine", "find_engine", "cgroup_memory_file", "cache_dir", "last_error"]

ENGINES = ("podman", "docker")

_NO_RLIMITS = "[containers]\ndefault_ulimits = []\n"


def cache_dir() -> Path:
    """mopar's cache folder (``$XDG_CACHE_HOME/mopar``, else ``~/.cache/mopar``)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "mopar"


@dataclass(frozen=True)
class Engine:
    """A container engine and how this host must call it.

    Attributes:
        name: ``podman`` or ``docker``.
        exe: its executable.
        global_args: options before the subcommand (``--runtime runc``).
        env: variables added to its environment (``CONTAINERS_CONF``).
        notes: one line for each work-around of this host, for the user.
    """

    name: str
    exe: str
    global_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def command(self, *args: str) -> list[str]:
        """The argv of ``<engine> <args>``, with this host's global options."""
        return [self.exe, *self.global_args, *args]

    def environ(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def run(
        self,
        *args: str,
        timeout_s: float = 120.0,
        input: bytes | None = None,
        check: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess:
        """Run ``<engine> <args>`` to the end; a failure raises `ContainerError` with its last
        error line (``check``). ``env``: more variables for this one call. A container that
        ``run`` starts is named, so that past ``timeout_s`` it is removed, not left running."""
        name, shown = None, " ".join(args[:2])
        if args[0] == "run" and "--name" not in args:
            name = f"mopar-once-{secrets.token_hex(4)}"
            args = ("run", "--name", name, *args[1:])
        try:
            done = subprocess.run(
                self.command(*args),
                env={**self.environ(), **(env or {})},
                input=input,
                capture_output=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            if name is not None:
                subprocess.run(
                    self.command("rm", "-f", "-t", "0", name),
                    env=self.environ(),
                    capture_output=True,
                    timeout=60,
                )
            raise ContainerError(
                f"`{self.name} {args[0]}` did not finish within {timeout_s:g} s; "
                f"check `{self.name} info`"
            ) from None
        if check and done.returncode != 0:
            raise ContainerError(f"`{self.name} {shown}` failed: {last_error(done.stderr)}")
        return done

    def image_id(self, ref: str) -> str | None:
        """The id of the local image ``ref`` (None: not here)."""
        done = self.run("image", "inspect", "--format", "{{.Id}}", ref, check=False)
        return done.stdout.decode().strip() or None if done.returncode == 0 else None

    def image_size(self, ref: str) -> int:
        """The size of the local image ``ref``, bytes, uncompressed, base layers included."""
        return int(self.run("image", "inspect", "--format", "{{.Size}}", ref).stdout.decode())

    def ready_for(self, image: str) -> Engine:
        """This engine, as it must be called to run ``image`` here: it starts one container
        of ``image`` and works around a refused runtime or rlimits (see the module docstring).

        Raises:
            ContainerError: ``image`` is not here and cannot be pulled, or the engine cannot
                start a container at all.
        """
        engine = self
        for _ in range(3):
            done = engine.run(
                "run", "--rm", "--network", "none", image, "true", check=False, timeout_s=300
            )
            if done.returncode == 0:
                return engine
            err = done.stderr.decode(errors="replace")
            fixed = engine._work_around(err)
            if fixed is None:
                raise ContainerError(_start_failure(engine.name, image, err))
            engine = fixed
        raise ContainerError(_start_failure(engine.name, image, err))

    def _work_around(self, err: str) -> Engine | None:
        if self.name != "podman":
            return None
        if "setting rlimit" in err and "CONTAINERS_CONF" not in self.env:
            conf = cache_dir() / "containers-no-ulimits.conf"
            conf.parent.mkdir(parents=True, exist_ok=True)
            conf.write_text(_NO_RLIMITS)
            note = (
                "note: this host does not let containers set rlimits (runc: error setting "
                f"rlimits: operation not permitted); podman runs with CONTAINERS_CONF={conf} (default_ulimits = [])"
            )
            return dataclasses.replace(
                self, env={**self.env, "CONTAINERS_CONF": str(conf)}, notes=(*self.notes, note)
            )
        if "crun" in err and "--runtime" not in self.global_args and shutil.which("runc"):
            note = (
                f"note: crun cannot start containers on this host ({last_error(err)}); "
                "podman runs with --runtime runc"
            )
            return dataclasses.replace(
                self,
                global_args=(*self.global_args, "--runtime", "runc"),
                notes=(*self.notes, note),
            )
        return None


def _start_failure(engine: str, image: str, err: str) -> str:
    line = last_error(err.encode())
    if any(
        s in err
        for s in (
            "image not known",
            "did not resolve",
            "pull access denied",
            "no such host",
            "manifest unknown",
            "unable to pull",
            "initializing source",
            "pinging container registry",
            "Unable to find image",
        )
    ):
        return (
            f"image {image!r} is not here and cannot be pulled ({line}); build a local base "
            "with `make base-image` and pass --base-image localhost/mopar-base:bookworm"
        )
    return f"{engine} cannot start a container of {image!r} on this host: {line}"


def last_error(stderr: bytes | str) -> str:
    """The most telling line of an engine's stderr: the last ``Error``/``ERROR`` one, or the
    last non-empty one."""
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
    lines = [" ".join(x.split()) for x in text.splitlines() if x.strip()]
    errors = [x for x in lines if x.lower().startswith(("error", "fatal"))]
    line = (errors or lines or ["no output"])[-1]
    return line[:400]


def find_engine(name: str | None = None) -> Engine:
    """The container engine ``name``, or the first of `ENGINES` that is installed and answers.

    Raises:
        ContainerError: none is installed, or docker's daemon does not answer.
    """
    for candidate in (name,) if name else ENGINES:
        exe = shutil.which(candidate)
        if exe is None:
            continue
        engine = Engine(candidate, exe)
        if candidate == "docker":
            done = engine.run("info", "--format", "{{.ServerVersion}}", check=False, timeout_s=20)
            if done.returncode != 0:
                if name:
                    raise ContainerError(
                        "docker is installed but its daemon does not answer "
                        "(`docker info`); start it, or use --engine podman"
                    )
                continue
        return engine
    if name and name not in ENGINES:
        raise ContainerError(f"--engine {name!r} is not one of {list(ENGINES)}")
    raise ContainerError(
        f"no container engine: {name or 'podman'} is not installed"
        + ("" if name else " and no docker daemon answers")
        + "; install podman (apt-get install podman runc) or start docker"
    )


def cgroup_memory_file(pid: int) -> Path | None:
    """The file holding the peak memory (bytes) of ``pid``'s memory cgroup: ``memory.peak``
    under cgroup v2, ``memory.max_usage_in_bytes`` under v1 (None: neither is readable)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            f = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.max_usage_in_bytes"
            if f.is_file():
                return f
    for line in lines:
        if line.startswith("0::"):
            f = Path("/sys/fs/cgroup") / line[3:].lstrip("/") / "memory.peak"
            if f.is_file():
                return f
    return None
