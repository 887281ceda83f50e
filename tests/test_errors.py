"""mopar.errors: an error names its options as data, and each caller words them its own way.

The CLI shows ``--max-memory-mb 512``, the Python API ``max_memory_mb=512``. The inner layers
never write a flag themselves: a scan of their sources keeps flags from creeping back.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from mopar.errors import DEBUG, InputSpecError, Option, PlanError, Worded

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("parts", "cli", "python"),
    [
        (
            (Option("slices"), " must be between 1 and 41, got 60"),
            "--slices must be between 1 and 41, got 60",
            "slices= must be between 1 and 41, got 60",
        ),
        (
            ("got ", Option("slices", value=60), "; drop ", Option("slices"), " or pick another"),
            "got --slices 60; drop --slices or pick another",
            "got slices=60; drop slices= or pick another",
        ),
        (
            ("raise ", Option("slo_ms"), " to at least 12"),
            "raise --slo-ms to at least 12",
            "raise slo_ms= to at least 12",
        ),
        (
            ("pass ", Option("max_slowdown", value=1.25), " to allow it"),
            "pass --max-slowdown 1.25 to allow it",
            "pass max_slowdown=1.25 to allow it",
        ),
        (
            ("unknown ", Option("target", value="gcp", quoted=True), "; choose"),
            "unknown --target 'gcp'; choose",
            "unknown target='gcp'; choose",
        ),
        (
            (Option("transport", value="shm"), " is not available"),
            "--transport shm is not available",
            "transport='shm' is not available",
        ),
        (
            ("pass ", Option("force", value=True), " to replace it"),
            "pass --force to replace it",
            "pass force=True to replace it",
        ),
        (
            ("bad ", Option("example_args", cli="input"), " spec 'x'"),
            "bad --input spec 'x'",
            "bad example_args spec 'x'",
        ),
        (
            (
                "pass ",
                Option("example_args", cli="input", value=["x=1x3:float32"]),
                " or re-export",
            ),
            "pass --input x=1x3:float32 or re-export",
            "pass example_args=['x=1x3:float32'] or re-export",
        ),
        (
            (
                "`mopar profile train --out DIR` and pass ",
                Option("profiles_dir", cli="profiles", metavar="DIR"),
            ),
            "`mopar profile train --out DIR` and pass --profiles DIR",
            "`mopar profile train --out DIR` and pass profiles_dir=DIR",
        ),
        (
            ("rerun with ", DEBUG),
            "rerun with --debug",
            "rerun with the 'mopar' logger at DEBUG (logging.getLogger('mopar').setLevel('DEBUG'))",
        ),
        (
            (
                Worded(
                    cli=("rename the ", Option("example_args", cli="input")), python=("rename it",)
                ),
            ),
            "rename the --input",
            "rename it",
        ),
    ],
)
def test_an_error_names_its_options_as_flags_for_the_cli_and_as_arguments_for_python(
    parts, cli, python
):
    error = PlanError(*parts)
    assert (error.render("cli"), error.render("python")) == (cli, python)
    assert str(error) == cli, "str() is the CLI's wording until the API speaks to Python"
    error.speak("python")
    assert str(error) == python


def test_the_api_names_the_argument_that_carried_the_inputs():
    error = InputSpecError("fix the ", Option("example_args", cli="input"), " shapes")
    assert error.render("python", inputs="example_kwargs") == "fix the example_kwargs shapes"
    error.speak("python", inputs="example_kwargs")
    assert str(error) == "fix the example_kwargs shapes"
    assert error.render("cli") == "fix the --input shapes"


def test_an_error_with_options_pickles_with_its_parts():
    import pickle

    error = PlanError("raise ", Option("slo_ms"), " to at least 12")
    again = pickle.loads(pickle.dumps(error))
    assert (type(again), again.parts, str(again)) == (PlanError, error.parts, str(error))


# --- no flags in the inner layers ----------------------------------------------------------------

INNER = (
    "mopar/planner",
    "mopar/facts.py",
    "mopar/traffic.py",
    "mopar/compress",
    "mopar/emit",
    "mopar/ir",
    "mopar/frontend",
    "mopar/profile",
    "mopar/rewrite",
    "mopar/pipeline",
    "mopar/plan/notes.py",
    "mopar/config.py",
    "mopar/arguments.py",
)
"""The layers below the CLI and the API: their errors name options with `Option`."""

NOT_MESSAGES = {
    # deploy scripts and Dockerfiles the bundle ships
    ("mopar/targets/openfaas/emit.py", "kubectl patch deployment"),
    ("mopar/targets/openfaas/emit.py", "kubectl rollout status"),
    # the commands a bundle's README.md shows
    ("mopar/emit/readme.py", "mopar run . --"),
    # notes a plan or a trace carries as text (plan.json): not errors, worded for the CLI
    ("mopar/planner/experts.py", "(--experts inline)"),
    ("mopar/planner/experts.py", "--expert-group"),
    ("mopar/planner/experts.py", "--hot-experts"),
    ("mopar/planner/strategies.py", "pass --parallel"),
    ("mopar/planner/strategies.py", "pass --slo-ms {}"),
    ("mopar/planner/strategies.py", "(--max-slowdown)"),
    ("mopar/planner/strategies.py", "latency bound: --slo-ms"),
    ("mopar/planner/strategies.py", "--slices {}: no latency bound"),
    ("mopar/planner/strategies.py", "(--max-memory-mb)"),
    ("mopar/planner/strategies.py", "needs co-located functions (--colocate)"),
    ("mopar/plan/notes.py", "are co-located (--colocate), which needs"),
    ("mopar/planner/strategies.py", "no latency bound (pass --slo-ms"),
    ("mopar/planner/units.py", "--slices {} exceeds the"),
    ("mopar/planner/strategies.py", "--max-slowdown {}: {} slices"),
    ("mopar/profile/experts.py", "(pass --calibration with token data"),
    ("mopar/pipeline/stages.py", "pass --calibration with real samples"),
    ("mopar/pipeline/lossy.py", "pass --calibration with real samples"),
    ("mopar/plan/notes.py", "slower than --max-slowdown {} beyond"),
    ("mopar/emit/session.py", "--quantize int8 holds"),
    ("mopar/plan/notes.py", "over --max-slowdown {} beyond the noise"),
    ("mopar/pipeline/latency.py", "within --max-slowdown {}; kept"),
    ("mopar/pipeline/latency.py", "not beyond the noise of --max-slowdown {}"),
    ("mopar/planner/strategies.py", "or pass --keep-positions "),
    ("mopar/frontend/capture.py", "(--keep-positions last)"),
}
"""String literals of the inner layers that hold flags and are no error message."""

_FLAG = re.compile(r"(?<![\w-])--[a-z]")


def _strings(tree: ast.Module):
    """Each string literal of ``tree`` but docstrings, an f-string as its text with ``{}`` for
    each value."""
    docstrings = {
        id(n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
    }
    pieces = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            yield (
                node.lineno,
                "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values),
            )
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings | pieces
        ):
            yield node.lineno, node.value


def _flags_in_inner_layers() -> list[str]:
    files = []
    for name in INNER:
        path = ROOT / name
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    found = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        for line, text in _strings(ast.parse(path.read_text())):
            if not _FLAG.search(re.sub(r"`[^`]*`", "", text)):  # a shell command in backticks
                continue
            if not any(rel == where and snippet in text for where, snippet in NOT_MESSAGES):
                found.append(f"{rel}:{line}: {text[:100]!r}")
    return found


def test_the_inner_layers_write_no_flags_in_their_messages():
    found = _flags_in_inner_layers()
    assert not found, (
        "a CLI flag in an inner layer's string; name the option as data, "
        "Option('max_memory_mb') (mopar.errors), which the CLI and the API each word:\n"
        + "\n".join(found)
    )


def test_the_scan_sees_a_flag_but_not_a_backticked_command():
    tree = ast.parse('x = f"pass --slices {n}"\ny = "rerun `mopar profile calibrate --out DIR`"')
    texts = [text for _, text in _strings(tree)]
    assert [bool(_FLAG.search(re.sub(r"`[^`]*`", "", t))) for t in texts] == [True, False]


def test_every_exception_to_the_scan_is_still_there():
    """An entry of NOT_MESSAGES that matches nothing is stale: remove it."""
    texts = {
        (name, text)
        for name in {where for where, _ in NOT_MESSAGES}
        for _, text in _strings(ast.parse((ROOT / name).read_text()))
    }
    stale = [
        (where, snippet)
        for where, snippet in NOT_MESSAGES
        if not any(w == where and snippet in t for w, t in texts)
    ]
    assert not stale
