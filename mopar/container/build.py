"""`mopar build`: one OCI image per function of a bundle, from the bundle's own build files.

Decide, then apply. `plan_images` decides what to build: for each function and each kind (a
target with an image recipe: `mopar.target.Target.image`, ``mopar/targets/<target>/image.py``),
the Dockerfile, the build context and arguments the recipe gives, and a tag named by a digest of
all of them, so an unchanged function is never built twice. `build_images` builds what is not
there yet.

Every build is offline (``--network none``): pip installs from a wheelhouse (`wheels`) that is
mounted for that one step, so no wheel stays in a layer. Each image's size is reported above its
base, next to the function's weights, which it must carry.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from mopar.container.engine import Engine, cache_dir, last_error
from mopar.container.wheels import Target, ensure_wheels
from mopar.errors import ContainerError
from mopar.runner.bundle import BundleManifest
from mopar.target import ImageBuildSpec, ImageRecipe, registered, target_or_default

__all__ = [
    "LOCAL_BASE",
    "default_kind",
    "image_kinds",
    "ImageBuild",
    "BuiltImage",
    "plan_images",
    "build_images",
    "bundle_kinds",
    "image_tag",
    "images_for",
    "requirements_of",
]

LOCAL_BASE = "localhost/mopar-base:bookworm"
"""The base ``make base-image`` makes from Debian packages, for machines with no registry."""

TEMPLATE = Path("template") / "mopar-onnx"
_MB = 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class ImageBuild(ImageBuildSpec):
    """One image to build: its build context, Dockerfile, stage, arguments and more tags as its
    target's recipe gives them (`mopar.target.ImageBuildSpec`), named.

    Attributes:
        function: the function's name.
        kind: the target it is built for (``openfaas``, ``lambda``: `image_kinds`).
        tag: ``localhost/mopar/<model>-<function><its recipe's tag suffix>:<digest>``.
        weights_bytes: the size of the function's models, which the image must carry.
    """

    function: str
    kind: str
    tag: str
    weights_bytes: int


@dataclass(frozen=True)
class BuiltImage:
    """A built (or found) image and its size above the base, MB."""

    function: str
    kind: str
    tag: str
    size_mb: float
    above_base_mb: float
    weights_mb: float
    seconds: float
    cached: bool

    @property
    def runtime_mb(self) -> float:
        """What the image adds beyond the base and the weights: the runtime's packages."""
        return round(self.above_base_mb - self.weights_mb, 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "runtime_mb": self.runtime_mb}


def image_kinds() -> tuple[str, ...]:
    """The kinds of image a bundle has: the registered targets with an image recipe."""
    return tuple(t.name for t in registered() if t.image() is not None)


def default_kind(target: str | None) -> str:
    """The kind of image a plan for ``target`` deploys as: its own, or the default target's
    for a target with none (a pricing-only one)."""
    return target if target in image_kinds() else target_or_default(None).name


def bundle_kinds(root: Path) -> tuple[str, ...]:
    """The kinds of image the bundle at ``root`` has the files of (`image_kinds` whose
    Dockerfile it holds): its target's, and OpenFaaS's, whose template every bundle carries
    (`mopar.emit.runtime`)."""
    return tuple(k for k in image_kinds() if (root / _recipe(k).dockerfile).is_file())


def _recipe(kind: str) -> ImageRecipe:
    """The image recipe of the target ``kind``.

    Raises:
        ContainerError: it has none.
    """
    recipe = target_or_default(kind).image() if kind in image_kinds() else None
    if recipe is None:
        raise ContainerError(
            f"no image kind {kind!r}; choose one of {', '.join(image_kinds())} or all"
        )
    return recipe


def image_tag(model: str, function: str, kind: str, digest: str) -> str:
    name = re.sub(r"[^a-z0-9]+", "-", f"{model}-{function}".lower()).strip("-")
    return f"localhost/mopar/{name}{_recipe(kind).tag_suffix}:{digest[:12]}"


