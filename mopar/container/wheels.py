"""The wheelhouse an image is built from offline: every wheel a function's requirements need on
the image's own Python.

`Target` is that Python, read off the base image (version, glibc, machine), because the
requirements' markers are evaluated against it, not against the compiler's Python: redis needs
async-timeout below Python 3.11.3, which Debian bookworm's python3 (3.11.2) is.
`ensure_wheels` walks the requirements through the wheels' own metadata and downloads what is
missing (pinned to the versions installed next to the compiler, where it has them), or, offline,
names what is missing.
"""

from __future__ import annotations

import email
import importlib.metadata
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from mopar.errors import ContainerError

__all__ = ["Target", "ensure_wheels"]

_PROBE = (
    "import platform, json; print(json.dumps([platform.python_version(), "
    "platform.libc_ver()[1], platform.machine()]))"
)


@dataclass(frozen=True)
class Target:
    """The Python inside an image: ``3.11.2``, glibc ``2.36``, machine ``x86_64``."""

    python: str
    glibc: str
    machine: str

    @classmethod
    def of_image(cls, engine, image: str) -> Target:
        """The Python of ``image``, read by running it (`mopar.container.engine.Engine`)."""
        probe = ["run", "--rm", "--network", "none", image, "python3", "-c", _PROBE]
        done = engine.run(*probe, check=False, timeout_s=120)
        if done.returncode != 0:
            raise ContainerError(
                f"the base image {image!r} has no working python3 (exit "
                f"{done.returncode}); use an image with python3 and its venv "
                "module, e.g. the one `make base-image` makes"
            )
        python, glibc, machine = json.loads(done.stdout.decode().strip().splitlines()[-1])
        return cls(python, glibc or "2.17", machine)

    def markers(self) -> dict[str, str]:
        major_minor = ".".join(self.python.split(".")[:2])
        return {
            **default_environment(),
            "python_full_version": self.python,
            "python_version": major_minor,
            "platform_machine": self.machine,
            "sys_platform": "linux",
            "platform_system": "Linux",
            "implementation_name": "cpython",
            "platform_python_implementation": "CPython",
            "os_name": "posix",
            "extra": "",
        }

    def pip_args(self) -> list[str]:
        """pip download's options for wheels that install on this Python (manylinux, up to its
        glibc)."""
        glibc_minor = int(self.glibc.split(".")[1]) if "." in self.glibc else 17
        platforms = [f"manylinux_2_{k}_{self.machine}" for k in range(glibc_minor, 16, -1)]
        platforms += [f"manylinux2014_{self.machine}", f"manylinux1_{self.machine}"]
        out = ["--only-binary=:all:", "--implementation", "cp"]
        out += ["--python-version", ".".join(self.python.split(".")[:2])]
        return out + [arg for p in platforms for arg in ("--platform", p)]


def ensure_wheels(
    requirements: list[str],
    folder: Path,
    target: Target,
    *,
    offline: bool = False,
    pin_to_host: bool = True,
) -> None:
    """Make ``folder`` hold a wheel for each of ``requirements`` and for all they need on
    ``target``.

    Args:
        pin_to_host: a download takes the versions installed next to the compiler of the
            packages it has (the function's own requirements are pinned to them too); False
            for packages the compiler's environment does not serve (boto3 and what it needs).

    Raises:
        ContainerError: ``offline`` and something is missing (named, with the command that
            fetches it), or pip could not download it.
    """
    folder.mkdir(parents=True, exist_ok=True)
    for _ in range(4):
        missing = _unmet(requirements, folder, target.markers())
        if not missing:
            return
        if offline:
            raise ContainerError(
                f"the wheelhouse {folder} lacks {', '.join(missing[:6])}; fetch them where an "
                f"index is reachable: pip download -d {folder} {' '.join(target.pip_args())} "
                f"{' '.join(repr(m) for m in missing)}"
            )
        _download(missing, folder, target, pin_to_host)
    missing = _unmet(requirements, folder, target.markers())
    if missing:
        raise ContainerError(
            f"pip downloaded no wheel of {', '.join(missing[:6])} for Python "
            f"{target.python} on {target.machine}; the package has no "
            "manylinux wheel, so the image cannot be built offline"
        )


def _unmet(requirements: list[str], folder: Path, env: dict[str, str]) -> list[str]:
    wheels: dict[str, list[tuple[object, Path]]] = {}
    for path in folder.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(path.name)
        wheels.setdefault(name, []).append((version, path))
    missing: list[str] = []
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if not _applies(req, env, req.extras):
            continue
        key = f"{canonicalize_name(req.name)}{sorted(req.extras)}{req.specifier}"
        if key in seen:
            continue
        seen.add(key)
        found = [
            (v, p)
            for v, p in wheels.get(canonicalize_name(req.name), ())
            if req.specifier.contains(v, prereleases=True)
        ]
        if not found:
            missing.append(str(req).split(";")[0].strip())
            continue
        _, path = max(found, key=lambda x: x[0])
        for dep in map(Requirement, _requires(path)):
            if _applies(dep, env, req.extras):  # under the extras it was asked with
                dep.marker = None
                todo.append(dep)
    return sorted(set(missing))


def _applies(req: Requirement, env: dict[str, str], extras: set[str]) -> bool:
    """Whether ``req``'s marker holds in ``env`` with any of ``extras`` (none: no extra)."""
    return req.marker is None or any(
        req.marker.evaluate({**env, "extra": e}) for e in (extras or {""})
    )


def _requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(z.read(meta)).get_all("Requires-Dist") or []


def _download(requirements: list[str], folder: Path, target: Target, pin_to_host: bool) -> None:
    pins = sorted(
        {
            f"{d.metadata['Name']}=={d.version}"
            for d in importlib.metadata.distributions()
            if pin_to_host
            and d.metadata["Name"]
            and canonicalize_name(d.metadata["Name"]) != "mopar"
        }
    )
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(pins) + "\n")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
            + [*target.pip_args(), "-d", str(folder), "-c", f.name, *requirements],
            capture_output=True,
            text=True,
        )
    finally:
        Path(f.name).unlink()
    if done.returncode != 0:
        err = [x for x in done.stderr.splitlines() if x.startswith("ERROR")] or ["no output"]
        raise ContainerError(
            f"pip could not download wheels of {', '.join(requirements[:6])} "
            f"for Python {target.python}: {err[-1]}; check the index, or fill "
            f"the wheelhouse {folder} by hand and pass --offline"
        )
