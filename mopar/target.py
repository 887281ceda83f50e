"""What a deployment target is, and the registry core code asks. torch-free.

A target is a package: ``mopar/targets/openfaas/`` and ``mopar/targets/aws_lambda/`` are the
built-in ones, and a plug-in is any importable package with the same modules (see
docs/architecture.md, "Where to touch"):

- ``__init__.py``: ``NAME``, the target's name (``--target``, its key in ``platforms.json``);
- ``facts.py``: ``facts(profiles_dir)``, its facts (prices, memory grid, CPU rule, chain modes'
  charges), which `mopar.facts` turns into a `mopar.facts.Platform`; without it, its entry of
  ``platforms.json`` under its name (`platform_entry`);
- ``chains.py``: ``MODES``, the chain modes it offers (`mopar.runtime.chains`), its default
  first;
- ``emit.py``: ``emit(bundle, plan, *, config, facts)``, which writes its deployment files
  (and the bundle's README) into a bundle planned for it: a bundle holds one target's files;
- ``entry.py``: ``entry(mode, *, deployed)``, the process a function runs as on this machine in
  a mode (`Entry`), and ``HANDLER``, the function entry point its deployed images run;
- ``image.py``: ``RECIPE``, how a function's image is built (`ImageRecipe`), or None;
- ``emulate.py``: ``emulation(mode, *, workers, timeout_s)``, what the platform does in front
  of the functions in a mode, played on 127.0.0.1 for the runner (`Emulation`; None: nothing),
  and what its entry runs (Lambda's Invoke API around one handler).
- ``client.py``: ``CLIENT``, how a client calls a deployed or emulated function of the target
  by a URL of its platform's own API (`Client`: Lambda's Invoke API), or absent.

Read in this order: `Entry`, `Emulation`, `ImageBuildSpec`, `ImageRecipe` and `Client` (what
a target answers), `Target`
(the protocol), `PackageTarget` (a target as such a package, each module imported when first
asked), then the registry: `register_target`, `registered`, `target_or_default`,
`deploy_targets`.

This module sits low in the layers (below the runner, above the runtime) so that every layer
that serves, builds, bills or emits can ask it; it never imports a target package's modules by
an import statement, only by name when asked, since those span the layers (an emitter sits above
the planner). Core code asks the target (``target.chain_modes()``, ``target.entry(mode)``,
``target.image()``) and never compares target names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mopar.config import CompileConfig, load_profile
from mopar.runtime.chains import HANDLER, ChainMode
from mopar.runtime.rendezvous import Answer

__all__ = [
    "BUILT_IN",
    "Client",
    "Emulation",
    "Entry",
    "ImageBuildSpec",
    "ImageRecipe",
    "PackageTarget",
    "Target",
    "deploy_targets",
    "register_target",
    "registered",
    "target_or_default",
    "unregister_target",
]


@dataclass(frozen=True, kw_only=True)
class Entry:
    """How a function of a target runs on this machine in one chain mode.

    Attributes:
        module: what runs it: ``python -m <module>`` with the function's ``MOPAR_*``
            environment, printing one ``ready`` JSON line (the function server, or a target's
            emulation of its platform around its handler).
        mode: the mode that process is given as ``MOPAR_CHAIN`` (a mode of its door).
    """

    module: str
    mode: ChainMode

    @property
    def door(self) -> str:
        """The door that serves the function (`mopar.runtime.chains.SERVER` or ``HANDLER``):
        what a run reports as ``served_by``."""
        return self.mode.door

    @property
    def events(self) -> bool:
        """Whether the function takes JSON events and names the functions it invokes (the
        Lambda handler behind an emulated Invoke API), not frames over HTTP to URLs."""
        return self.mode.door == HANDLER


class Emulation(Protocol):
    """What a platform does in front of its functions in one chain mode, on 127.0.0.1: a queue
    the functions hand on through (OpenFaaS's ``/async-function``), and the client's end an
    answer is delivered to (a callback URL).

    Attributes:
        failures: what went wrong in calls it made on its own (a queued call), newest last.
    """

    failures: list[str]

    def add(self, name: str, url: str) -> None:
        """Function ``name`` is served at ``url`` from now on."""
        ...

    def url_of(self, name: str) -> str:
        """Where a function hands a request on to function ``name`` (``MOPAR_NEXT``)."""
        ...

    def expect(self, request: str) -> str:
        """Open a request's rendezvous; the URL its answer is delivered to."""
        ...

    def wait(self, request: str, timeout_s: float) -> Answer | None:
        """The answer of ``request``, once delivered (None: not within ``timeout_s``)."""
        ...

    def forget(self, request: str) -> None:
        """Close a request's rendezvous."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class ImageBuildSpec:
    """One function's image as its target builds it: what `mopar.container.build` digests,
    tags and builds.

    Attributes:
        files: context path -> source path of every file of the build context.
        dockerfile: the Dockerfile's path in the context.
        stage: the stage to end at (None: the last).
        build_args: the build arguments.
        aliases: more tags.
    """

    files: dict[str, Path] = field(repr=False)
    dockerfile: str
    stage: str | None
    build_args: dict[str, str]
    aliases: tuple[str, ...] = ()


class ImageRecipe(Protocol):
    """How a target's function images are built from a bundle (``image.py``'s ``RECIPE``).

    Attributes:
        dockerfile: the Dockerfile's path in the bundle, relative to its root (checked for a
            ``BASE_IMAGE`` argument before anything is built).
        default_base: the public base image that Dockerfile names.
        tag_suffix: what the image's tag adds after the function's name (``-lambda``).
        wheels: where the wheelhouse is placed in the build context.
        unpinned: whether its Dockerfile installs packages of its own, not pinned to the
            compiler's environment (their wheels are fetched for the image's Python).
    """

    dockerfile: str
    default_base: str
    tag_suffix: str
    wheels: str
    unpinned: bool

    def spec(
        self,
        *,
        root: Path,
        model: str,
        function: str,
        template: Mapping[str, Path],
        own: Mapping[str, Path],
        base_image: str,
        watchdog: bool,
    ) -> ImageBuildSpec:
        """The image of ``function`` of the bundle at ``root``: ``template`` holds the shipped
        template's files (``template/mopar-onnx/``, by their path in it, without wheels),
        ``own`` the function folder's; ``watchdog``: OpenFaaS's full image."""
        ...


class Client(Protocol):
    """How a client calls a function of a target by a URL of its platform's API
    (``client.py``'s ``CLIENT``): what ``mopar invoke URL`` asks before posting plain HTTP."""

    def handles(self, url: str) -> bool:
        """Whether ``url`` is one of its platform's API (Lambda's Invoke API path)."""
        ...

    def request(self, url: str, inputs: Mapping[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """Call the function at ``url`` with the model ``inputs`` (arrays by name); the outputs
        it answers (arrays by name).

        Raises:
            RuntimeFailure: unreachable, refused, or the function failed.
        """
        ...


class Target(Protocol):
    """A deployment target, as core code asks it."""

    @property
    def name(self) -> str:
        """``--target``, and its key in ``platforms.json``."""
        ...

    @property
    def deploys(self) -> bool:
        """Whether it writes deployment files into the bundles planned for it (False: pricing
        only; such a plan deploys as the default target)."""
        ...

    def facts(self, profiles_dir: Path) -> Mapping[str, Any] | None:
        """Its entry of ``platforms.json`` in ``profiles_dir`` (None: it has none there)."""
        ...

    def chain_modes(self) -> tuple[ChainMode, ...]:
        """The chain modes it offers, its default first (empty: one plain mode)."""
        ...

    def entry(self, mode: ChainMode, *, deployed: bool) -> Entry:
        """How its functions run on this machine in ``mode``: with ``deployed``, in the
        process they deploy as (compile's measurement), else as the runner serves them."""
        ...

    def image(self) -> ImageRecipe | None:
        """How its function images are built (None: it has none)."""
        ...

    def client(self) -> Client | None:
        """How a client calls its functions by its platform's API (None: plain HTTP only)."""
        ...

    def emulation(self, mode: ChainMode, *, workers: int, timeout_s: float) -> Emulation | None:
        """What its platform does in front of the functions in ``mode``, started on 127.0.0.1
        (``workers`` calls in progress at once, each within ``timeout_s``); None: nothing."""
        ...

    def emit(self, bundle: Path, plan: Any, *, config: CompileConfig, facts: Any) -> None:
        """Write its deployment files into ``bundle`` from ``plan`` (a `mopar.plan.Plan`),
        ``config`` and ``facts`` (a `mopar.facts.Facts`), deciding nothing."""
        ...


def _attr(module: str, name: str, *, optional: bool = False) -> Any:
    """``module.name``, imported now (None where ``optional`` and the module or name is
    absent)."""
    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if optional and exc.name == module:
            return None
        raise
    if optional:
        return getattr(found, name, None)
    return getattr(found, name)


def platform_entry(name: str) -> Callable[[Path], Mapping[str, Any] | None]:
    """What a target package without ``facts.py`` has for facts: a reader of ``name``'s entry
    of ``platforms.json`` in a profiles folder (None where that file has none)."""

    def facts(profiles_dir: Path) -> Mapping[str, Any] | None:
        entry = load_profile(profiles_dir, "platforms").get(name)
        return entry if isinstance(entry, dict) else None

    return facts


@dataclass(frozen=True, kw_only=True)
class PackageTarget:
    """A target as a package with the modules the module docstring lists, each imported when
    first asked: a `Target`.

    Attributes:
        name: its name (the package's ``NAME``).
        package: the package, importable by name (``mopar.targets.openfaas``).
    """

    name: str
    package: str

    @classmethod
    def of(cls, package: str) -> PackageTarget:
        """The target ``package`` is (its ``NAME``)."""
        return cls(name=str(_attr(package, "NAME")), package=package)

    @property
    def deploys(self) -> bool:
        return _attr(f"{self.package}.emit", "emit", optional=True) is not None

    def facts(self, profiles_dir: Path) -> Mapping[str, Any] | None:
        own = _attr(f"{self.package}.facts", "facts", optional=True)
        entry: Mapping[str, Any] | None = (own or platform_entry(self.name))(profiles_dir)
        return entry

    def chain_modes(self) -> tuple[ChainMode, ...]:
        return tuple(_attr(f"{self.package}.chains", "MODES"))

    def entry(self, mode: ChainMode, *, deployed: bool) -> Entry:
        entry: Entry = _attr(f"{self.package}.entry", "entry")(mode, deployed=deployed)
        return entry

    def image(self) -> ImageRecipe | None:
        recipe: ImageRecipe | None = _attr(f"{self.package}.image", "RECIPE", optional=True)
        return recipe

    def client(self) -> Client | None:
        client: Client | None = _attr(f"{self.package}.client", "CLIENT", optional=True)
        return client

    def emulation(self, mode: ChainMode, *, workers: int, timeout_s: float) -> Emulation | None:
        made: Emulation | None = _attr(f"{self.package}.emulate", "emulation")(
            mode, workers=workers, timeout_s=timeout_s
        )
        return made

    def emit(self, bundle: Path, plan: Any, *, config: CompileConfig, facts: Any) -> None:
        emit = _attr(f"{self.package}.emit", "emit", optional=True)
        if emit is not None:
            emit(bundle, plan, config=config, facts=facts)


BUILT_IN = ("mopar.targets.openfaas", "mopar.targets.aws_lambda")
"""The built-in target packages, registered when the registry is first asked; the first is the
default: what a plan that names no target, or a pricing-only one, deploys and runs as."""

_TARGETS: dict[str, Target] = {}


def _registry() -> dict[str, Target]:
    if not _TARGETS:
        for package in BUILT_IN:
            target = PackageTarget.of(package)
            _TARGETS[target.name] = target
    return _TARGETS


def register_target(target: Target | str) -> Target:
    """Add ``target`` (a `Target`, or the name of a package that is one: `PackageTarget`) to
    the registry under its name; return it.

    Raises:
        ValueError: another target already has that name.
    """
    if isinstance(target, str):
        target = PackageTarget.of(target)
    registry = _registry()
    if target.name in registry:
        raise ValueError(
            f"a target named {target.name!r} is already registered; give yours another name"
        )
    registry[target.name] = target
    return target


def unregister_target(name: str) -> None:
    """Remove the target ``name`` from the registry (a plug-in's tests clean up with it)."""
    _registry().pop(name, None)


def registered() -> tuple[Target, ...]:
    """The registered targets, the built-in ones first."""
    return tuple(_registry().values())


def target_or_default(name: str | None) -> Target:
    """The registered target ``name``; the default target (`BUILT_IN`'s first) for a plan that
    names none or a pricing-only target, which has no functions of its own to run."""
    registry = _registry()
    if name and name in registry:
        return registry[name]
    return next(iter(registry.values()))


def deploy_targets() -> tuple[Target, ...]:
    """The registered targets that write deployment files (a bundle carries those of the one
    its plan was made for: `target_or_default`)."""
    return tuple(t for t in registered() if t.deploys)