def plan_images(
    manifest: BundleManifest,
    *,
    kinds: Iterable[str] | None = None,
    base_image: str,
    base_id: str,
    functions: Iterable[str] | None = None,
    watchdog: bool = False,
) -> tuple[ImageBuild, ...]:
    """What to build for ``manifest``: one image per function and kind.

    Args:
        kinds: the targets to build for (`image_kinds`; None: the default target).
        base_image: the image the Dockerfiles start from (``BASE_IMAGE``).
        base_id: its id, part of every tag's digest.
        functions: only these (None: all).
        watchdog: build the OpenFaaS image's last stage, with the of-watchdog (its base,
            ``WATCHDOG_IMAGE``, must then be pullable).

    Raises:
        ContainerError: the bundle's build files predate `mopar build` (no ``BASE_IMAGE``), or a
            function is not in the bundle.
    """
    root = manifest.root
    names = [s.name for s in manifest.slices]
    for name in functions or ():
        if name not in names:
            raise ContainerError(
                f"function {name!r} is not in the bundle {root} (it has "
                f"{', '.join(names)}); pass one of those"
            )
    recipes = {kind: _recipe(kind) for kind in (kinds or (default_kind(None),))}
    for kind, recipe in recipes.items():
        dockerfile = root / recipe.dockerfile
        if not dockerfile.is_file() and (root / TEMPLATE).is_dir():
            target = manifest.document.plan.get("target")
            raise ContainerError(
                f"{root} has no {recipe.dockerfile}: it was compiled for {target} and holds "
                f"that target's files alone; build its images (--kind "
                f"{' or '.join(bundle_kinds(root))}), or compile it again with --target {kind}"
            )
        if not dockerfile.is_file() or "ARG BASE_IMAGE" not in dockerfile.read_text():
            raise ContainerError(
                f"{dockerfile} is missing or predates `mopar build` (it has no "
                "BASE_IMAGE argument); recompile the bundle with this mopar"
            )
    template = {
        f"{p.relative_to(root / TEMPLATE)}": p
        for p in _files(root / TEMPLATE)
        if p.relative_to(root / TEMPLATE).parts[0] != "wheels"
    }
    builds = []
    for s in manifest.slices:
        if functions and s.name not in functions:
            continue
        fdir = manifest.function_dir(s)
        own = {f"{p.relative_to(fdir)}": p for p in _files(fdir)}
        weights = sum(p.stat().st_size for p in own.values() if p.suffix in (".onnx", ".data"))
        for kind, recipe in recipes.items():
            spec = recipe.spec(
                root=root,
                model=manifest.model,
                function=s.name,
                template=template,
                own=own,
                base_image=base_image,
                watchdog=watchdog,
            )
            digest = _digest(
                spec.files,
                [kind, spec.dockerfile, str(spec.stage), base_id, sorted(spec.build_args.items())],
            )
            builds.append(
                ImageBuild(
                    function=s.name,
                    kind=kind,
                    tag=image_tag(manifest.model, s.name, kind, digest),
                    weights_bytes=weights,
                    **vars(spec),
                )
            )
    return tuple(builds)


def requirements_of(build: ImageBuild, *, in_dockerfile: bool = False) -> list[str]:
    """The pinned requirements in the requirements files of ``build``'s context; with
    ``in_dockerfile``, also those its Dockerfile's install step names (awslambdaric, boto3)."""
    reqs: set[str] = set()
    for name, path in build.files.items():
        if name.endswith("requirements.txt"):
            reqs |= {
                x.strip()
                for x in path.read_text().splitlines()
                if x.strip() and not x.startswith("#")
            }
        elif in_dockerfile and name == build.dockerfile:
            for line in path.read_text().splitlines():
                if line.startswith("RUN") and "install" in line:
                    reqs |= set(re.findall(r"(?<=\s)[A-Za-z0-9_.-]+==[A-Za-z0-9_.+!-]+", line))
    return sorted(reqs)


