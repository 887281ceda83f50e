"""What a saved model names outside torch, and importing the installed modules that define it.

A ``.pt2`` written by ``torch.export.save`` names the pytree types of its inputs and outputs
(``transformers.modeling_outputs.BaseModelOutput``) and the operators of its graph
(``torch.ops.transformers.grouped_mm_fallback``). Both exist in a process only once their
defining module has run, and ``torch.export.load`` imports nothing itself. A TorchScript archive
names custom operators and classes in its ``code/`` files the same way.

Read in this order:

* `read_pt2_names` / `read_torchscript_names` -- pure: open the zip and collect the names, never
  unpickling anything;
* `provide` -- import, for each name that torch does not know yet, the module that defines it, if
  its package is installed; returns a `Provision` saying what is still missing;
* `missing_package_message` / `unresolved_message` -- the one-line errors built from it.

Only modules of installed, non-standard-library packages are imported, and only names that pass
`_DOTTED_RE` (Python identifiers joined by dots): a hostile archive can at most import an installed
module. Nothing is unpickled.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import re
import sys
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from mopar.errors import DEBUG, Part

__all__ = [
    "ArchiveNames",
    "Provision",
    "missing_package_message",
    "provide",
    "read_pt2_names",
    "read_torchscript_names",
    "unresolved_message",
]

log = logging.getLogger(__name__)

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED_RE = re.compile(rf"^{_IDENT}(?:\.{_IDENT}){{0,30}}$")
_OP_TARGET_RE = re.compile(rf"^torch\.ops\.({_IDENT})\.({_IDENT})(?:\.{_IDENT})?$")
# TorchScript code calls custom ops as ``ops.NS.OP(...)`` and names classes as
# ``__torch__.torch.classes.NS.CLASS``.
_TS_OP_RE = re.compile(rf"\bops\.({_IDENT})\.({_IDENT})\b")
_TS_CLASS_RE = re.compile(rf"\btorch\.classes\.({_IDENT})\.({_IDENT})\b")
_PT2_MODEL_RE = re.compile(r"(?:^|/)(?:models/[^/]+\.json|serialized_exported_program\.json)$")
_PT2_VERSION_RE = re.compile(r"^[^/]+/archive_version$")

# Where an operator namespace is not registered by importing the package of the same name.
# Checked after that package; a scan of the package's source (`_scan_for_op`) comes last.
_OP_MODULES: dict[str, tuple[str, ...]] = {
    "transformers": ("transformers.integrations.moe",),
    "transformers_msa": ("transformers.integrations.msa_attention",),
    "quantized_decomposed": ("torch.ao.quantization.fx._decomposed",),
}
# Namespaces of torch itself that the dispatcher does not list: an unknown op in one of these,
# or in any namespace that already has ops here, comes from another torch, not a missing package.
_TORCH_NAMESPACES = frozenset({"higher_order", "prim"})
# The package to install for a namespace or top-level module, where it differs from the name.
_PACKAGE_OF: dict[str, str] = {"transformers_msa": "transformers"}
# How to install a package, where mopar knows better than ``pip install NAME``.
_INSTALL_HINT: dict[str, str] = {"transformers": "pip install transformers (or mopar[models])"}
# Past this many source files, a package is not scanned for an operator's definition.
_SCAN_MAX_FILES = 20_000
_SCAN_MAX_HITS = 3


@dataclass(frozen=True, kw_only=True)
class ArchiveNames:
    """The names a saved model refers to that torch may not know.

    Attributes:
        types: dotted names of the pytree node types in its treespecs.
        ops: (namespace, name) of each ``torch.ops.NS.NAME`` its graphs call.
        classes: (namespace, name) of each ``torch.classes.NS.NAME`` custom class it holds.
        torch_version: the torch version that saved it, when the archive records one.
        schema_version: the export schema version (major, minor), when recorded.
        archive_version: the ``.pt2`` archive format version (``archive_version``), when there.
    """

    types: frozenset[str] = frozenset()
    ops: frozenset[tuple[str, str]] = frozenset()
    classes: frozenset[tuple[str, str]] = frozenset()
    torch_version: str | None = None
    schema_version: tuple[int, int] | None = None
    archive_version: str | None = None


@dataclass(frozen=True, kw_only=True)
class Provision:
    """What `provide` did, and what it could not make available.

    Attributes:
        missing: a package that is not installed -> the archive's names that need it.
        unresolved: names still unknown to torch after importing their modules.
        imported: modules imported to define the names, in order.
        failed: ``module: ExceptionType: message`` for each module whose import raised.
    """

    missing: dict[str, tuple[str, ...]] = field(default_factory=dict)
    unresolved: tuple[str, ...] = ()
    imported: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()


# --- reading --------------------------------------------------------------------------------------


def read_pt2_names(path: Path) -> ArchiveNames:
    """Collect the names in every serialized program of the ``.pt2`` at ``path``.

    A member that cannot be read or is not JSON is skipped: torch's own loader reports the damage.
    """
    types: set[str] = set()
    ops: set[tuple[str, str]] = set()
    classes: set[tuple[str, str]] = set()
    torch_version: str | None = None
    schema: tuple[int, int] | None = None
    for member, data in _members(path, _PT2_MODEL_RE.search):
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            log.debug("skipping %s: not JSON (%s)", member, exc)
            continue
        if not isinstance(doc, dict):
            continue
        found = _collect(doc)
        types |= found.types
        ops |= found.ops
        classes |= found.classes
        torch_version = torch_version or _str_or_none(doc.get("torch_version"))
        schema = schema or _schema(doc.get("schema_version"))
    archive_version = next(
        (
            data.decode("ascii", "replace").strip()
            for _, data in _members(path, _PT2_VERSION_RE.match)
        ),
        None,
    )
    return ArchiveNames(
        types=frozenset(types),
        ops=frozenset(ops),
        classes=frozenset(classes),
        torch_version=torch_version,
        schema_version=schema,
        archive_version=archive_version,
    )


def read_torchscript_names(path: Path) -> ArchiveNames:
    """Collect the custom operators and classes named by a TorchScript archive's code."""
    ops: set[tuple[str, str]] = set()
    classes: set[tuple[str, str]] = set()
    for _, data in _members(path, lambda m: "/code/" in m and m.endswith(".py")):
        text = data.decode("utf-8", errors="replace")
        ops.update(_TS_OP_RE.findall(text))
        classes.update(_TS_CLASS_RE.findall(text))
    return ArchiveNames(ops=frozenset(ops), classes=frozenset(classes))


