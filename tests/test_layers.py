"""Layers: imports point down, what runs the functions never imports torch, and no module
takes another's private names.

The contracts are in ``pyproject.toml`` (``[tool.importlinter]``); ``lint-imports`` checks them
from the repository root. The second test proves the check can fail, so that a passing first
test means something; the private-name scan has its own such pair.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    if not LINT_IMPORTS.is_file():
        pytest.fail(f"{LINT_IMPORTS} is missing; install the test extra: make setup")
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_mopar_keeps_its_import_contracts():
    proc = lint_imports()
    if proc.returncode != 0:
        pytest.fail(
            f"`lint-imports` found imports that point up:\n{proc.stdout}{proc.stderr}",
            pytrace=False,
        )


@pytest.mark.parametrize(
    "contract",
    [
        # The CLI calls the API: a layer above may import one below.
        """
    type = "forbidden"
    source_modules = ["mopar.cli"]
    forbidden_modules = ["mopar.api"]
    """,
        # The IR is a torch graph: the external-package check sees it.
        """
    type = "forbidden"
    source_modules = ["mopar.ir"]
    forbidden_modules = ["torch"]
    """,
    ],
    ids=["cli-imports-api", "ir-imports-torch"],
)
def test_a_contract_the_code_breaks_fails_the_check(contract, tmp_path):
    config = tmp_path / "importlinter.toml"
    config.write_text(
        textwrap.dedent("""
        [tool.importlinter]
        root_package = "mopar"
        include_external_packages = true

        [[tool.importlinter.contracts]]
        name = "known to be broken"
    """)
        + textwrap.dedent(contract)
    )
    proc = lint_imports("--config", str(config))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "known to be broken BROKEN" in proc.stdout


# --- the lab beside the package ----------------------------------------------------------------

LAB = ("benchmarks", "tools", "examples")


def _lab_imports(tree: ast.Module) -> tuple[list[int], list[int]]:
    """The lines of ``tree`` that import a package of `LAB`: at the module's top level (outside
    any function), and inside a function."""
    top: list[int] = []
    inner: list[int] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                names = (
                    [a.name for a in child.names]
                    if isinstance(child, ast.Import)
                    else [child.module or ""]
                    if child.level == 0
                    else []
                )
                if any(n.split(".")[0] in LAB for n in names):
                    (inner if in_function else top).append(child.lineno)
            nested = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            visit(child, nested)

    visit(tree, False)
    return top, inner


def test_mopar_imports_the_lab_only_inside_the_cli_commands_that_run_it():
    top, inner = [], []
    for path in sorted((ROOT / "mopar").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        at_top, in_body = _lab_imports(ast.parse(path.read_text()))
        top += [f"{rel}:{n}" for n in at_top]
        inner += [f"{rel}:{n}" for n in in_body if not rel.startswith("mopar/cli/")]
    assert not top, f"a module of mopar imports the lab at its top (the wheel lacks it): {top}"
    assert not inner, f"only a CLI command may import the lab, inside its body: {inner}"


def test_the_lab_import_scan_tells_a_top_level_import_from_one_in_a_function():
    tree = ast.parse(
        "import tools.plot\nfrom mopar import api\n"
        "def f():\n    from benchmarks.suite import SUITE\n    import examples\n"
        "class C:\n    from tools import CHECKOUT\n"
    )
    assert _lab_imports(tree) == ([1, 7], [4, 5])


# --- private names -------------------------------------------------------------------------------


def private_imports(source: str, module: str, *, init: bool = False) -> list[str]:
    """``from X import _name`` in ``source`` (the text of mopar module ``module``, dotted; a
    package's ``__init__`` where ``init``) where X is another mopar module:
    ``"line: from X import _name"`` each. Dunders are public."""
    package = module if init else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            origin = f"{base}.{node.module}" if node.module else base
        else:
            origin = node.module or ""
        if origin != "mopar" and not origin.startswith("mopar.") or origin == module:
            continue
        found += [
            f"{node.lineno}: from {origin} import {a.name}"
            for a in node.names
            if a.name.startswith("_") and not (a.name.startswith("__") and a.name.endswith("__"))
        ]
    return found


def test_no_mopar_module_imports_another_ones_private_names():
    found = []
    for path in sorted((ROOT / "mopar").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        init = path.name == "__init__.py"
        found += [f"{rel}:{x}" for x in private_imports(path.read_text(), module, init=init)]
    assert not found, "private names imported across modules (give them public names):\n" + (
        "\n".join(found)
    )


@pytest.mark.parametrize(
    ("source", "module", "found"),
    [
        (
            "from mopar.pipeline.document import _io, write_graphs\n",
            "mopar.pipeline.driver",
            ["1: from mopar.pipeline.document import _io"],
        ),
        (
            "from .capture import _export\n",
            "mopar.frontend.shapes",
            ["1: from mopar.frontend.capture import _export"],
        ),
        ("from mopar import __version__\nfrom torch import _C\n", "mopar.cli", []),
    ],
    ids=["absolute", "relative", "dunder-and-outside"],
)
def test_the_private_name_scan_finds_what_it_should(source, module, found):
    assert private_imports(source, module) == found