def build_images(
    engine: Engine,
    builds: tuple[ImageBuild, ...],
    *,
    base_image: str,
    wheelhouse: Path | None = None,
    offline: bool = False,
    on_image: Callable[[BuiltImage], None] | None = None,
) -> list[BuiltImage]:
    """Build each of ``builds`` that is not here yet; report each one's size.

    Args:
        engine: the engine, ready for ``base_image`` (`Engine.ready_for`).
        wheelhouse: the folder of wheels (default ``<cache>/wheels``); what is missing is
            downloaded into it, unless ``offline``.
        on_image: called as each image is done (a progress bar).
    """
    wheelhouse = wheelhouse or cache_dir() / "wheels"
    base_bytes = engine.image_size(base_image)
    todo = [b for b in builds if engine.image_id(b.tag) is None]
    if todo:
        target = Target.of_image(engine, base_image)
        ensure_wheels(
            sorted({r for b in todo for r in requirements_of(b)}),
            wheelhouse,
            target,
            offline=offline,
        )
        for b in todo:  # boto3 and what it needs: not pinned to the compiler's environment
            if _recipe(b.kind).unpinned:
                ensure_wheels(
                    requirements_of(b, in_dockerfile=True),
                    wheelhouse,
                    target,
                    offline=offline,
                    pin_to_host=False,
                )
                break
    done = []
    for b in builds:
        t0 = time.perf_counter()
        cached = b not in todo
        if not cached:
            _build_one(engine, b, wheelhouse)
        size = engine.image_size(b.tag)
        image = BuiltImage(
            function=b.function,
            kind=b.kind,
            tag=b.tag,
            size_mb=round(size / _MB, 1),
            above_base_mb=round((size - base_bytes) / _MB, 1),
            weights_mb=round(b.weights_bytes / _MB, 1),
            seconds=round(time.perf_counter() - t0, 1),
            cached=cached,
        )
        done.append(image)
        if on_image is not None:
            on_image(image)
    return done


def _build_one(engine: Engine, build: ImageBuild, wheelhouse: Path) -> None:
    work = cache_dir() / "contexts"
    work.mkdir(parents=True, exist_ok=True)
    context = Path(tempfile.mkdtemp(prefix="build-", dir=work))
    try:
        for name, source in build.files.items():
            _place(source, context / name)
        wheels = context / _recipe(build.kind).wheels
        wheels.mkdir(parents=True, exist_ok=True)
        for wheel in wheelhouse.glob("*.whl"):
            _place(wheel, wheels / wheel.name)
        args = ["build", "--network", "none", "-f", str(context / build.dockerfile)]
        args += ["-t", build.tag, "--label", f"com.mopar.function={build.function}"]
        for alias in build.aliases:
            args += ["-t", alias]
        if build.stage:
            args += ["--target", build.stage]
        for key, value in build.build_args.items():
            args += ["--build-arg", f"{key}={value}"]
        done = engine.run(
            *args,
            str(context),
            timeout_s=1800,
            check=False,
            env={"DOCKER_BUILDKIT": "1"} if engine.name == "docker" else None,
        )
        if done.returncode != 0:
            log = cache_dir() / "logs" / f"{build.tag.rsplit('/', 1)[-1].replace(':', '-')}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_bytes(done.stdout + done.stderr)
            raise ContainerError(
                f"building the {build.kind} image of {build.function} failed: "
                f"{last_error(done.stderr or done.stdout)} (the whole log: "
                f"{log})"
            )
    finally:
        shutil.rmtree(context, ignore_errors=True)


def _place(source: Path, dest: Path) -> None:
    """A hard link of ``source`` at ``dest`` (a copy across file systems)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def _digest(files: dict[str, Path], extra: list) -> str:
    h = hashlib.sha256(repr(extra).encode())
    for name in sorted(files):
        h.update(name.encode() + b"\0")
        with open(files[name], "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def images_for(
    manifest: BundleManifest,
    *,
    engine: str | None = None,
    base_image: str | None = None,
    kind: str | None = None,
    functions: Iterable[str] | None = None,
    wheelhouse: Path | None = None,
    offline: bool = False,
    watchdog: bool = False,
    on_image: Callable[[BuiltImage], None] | None = None,
) -> tuple[Engine, list[BuiltImage]]:
    """Find the engine, get it ready for the base, and build ``manifest``'s images of ``kind``
    (``openfaas``, ``lambda`` or ``all``: every kind the bundle has the files of,
    `bundle_kinds`; None: the default target's) that are not here yet:
    what `mopar build` does. The base is ``base_image``, else the public one the first kind's
    Dockerfile names (a registry must be reachable to pull it)."""
    from mopar.container.engine import find_engine

    every = bundle_kinds(manifest.root) or (default_kind(None),)
    kinds = every if kind == "all" else (kind or default_kind(None),)
    base = base_image or _recipe(kinds[0]).default_base
    ready = find_engine(engine).ready_for(base)
    builds = plan_images(
        manifest,
        kinds=kinds,
        base_image=base,
        base_id=ready.image_id(base),
        functions=functions,
        watchdog=watchdog,
    )
    return ready, build_images(
        ready, builds, base_image=base, wheelhouse=wheelhouse, offline=offline, on_image=on_image
    )