def _members(path: Path, wanted: Callable[[str], object]) -> Iterator[tuple[str, bytes]]:
    with zipfile.ZipFile(path) as zf:
        for member in zf.namelist():
            if not wanted(member):
                continue
            try:
                yield member, zf.read(member)
            except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as exc:
                log.debug("skipping %s: unreadable (%s)", member, exc)


def _collect(doc: Any) -> ArchiveNames:
    """Walk a serialized ExportedProgram: op targets of graph nodes (nested graphs too),
    torchbind class names, and the types inside every treespec string."""
    types: set[str] = set()
    ops: set[tuple[str, str]] = set()
    classes: set[tuple[str, str]] = set()
    for value in _walk(doc):
        if isinstance(value, dict):
            target = value.get("target")
            if isinstance(target, str) and (m := _OP_TARGET_RE.match(target)):
                ops.add((m.group(1), m.group(2)))
            fqn = value.get("class_fqn")
            if isinstance(fqn, str) and (m := _TS_CLASS_RE.search(fqn)):
                classes.add((m.group(1), m.group(2)))
            fields = value.get("treespec_namedtuple_fields")
            if isinstance(fields, dict):
                types.update(k for k in fields if isinstance(k, str))
        elif isinstance(value, str) and value.startswith("[") and '"type"' in value:
            types.update(_treespec_types(value))
    return ArchiveNames(
        types=frozenset(t for t in types if _DOTTED_RE.match(t)),
        ops=frozenset(ops),
        classes=frozenset(classes),
    )


def _walk(doc: Any) -> Iterator[Any]:
    stack = [doc]
    while stack:
        value = stack.pop()
        yield value
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def _treespec_types(text: str) -> set[str]:
    """Types in a serialized treespec ``[protocol, {"type", "context", "children_spec"}]``;
    a namedtuple's own type name is its context."""
    try:
        spec = json.loads(text)
    except ValueError:
        return set()
    found: set[str] = set()
    for node in _walk(spec):
        if not isinstance(node, dict) or not isinstance(node.get("type"), str):
            continue
        found.add(node["type"])
        if node["type"] == "collections.namedtuple" and isinstance(node.get("context"), str):
            try:
                name = json.loads(node["context"])
            except ValueError:
                name = None
            if isinstance(name, str):
                found.add(name)
    return found


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _schema(value: Any) -> tuple[int, int] | None:
    if isinstance(value, dict) and isinstance(value.get("major"), int):
        return int(value["major"]), int(value.get("minor") or 0)
    return None


