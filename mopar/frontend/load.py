"""Load a model from any supported source into a `LoadedModel`.

Sources, told apart by their syntax and by the members of their zip archive:

* ``package.module:factory`` -- a Python callable returning an ``nn.Module``;
* ``*.pt2`` -- written by ``torch.export.save`` (carries its example inputs);
* TorchScript ``*.pt`` -- a zip archive with a ``code/`` folder;
* a pickled ``nn.Module`` (``torch.save(model)``) -- only with ``trust_pickle=True``, because
  unpickling runs arbitrary code.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mopar.errors import ModelLoadError, UntrustedPickleError

__all__ = ["LoadedModel", "load_model", "FACTORY_RE"]

log = logging.getLogger(__name__)

FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    """A model ready for capture.

    Attributes:
        name: a short name for the model (file stem or factory name).
        kind: ``factory``, ``pt2``, ``torchscript`` or ``pickle``.
        module: the eager module (``None`` for ``pt2``).
        exported: the ExportedProgram (``pt2`` only).
        stored_inputs: example inputs stored in the file, as (args, kwargs), if any.
    """

    name: str
    kind: str
    module: nn.Module | None = None
    exported: torch.export.ExportedProgram | None = None
    stored_inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None


def load_model(source: str | nn.Module, *, trust_pickle: bool = False) -> LoadedModel:
    """Load ``source`` (a path, a ``package.module:factory`` string, or a module)."""
    if isinstance(source, nn.Module):
        return LoadedModel(name=type(source).__name__.lower(), kind="module", module=source.eval())
    path = Path(source)
    if not path.exists() and FACTORY_RE.match(source):
        return _load_factory(source)
    if not path.exists():
        raise ModelLoadError(
            f"model file {source!r} does not exist; give a .pt2, a TorchScript .pt, "
            "or a factory as package.module:function"
        )
    if not path.is_file():
        raise ModelLoadError(f"model path {source!r} is a directory; give a model file")
    if not zipfile.is_zipfile(path):
        raise ModelLoadError(
            f"{source!r} is not a PyTorch model archive (not a zip file); it may be corrupt or a "
            "legacy pickle. Re-save it with torch.export.save(torch.export.export(model, args), "
            "'model.pt2')"
        )
    try:
        with zipfile.ZipFile(path) as zf:
            members = zf.namelist()
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelLoadError(f"{source!r} is a corrupt archive ({exc}); re-save the model") from None
    if any(m.endswith("/archive_format") for m in members) or path.suffix == ".pt2":
        return _load_pt2(path)
    if any("/code/" in m for m in members) and any(m.endswith("constants.pkl") for m in members):
        return _load_torchscript(path)
    if any(m.endswith("data.pkl") for m in members):
        return _load_pickle(path, trust_pickle=trust_pickle)
    raise ModelLoadError(
        f"{source!r} is a zip archive but not one torch writes (no archive_format, code/ or "
        "data.pkl member); give a .pt2, a TorchScript .pt, or a factory"
    )


def _cwd_on_path() -> None:
    """Like `uvicorn app:app`, resolve a factory's package, or a pickle's classes, from the
    working directory too."""
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))


def _load_factory(spec: str) -> LoadedModel:
    module_name, _, attr = spec.partition(":")
    _cwd_on_path()
    try:
        mod = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelLoadError(
            f"cannot import {module_name!r} for factory {spec!r}: {exc}; "
            "check the module is on PYTHONPATH or in the working directory"
        ) from None
    factory = getattr(mod, attr, None)
    if not callable(factory):
        raise ModelLoadError(f"{module_name!r} has no callable {attr!r} (from factory {spec!r})")
    model = factory()
    if not isinstance(model, nn.Module):
        raise ModelLoadError(
            f"factory {spec!r} returned {type(model).__name__}, expected a torch.nn.Module"
        )
    return LoadedModel(name=attr, kind="factory", module=model.eval())


def _load_pt2(path: Path) -> LoadedModel:
    try:
        ep = torch.export.load(str(path))
    except Exception as exc:  # torch raises many types for a bad archive
        raise ModelLoadError(
            f"cannot read {str(path)!r} as a torch.export archive ({type(exc).__name__}: "
            f"{_first_line(exc)}); re-save it with torch.export.save from torch {torch.__version__}"
        ) from None
    stored = ep.example_inputs
    return LoadedModel(name=path.stem, kind="pt2", exported=ep, stored_inputs=stored)


def _load_torchscript(path: Path) -> LoadedModel:
    try:
        module = torch.jit.load(str(path), map_location="cpu")
    except Exception as exc:
        raise ModelLoadError(
            f"cannot read {str(path)!r} as TorchScript ({_first_line(exc)}); "
            "re-save it with torch.jit.save"
        ) from None
    return LoadedModel(name=path.stem, kind="torchscript", module=module.eval())


def _load_pickle(path: Path, *, trust_pickle: bool) -> LoadedModel:
    try:
        # weights_only never runs code from the file: it only accepts tensors and containers.
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception:
        obj = None
        if not trust_pickle:
            raise UntrustedPickleError(
                f"{str(path)!r} is a pickled Python object; unpickling it runs arbitrary code "
                "from the file. Pass --trust-pickle if you trust its source, or re-save it with "
                "torch.export.save"
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
    return LoadedModel(name=path.stem, kind="pickle", module=obj.eval())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
