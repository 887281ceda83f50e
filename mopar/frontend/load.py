"""Load a model from any supported source into a `LoadedModel`.

Sources, told apart by their type, their syntax and the members of their zip archive:

* an ``nn.Module`` or a ``torch.export.ExportedProgram`` instance;
* ``package.module:factory`` -- a Python callable returning an ``nn.Module``;
* ``*.pt2`` -- written by ``torch.export.save`` (carries its example inputs);
* TorchScript ``*.pt`` -- a zip archive with a ``code/`` folder;
* a pickled ``nn.Module`` (``torch.save(model)``) -- only with ``trust_pickle=True``, because
  unpickling runs arbitrary code;
* a transformers model folder, as ``save_pretrained`` writes it (``config.json`` and
  ``*.safetensors``), loaded with ``from_pretrained``;
* with ``weightless=True`` only (planning), a model without weights: a transformers
  ``config.json`` (or a model folder holding one), built on the meta device, or any of the
  above on the meta device (`mopar.frontend.weightless`; `mopar.frontend.shapes` captures it);
* a `LoadedModel` -- as it is (a caller that loaded it itself, with its own options).

Before torch reads an archive, `mopar.frontend.archive` imports the installed modules that
define the types and operators it names (transformers' output classes and MoE operators, ...),
so a file saved in another process loads here too. Library noise is kept off the terminal
(`quiet_libraries`), and each failure is one `ModelLoadError` line that says what to do.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import stat
import sys
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mopar._quiet import Quieted, quiet_libraries
from mopar.errors import (
    DEBUG,
    MachineMemoryError,
    ModelLoadError,
    Option,
    Part,
    UntrustedPickleError,
)
from mopar.frontend import archive
from mopar.frontend.mapped import mapped_weights
from mopar.frontend.weightless import (
    config_name,
    config_path,
    is_weightless,
    load_config,
    load_pretrained,
    pretrained_weights,
)

__all__ = ["LoadedModel", "load_model", "FACTORY_RE"]

log = logging.getLogger(__name__)

FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    """A model ready for capture.

    Attributes:
        name: a short name for the model (file stem, factory name or class name).
        kind: ``module``, ``exported``, ``factory``, ``pt2``, ``torchscript``, ``pickle`` or
            ``transformers`` (a ``save_pretrained`` folder: config and safetensors).
        module: the eager module (``None`` for ``pt2`` and ``exported``), as it was given or
            made: in training mode if it was (capture runs it in eval mode, and gives a caller's
            module its flags back).
        exported: the ExportedProgram (``pt2`` and ``exported`` only).
        stored_inputs: example inputs stored with the program, as (args, kwargs), if any.
        weightless: its weights are on the meta device (shapes, no values): it can be planned,
            not compiled (kind ``config``: built so from a transformers config).
    """

    name: str
    kind: str
    module: nn.Module | None = None
    exported: torch.export.ExportedProgram | None = None
    stored_inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    weightless: bool = False


Source = str | os.PathLike | nn.Module | torch.export.ExportedProgram | LoadedModel


def load_model(
    source: Source, *, trust_pickle: bool = False, weightless: bool = False
) -> LoadedModel:
    """Load ``source``: a path, a ``package.module:factory`` string, a module, an
    ExportedProgram, or a `LoadedModel` (returned as it is).

    Args:
        weightless: take a model without weights too (a transformers config, or weights on the
            meta device), to plan it; else such a model is refused, naming the fix.

    Raises:
        ModelLoadError: the source is missing, unreadable, of an unknown kind, or needs a package
            that is not installed; the message says what to do.
        MachineMemoryError: compiling would not fit its weights in this machine's memory.
    """
    if isinstance(source, LoadedModel):
        return source
    text = os.fspath(source) if isinstance(source, (str, os.PathLike)) else None
    found = weightless_config(text) if text is not None else None
    if found is not None:
        if weightless:
            return LoadedModel(
                name=config_name(found), kind="config", module=load_config(found), weightless=True
            )
        if not (files := pretrained_weights(found.parent)):
            raise ModelLoadError(_config_refusal(text))
        _fits(config_name(found), sum(f.stat().st_size for f in files))
        return _check_weights(
            LoadedModel(
                name=config_name(found), kind="transformers", module=load_pretrained(found.parent)
            ),
            weightless=False,
        )
    if text is not None and not weightless and (path := Path(text)).is_file():
        _fits(path.stem, path.stat().st_size)  # the weights, as a file holds them
    loaded = _check_weights(_load(source, trust_pickle=trust_pickle), weightless=weightless)
    if not weightless and loaded.kind in ("module", "exported", "factory"):
        held = sum(t.nbytes for _, t in _tensors(loaded) if isinstance(t, torch.Tensor))
        _fits(loaded.name, held, held=True)
    return loaded


COMPILE_PEAK = 1.5
"""What compiling holds at its peak over the model's weight bytes (the compiler and the function
processes it starts): measured at 1.14-1.53x on 1.5 and 4.4 GB decoders (docs/scale-measured.md)."""


def available_bytes() -> int:
    """The memory this machine has available now (the kernel's MemAvailable), bytes."""
    import psutil

    return int(psutil.virtual_memory().available)


def _fits(name: str, nbytes: int, *, held: bool = False) -> None:
    """Refuse, before torch loads them, weights of ``nbytes`` that compiling would not fit in
    this machine's available memory (``held``: they are in memory already).

    Raises:
        MachineMemoryError: with the numbers, naming mopar plan, which needs no weights.
    """
    need, room = nbytes * (COMPILE_PEAK - held), available_bytes()
    if need <= room:
        return
    raise MachineMemoryError(
        f"model {name!r} has {nbytes / 2**20:,.0f} MB of weights and compiling it holds about "
        f"{COMPILE_PEAK:g}x its weights, {need / 2**20:,.0f} MB{' more' if held else ''}, but "
        f"this machine has {room / 2**20:,.0f} MB available; compile it on a machine with more "
        "memory, or plan it without its weights: mopar plan CONFIG.json (its transformers "
        "config) or a .pt2 of it on the meta device",
        weights_bytes=nbytes,
        available_bytes=room,
        factor=COMPILE_PEAK,
    )


def weightless_config(text: str) -> Path | None:
    """The transformers config a model source names (a ``.json`` file, or a folder that holds
    ``config.json``), else None."""
    path = Path(text)
    return config_path(path) if path.exists() else None


def _config_refusal(text: str) -> str:
    return (
        f"{text!r} is a transformers config, which holds no weights, and this runs the model; "
        "give the weights: the folder save_pretrained wrote (config.json and its "
        "*.safetensors), or a .pt2 that torch.export.save wrote of the model loaded with "
        "from_pretrained (mopar plan plans a config alone, from its shapes)"
    )


def _load(
    source: str | os.PathLike | nn.Module | torch.export.ExportedProgram, *, trust_pickle: bool
) -> LoadedModel:
    if isinstance(source, nn.Module):
        return LoadedModel(name=type(source).__name__.lower(), kind="module", module=source)
    if isinstance(source, torch.export.ExportedProgram):
        return LoadedModel(
            name=_program_name(source),
            kind="exported",
            exported=source,
            stored_inputs=source.example_inputs,
        )
    if not isinstance(source, (str, os.PathLike)):
        raise ModelLoadError(
            f"cannot load a model from a {type(source).__name__}; give a path, a factory "
            "'package.module:function', an nn.Module or a torch.export.ExportedProgram"
        )
    text = os.fspath(source)
    path = Path(text)
    if isinstance(source, str) and not path.exists() and FACTORY_RE.match(source):
        return _load_factory(source)
    if not path.exists():
        raise ModelLoadError(
            f"model file {text!r} does not exist; give a .pt2, a TorchScript .pt, "
            "or a factory as package.module:function"
        )
    if not path.is_file():
        raise ModelLoadError(
            f"model path {text!r} is {_kind_of(path)}, not a file; give a model file (a .pt2, "
            "a TorchScript .pt)"
        )
    if not zipfile.is_zipfile(path):
        raise ModelLoadError(
            f"{text!r} is not a PyTorch model archive (not a zip file); it may be corrupt or a "
            "legacy pickle. Re-save it with torch.export.save(torch.export.export(model, args), "
            "'model.pt2')"
        )
    try:
        with zipfile.ZipFile(path) as zf:
            members = zf.namelist()
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelLoadError(f"{text!r} is a corrupt archive ({exc}); re-save the model") from None
    if any(m.endswith("/archive_format") for m in members) or path.suffix == ".pt2":
        return _load_pt2(path)
    if any("/code/" in m for m in members) and any(m.endswith("constants.pkl") for m in members):
        return _load_torchscript(path)
    if any(m.endswith("data.pkl") for m in members):
        return _load_pickle(path, trust_pickle=trust_pickle)
    raise ModelLoadError(
        f"{text!r} is a zip archive but not one torch writes (no archive_format, code/ or "
        "data.pkl member); give a .pt2, a TorchScript .pt, or a factory"
    )


def _check_weights(model: LoadedModel, *, weightless: bool) -> LoadedModel:
    """``model``, marked weightless where its weights are on the meta device (built under
    ``init_empty_weights`` or ``device='meta'``) and ``weightless`` allows it; else refused
    where its weights are not in CPU memory: on the meta device it has none, and mopar runs
    models on the CPU.

    Raises:
        ModelLoadError: naming the first such weights, their device and the fix.
    """
    if not (tensors := _tensors(model)):
        return model
    if weightless and is_weightless(tensors):
        return replace(model, weightless=True)
    away = [
        (n, t.device) for n, t in tensors if isinstance(t, torch.Tensor) and t.device.type != "cpu"
    ]
    if not away:
        return model
    (name, device), more = away[0], f" and {len(away) - 1} more" if len(away) > 1 else ""
    which = f"its tensor{'s' if more else ''} {name!r}{more} {'are' if more else 'is'}"
    if device.type == "meta":
        raise ModelLoadError(
            f"model {model.name!r} has no weights: {which} on the meta device, "
            "which holds shapes but no values, and this runs the model; give the weights: "
            "load them first (model.to_empty(device='cpu') then model.load_state_dict(...), or "
            "from_pretrained(...) without device_map='meta' or init_empty_weights); a model "
            "without weights is planned by mopar plan"
        )
    raise ModelLoadError(
        f"model {model.name!r} is not on the CPU: {which} on {device}, and mopar captures and "
        "serves models on the CPU; pass model.cpu() (or copy.deepcopy(model).cpu() to keep "
        "yours where it is)"
    )


def _tensors(model: LoadedModel) -> list[tuple[str, Any]]:
    """The model's named parameters and buffers (an exported program's state and constants)."""
    if model.module is not None:
        return [*model.module.named_parameters(), *model.module.named_buffers()]
    if model.exported is not None:
        return [*model.exported.state_dict.items(), *model.exported.constants.items()]
    return []


def _kind_of(path: Path) -> str:
    """What a path that is not a regular file is: ``a directory``, ``a character device`` ..."""
    mode = path.stat().st_mode
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _program_name(ep: torch.export.ExportedProgram) -> str:
    """The lower-cased class name of the exported root module, else ``exported``."""
    for node in ep.graph.nodes:
        for path, type_name in (node.meta.get("nn_module_stack") or {}).values():
            if path == "" and isinstance(type_name, str):
                return type_name.rsplit(".", 1)[-1].lower()
    return "exported"


def _cwd_on_path() -> None:
    """Like `uvicorn app:app`, resolve a factory's package, or a pickle's classes, from the
    working directory too."""
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))