# --- providing ------------------------------------------------------------------------------------


def provide(names: ArchiveNames) -> Provision:
    """Import the installed modules that define ``names``; say what is still missing.

    Types: import each prefix of the dotted name that is a module (``a``, ``a.b``, ...).
    Operators and classes: import the package named like the namespace, then the modules of
    `_OP_MODULES`, then the modules whose source registers ``NS::NAME``.
    """
    importer = _Importer()
    missing: dict[str, list[str]] = {}
    unresolved: list[str] = []
    for name in sorted(names.types):
        if _type_known(name):
            continue
        lacking = importer.prefixes(name)
        if lacking:
            missing.setdefault(lacking, []).append(name)
        elif not _type_known(name):
            unresolved.append(name)
    for kind, pairs in (("ops", names.ops), ("classes", names.classes)):
        known = _known(kind)
        for ns, attr in sorted(pairs):
            label = f"torch.{kind}.{ns}.{attr}"
            if known(ns, attr):
                continue
            lacking = importer.namespace(ns, attr, known)
            if lacking:
                missing.setdefault(lacking, []).append(label)
            elif not known(ns, attr):
                unresolved.append(label)
    if importer.imported:
        log.debug("imported %s to define the archive's names", ", ".join(importer.imported))
    return Provision(
        missing={k: tuple(v) for k, v in missing.items()},
        unresolved=tuple(unresolved),
        imported=tuple(importer.imported),
        failed=tuple(importer.failed),
    )


def _type_known(name: str) -> bool:
    registry = getattr(pytree, "SERIALIZED_TYPE_TO_PYTHON_TYPE", None)
    return registry is None or name in registry


def _known(kind: str) -> Callable[[str, str], bool]:
    """Whether ``torch.<kind>.<ns>.<name>`` resolves (``kind``: ``ops`` or ``classes``)."""

    def known(ns: str, name: str) -> bool:
        try:
            getattr(getattr(getattr(torch, kind), ns), name)
        except (AttributeError, RuntimeError):
            return False
        return True

    return known


def _installed(top: str) -> bool:
    """Whether ``top`` is an importable package outside the standard library (and ``__main__``):
    those never define an archive's types, and some do things on import."""
    if _own_name(top):
        return False
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


class _Importer:
    """Imports modules on behalf of `provide`, remembering what it imported and what failed."""

    def __init__(self) -> None:
        self.imported: list[str] = []
        self.failed: list[str] = []

    def prefixes(self, dotted: str) -> str | None:
        """Import ``a``, ``a.b``, ... of ``dotted`` while they are modules; return the package
        to install when one is missing, else None."""
        parts = dotted.split(".")
        if not _installed(parts[0]):
            return None if _own_name(parts[0]) else _PACKAGE_OF.get(parts[0], parts[0])
        for i in range(1, len(parts)):
            outcome = self.load(".".join(parts[:i]))
            if outcome == "absent":
                return None  # the rest of the name is a class path
            if outcome not in ("ok", "failed"):
                return outcome
        return None

    def namespace(self, ns: str, attr: str, known: Callable[[str, str], bool]) -> str | None:
        """Import what may register ``torch.ops.NS.ATTR`` (or a class); return the package to
        install when none of its candidate packages is installed."""
        candidates = [ns, *_OP_MODULES.get(ns, ())]
        installed = [t for t in dict.fromkeys(c.split(".")[0] for c in candidates) if _installed(t)]
        if not installed:
            return None if _torch_namespace(ns) else _PACKAGE_OF.get(ns, ns)
        for module in candidates:
            if module.split(".")[0] not in installed:
                continue
            outcome = self.load(module)
            if outcome not in ("ok", "failed", "absent"):
                return outcome
            if known(ns, attr):
                return None
        for module in _scan_for_op(installed, f"{ns}::{attr}"):
            self.load(module)
            if known(ns, attr):
                return None
        return None

    def load(self, module: str) -> str:
        """Import ``module``: "ok"; "absent" when there is no such module; "failed" when it
        raised; or the top-level name of a dependency it needs that is not installed."""
        if not _DOTTED_RE.match(module):
            return "absent"
        already = module in sys.modules
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and (exc.name == module or module.startswith(exc.name + ".")):
                return "absent"
            return (exc.name or "").split(".")[0] or self._fail(module, exc)
        except Exception as exc:  # a module of an installed package may raise anything on import
            return self._fail(module, exc)
        if not already:
            self.imported.append(module)
        return "ok"

    def _fail(self, module: str, exc: BaseException) -> str:
        text = " ".join(str(exc).split())[:200]
        self.failed.append(f"{module}: {type(exc).__name__}: {text}")
        log.debug("importing %s failed", module, exc_info=exc)
        return "failed"


