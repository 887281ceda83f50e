"""The function runtime every bundle carries: ``template/mopar-onnx/``.

It is OpenFaaS's language template (``faas-cli build`` builds each function from it) and the
source of every other image too: ``Dockerfile.lambda`` copies its requirements, installer and
runtime copy, and ``mopar run --containers`` builds its ``Dockerfile`` for a bundle of any
target. So each built-in target's emitter writes it (`write_runtime`), whatever target the
bundle was planned for, beside that target's own deployment files.

What it holds: the shipped template (`template_source`), its ``requirements.txt`` pinned to the
versions installed here (`RUNTIME_REQUIREMENTS`), and ``mopar/``, mopar's torch-free part that
a deployed function runs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mopar.config import TEMPLATES_DIR
from mopar.emit.bundle import pinned
from mopar.errors import BundleError

__all__ = [
    "RUNTIME_REQUIREMENTS",
    "TEMPLATE_DIR",
    "TEMPLATE_LANG",
    "template_source",
    "write_runtime",
]

TEMPLATE_LANG = "mopar-onnx"
"""The template's name: OpenFaaS's ``lang`` of every function."""
TEMPLATE_DIR = f"template/{TEMPLATE_LANG}"
"""Where a bundle holds it, relative to its root."""
RUNTIME_REQUIREMENTS = ("numpy", "onnxruntime", "zstandard", "waitress", "redis")
"""The distributions a function imports at run time (the template's ``requirements.txt``)."""
_RUNTIME_SOURCES = ("__init__.py", "errors.py", "codec", "bundle", "runtime")
"""What a deployed function runs, relative to the package: `mopar.runtime` and what it imports
(`mopar.bundle` reads its ``function.json``). The local drivers (`mopar.runner`) stay behind."""


def template_source() -> Path:
    """The canonical ``mopar-onnx`` template: ``openfaas/mopar-onnx`` of the shipped templates
    (`mopar.config.TEMPLATES_DIR`: the wheel's package data, or the checkout's ``templates/``).

    Raises:
        BundleError: it is not there (an incomplete installation).
    """
    path = TEMPLATES_DIR / "openfaas" / TEMPLATE_LANG
    if not (path / "template.yml").is_file():
        raise BundleError(
            f"the OpenFaaS template {TEMPLATE_LANG!r} is missing from {str(path)!r}, so this "
            "mopar is incomplete; reinstall mopar with pip"
        )
    return path


def write_runtime(bundle: Path) -> None:
    """Write ``template/mopar-onnx/`` into ``bundle`` (replacing an older copy): the template,
    its pinned ``requirements.txt`` and ``mopar/``, the runtime's copy.

    Raises:
        BundleError: the template source is missing (`template_source`).
    """
    source = template_source()
    dest = Path(bundle) / TEMPLATE_DIR
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    head = "# mopar-onnx run-time requirements, pinned to the compiler's environment."
    (dest / "requirements.txt").write_text("\n".join([head, *pinned(RUNTIME_REQUIREMENTS)]) + "\n")
    _copy_runtime(dest / "mopar")


def _copy_runtime(dest: Path) -> None:
    """Copy mopar's torch-free part (``_RUNTIME_SOURCES``, ``*.py`` only) to ``dest``."""
    package = Path(__file__).resolve().parents[1]  # the mopar package
    for entry in _RUNTIME_SOURCES:
        src = package / entry
        if src.is_dir():
            for path in sorted(src.rglob("*.py")):
                if "__pycache__" in path.parts:
                    continue
                target = dest / path.relative_to(package)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
        else:
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest / entry)