# --- factories ------------------------------------------------------------------------------------


def _load_factory(spec: str) -> LoadedModel:
    module_name, _, attr = spec.partition(":")
    _cwd_on_path()
    with quiet_libraries():
        mod = _import_factory_module(module_name, spec)
        factory = getattr(mod, attr, None)
        if not callable(factory):
            raise ModelLoadError(
                f"{module_name!r} has no callable {attr!r} (from factory {spec!r})"
            )
        try:
            model = factory()
        except Exception as exc:
            raise ModelLoadError(
                f"factory {spec!r} raised {type(exc).__name__}: {_first_line(exc)}; fix the "
                "factory (rerun with ",
                DEBUG,
                " for the traceback)",
            ) from exc
    if not isinstance(model, nn.Module):
        raise ModelLoadError(
            f"factory {spec!r} returned {type(model).__name__}, expected a torch.nn.Module"
        )
    return LoadedModel(name=attr, kind="factory", module=model)


def _import_factory_module(module_name: str, spec: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and not (module_name == missing or module_name.startswith(missing + ".")):
            top = missing.split(".")[0]
            raise ModelLoadError(
                f"factory {spec!r} needs module {missing!r}, which is not installed; "
                f"pip install {top} (the package that provides it), then retry"
            ) from None
        raise ModelLoadError(
            f"cannot import {module_name!r} for factory {spec!r}: {exc}; "
            "check the module is on PYTHONPATH or in the working directory"
        ) from None
    except Exception as exc:  # a user's module may raise anything on import
        raise ModelLoadError(
            f"cannot import {module_name!r} for factory {spec!r}: it raised "
            f"{type(exc).__name__}: {_first_line(exc)}; fix the module (rerun with ",
            DEBUG,
            " for the traceback)",
        ) from exc


# --- archives -------------------------------------------------------------------------------------


def _load_pt2(path: Path) -> LoadedModel:
    names = archive.read_pt2_names(path)
    with quiet_libraries() as quieted:
        # Tried even when a package seems missing: the names are only what mopar could read.
        provision = archive.provide(names)
        try:
            with mapped_weights(path):
                ep = torch.export.load(str(path))
        except Exception as exc:  # torch raises many types for a bad archive
            raise ModelLoadError(*_pt2_failure(path, names, provision, quieted, exc)) from None
    return LoadedModel(name=path.stem, kind="pt2", exported=ep, stored_inputs=ep.example_inputs)


def _pt2_failure(
    path: Path,
    names: archive.ArchiveNames,
    provision: archive.Provision,
    quieted: Quieted,
    exc: BaseException,
) -> tuple[Part, ...]:
    """The one line that explains why ``torch.export.load`` failed: the names still unknown,
    another torch or schema version (only when the archive says so), or torch's own reason."""
    if provision.missing:
        return (archive.missing_package_message(str(path), provision),)
    head = f"cannot read {str(path)!r} as a torch.export archive"
    cause = quieted.last_exception() or exc
    version = _version_mismatch(names, cause)
    if provision.unresolved:
        why = archive.unresolved_message(provision)
        return (f"{head}: ", *why, f"; {version}" if version else "")
    reason = f"{type(cause).__name__}: {_first_line(cause)}"
    if version:
        return (f"{head} ({reason}); {version}",)
    return (
        f"{head} ({reason}); the file may be damaged: re-save it with torch.export.save "
        "(rerun with ",
        DEBUG,
        " to see torch's log)",
    )


_FILE_VERSION_RE = re.compile(
    r"file with version (\d+), but the maximum supported version[^\d]*(\d+)"
)
"""torch's words for a zip container newer than it reads (it has no Python constant for it)."""


def _version_mismatch(names: archive.ArchiveNames, cause: BaseException) -> str | None:
    """Why the archive is another torch's, naming both versions where known, and the fix;
    None where nothing says so."""
    from torch._export.serde.schema import SCHEMA_VERSION
    from torch.export.pt2_archive.constants import ARCHIVE_VERSION_VALUE

    ours = _release(torch.__version__)
    theirs = _release(names.torch_version or ours)
    theirs = theirs if theirs != ours else None  # this torch's own number names no other
    saved = f"torch {theirs}" if theirs else "another torch version"
    fix = (
        f"load it with torch {theirs}, or re-export the model with this torch {ours}"
        if theirs
        else f"load it with the torch that saved it, or re-export the model with this torch {ours}"
    )
    if names.schema_version and names.schema_version[0] != SCHEMA_VERSION[0]:
        return (
            f"it was saved by {saved} with export schema {names.schema_version[0]}.x, and this "
            f"torch {ours} reads schema {SCHEMA_VERSION[0]}.x; {fix}"
        )
    if names.archive_version is not None and names.archive_version != ARCHIVE_VERSION_VALUE:
        return (
            f"it was saved by {saved} as .pt2 archive version {names.archive_version}, and this "
            f"torch {ours} reads archive version {ARCHIVE_VERSION_VALUE}; {fix}"
        )
    if found := _FILE_VERSION_RE.search(str(cause)):
        return (
            f"it was saved by {saved} in file format version {found.group(1)}, and this torch "
            f"{ours} reads up to version {found.group(2)}; {fix}"
        )
    if theirs:
        return f"it was saved by torch {theirs} and this is torch {ours}; {fix}"
    return None


def _release(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0``."""
    return version.split("+")[0]


def _load_torchscript(path: Path) -> LoadedModel:
    names = archive.read_torchscript_names(path)
    with quiet_libraries() as quieted:
        provision = archive.provide(names)
        try:
            module = torch.jit.load(str(path), map_location="cpu")
        except Exception as exc:
            raise ModelLoadError(*_torchscript_failure(path, provision, quieted, exc)) from None
    return LoadedModel(name=path.stem, kind="torchscript", module=module)


def _torchscript_failure(
    path: Path, provision: archive.Provision, quieted: Quieted, exc: BaseException
) -> tuple[Part, ...]:
    if provision.missing:
        return (archive.missing_package_message(str(path), provision),)
    head = f"cannot read {str(path)!r} as TorchScript"
    if provision.unresolved:
        return (f"{head}: ", *archive.unresolved_message(provision))
    cause = quieted.last_exception() or exc
    return (
        f"{head} ({_first_line(cause)}); the file may be damaged or from a newer torch "
        f"(this is torch {_release(torch.__version__)}): re-save it with torch.jit.save, "
        "or better, with torch.export.save",
    )


def _load_pickle(path: Path, *, trust_pickle: bool) -> LoadedModel:
    try:
        # weights_only never runs code from the file: it only accepts tensors and containers.
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception:
        obj = None
        if not trust_pickle:
            raise UntrustedPickleError(
                f"{str(path)!r} is a pickled Python object; unpickling it runs arbitrary code "
                "from the file. Pass ",
                Option("trust_pickle", value=True),
                " if you trust its source, or re-save it with torch.export.save",
            ) from None
    if obj is not None:
        raise ModelLoadError(
            f"{str(path)!r} holds {type(obj).__name__} (weights only), not a model; build the "
            "model in a factory package.module:function that loads these weights"
        )
    _cwd_on_path()
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=False)
    except Exception as exc:
        raise ModelLoadError(
            f"cannot unpickle {str(path)!r} ({type(exc).__name__}: {_first_line(exc)}); the "
            "classes it needs must be importable; prefer torch.export.save"
        ) from None
    if not isinstance(obj, nn.Module):
        raise ModelLoadError(f"{str(path)!r} holds {type(obj).__name__}, expected an nn.Module")
    return LoadedModel(name=path.stem, kind="pickle", module=obj)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
