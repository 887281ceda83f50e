"""Layers: imports point down, and what runs the functions never imports torch.

The contracts are in ``pyproject.toml`` (``[tool.importlinter]``); ``lint-imports`` checks them
from the repository root. The second test proves the check can fail, so that a passing first
test means something.
"""

from __future__ import annotations

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