def _own_name(top: str) -> bool:
    """Names no package provides: the exporting script's, and the standard library's."""
    return top == "__main__" or top in sys.stdlib_module_names


def _torch_namespace(ns: str) -> bool:
    """Whether ``ns`` is torch's own: no package provides it, yet it has ops here."""
    if ns in _TORCH_NAMESPACES:
        return True
    if ns in _OP_MODULES or _installed(ns):
        return False
    all_ops = getattr(torch._C, "_dispatch_get_all_op_names", lambda: ())  # private: guarded
    return any(name.startswith(ns + "::") for name in all_ops())


def _scan_for_op(packages: Iterable[str], qualified: str) -> list[str]:
    """Modules of ``packages`` whose source names ``"NS::NAME"`` in quotes, as a registration
    (``torch.library.custom_op("NS::NAME", ...)``) does."""
    needles = (f'"{qualified}"'.encode(), f"'{qualified}'".encode())
    hits: list[str] = []
    for package in packages:
        spec = importlib.util.find_spec(package)
        roots = list(spec.submodule_search_locations or []) if spec else []
        for root in map(Path, roots):
            for i, file in enumerate(sorted(root.rglob("*.py"))):
                if i >= _SCAN_MAX_FILES or len(hits) >= _SCAN_MAX_HITS:
                    break
                try:
                    text = file.read_bytes()
                except OSError:
                    continue
                if any(n in text for n in needles):
                    parts = file.relative_to(root).with_suffix("").parts
                    parts = parts[:-1] if parts[-1] == "__init__" else parts
                    module = ".".join((package, *parts))
                    if _DOTTED_RE.match(module):
                        hits.append(module)
    log.debug("source of %s registering %s: %s", ", ".join(packages), qualified, hits)
    return hits


# --- messages -------------------------------------------------------------------------------------


def missing_package_message(source: str, provision: Provision) -> str:
    """One line: which package the model was exported from, and how to install it."""
    package, needs = next(iter(provision.missing.items()))
    hint = _INSTALL_HINT.get(package, f"pip install {package}")
    others = [p for p in provision.missing if p != package]
    also = f"; it also needs {', '.join(others)}" if others else ""
    return (
        f"{source!r} was exported from {package} (it uses {_few(needs)}), which is not installed "
        f"in this Python; {hint}{also}, then retry"
    )


def unresolved_message(provision: Provision) -> tuple[Part, ...]:
    """Why the names torch still does not know stayed unknown, and what to do."""
    names = provision.unresolved
    main = [n for n in names if n.startswith("__main__.")]
    if main:
        return (
            f"it names {_few(main)}, a class defined in the script that exported it; move the "
            "class into an importable module (or return a tuple or dict from forward()) and "
            "re-export",
        )
    if provision.failed:
        return (
            f"it uses {_few(names)}, and importing its module failed ({provision.failed[0]}); "
            "fix that installation (rerun with ",
            DEBUG,
            " for the traceback)",
        )
    torch_ops = [
        n for n in names if n.startswith("torch.ops.") and _torch_namespace(n.split(".")[2])
    ]
    if torch_ops:
        return (
            f"it uses {_few(torch_ops)}, which this torch {torch.__version__.split('+')[0]} does "
            "not have; it was probably exported by another torch version: re-export it with "
            "this one",
        )
    if any(n.startswith("torch.ops.transformers.") for n in names):
        return (
            f"it uses {_few(names)}, which the installed transformers does not register; install "
            "the transformers version that exported it, or re-export with "
            'experts_implementation="batched_mm" in the model config (standard ops only)',
        )
    return (
        f"it uses {_few(names)}, which importing {', '.join(provision.imported) or 'its package'} "
        "did not register; import the module that registers it before loading, or re-export "
        "the model without it",
    )


def _few(names: Iterable[str], limit: int = 3) -> str:
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
