"""A bundle's ``README.md``: what it is, and how to build, deploy and call it for its target.

The one owner of the file. The common part (what the bundle is: model, target, functions, the
plan's chain mode, latency and bill; how to try it on this machine) comes from the plan; the
target's part (what deploying needs, the commands that build, deploy and call it) is a
`Guide` its emitter makes and hands to `write_readme` (``mopar/targets/<target>/emit.py``).

Read in this order: `Step` and `Guide` (a target's part, as data), then `readme` (the text,
from the plan and the guide) and `write_readme`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mopar._text import counted
from mopar.plan import Plan

__all__ = ["README_FILE", "Guide", "Step", "readme", "write_readme"]

README_FILE = "README.md"
"""The file, at the bundle's root."""


@dataclass(frozen=True, kw_only=True)
class Step:
    """One shell command of a guide, and what it does.

    Attributes:
        command: the command, as typed from the bundle's root.
        does: what it does, in a few words (the comment beside it).
    """

    command: str
    does: str = ""


@dataclass(frozen=True, kw_only=True)
class Guide:
    """A target's part of the README.

    Attributes:
        platform: the platform, in words (``OpenFaaS (Community Edition)``, ``AWS Lambda``).
        files: the target's files in the bundle, each with what it is.
        needs: what deploying needs, each a sentence (a tool, a registry, a Redis URL, ...).
        deploy: the commands that build and deploy it, in order.
        call: the commands that call it once deployed.
        notes: more to know, each a sentence (what the plan's choices imply).
    """

    platform: str
    files: tuple[tuple[str, str], ...]
    needs: tuple[str, ...]
    deploy: tuple[Step, ...]
    call: tuple[Step, ...]
    notes: tuple[str, ...] = ()


def readme(plan: Plan, guide: Guide, *, inputs: Sequence[str] = ()) -> str:
    """The README of ``plan``'s bundle, with ``guide`` for its target; ``inputs``: the model's
    input names (a JSON request's keys)."""
    chain = f", chain mode `{plan.chain}`" if plan.chain else ""
    lines = [
        f"# {plan.model}: a mopar bundle for {guide.platform}",
        "",
        f"`{plan.model}` cut into {counted(len(plan.functions), 'function')} by mopar "
        f"(strategy `{plan.strategy}`), "
        f"planned and sized for `{plan.target}`{chain}. The bundle holds that target's "
        "deployment files alone: compile again with `--target` for another.",
        "",
        f"Predicted: {plan.latency_ms:.1f} ms a request, ${plan.cost_per_1m_usd:.4g} per "
        "million requests (plan.json's notes say what the bill includes and the traffic "
        "assumed).",
        "",
        "| function | memory MB | vCPUs | predicted ms | hands on by |",
        "| --- | ---: | ---: | ---: | --- |",
        *(
            f"| {f.name} | {f.memory_mb} | {f.vcpus:g} | {f.time_ms:.1f} | {plan.handoff(f.name)} |"
            for f in plan.functions
        ),
        "",
        "## Files",
        "",
        "- `plan.json`: the plan, its notes and the measured sizes;",
        "- `functions/<name>/`: each function's model, `function.json` and requirements;",
        "- `template/mopar-onnx/`: the functions' runtime and its image recipe;",
        "- `reference.npz`: a sample input and the model's answer to it;",
        *(f"- `{name}`: {what};" for name, what in guide.files),
        "",
        "## What it needs",
        "",
        *(f"- {need}" for need in guide.needs),
        "",
        "## Build and deploy",
        "",
        *_commands(guide.deploy),
        "",
        "## Call it",
        "",
        "A request is the model's inputs: an .npz by name (`Content-Type: application/x-npz`), "
        'or JSON, `{"inputs": {' + ", ".join(f'"{n}": [...]' for n in inputs) + "}}` "
        "(`application/json`). The answer is a mopar frame unless `Accept` names one of those "
        "two.",
        "",
        *_commands(guide.call),
        "",
        *(line for note in guide.notes for line in (note, "")),
        "## Try it on this machine",
        "",
        *_commands(
            (
                Step(
                    command="mopar run . --check",
                    does="every function a process here, handing on through /dev/shm",
                ),
                Step(
                    command="mopar run . --transport http --check",
                    does="each function's server, handing on over HTTP",
                ),
                Step(command="mopar run . --containers --check", does="in their images"),
            )
        ),
    ]
    return "\n".join(lines) + "\n"


def _commands(steps: Sequence[Step]) -> list[str]:
    """``steps`` as one shell block, each command after its comment."""
    body = [line for s in steps for line in ((f"# {s.does}",) if s.does else ()) + (s.command,)]
    return ["```sh", *body, "```"]


def write_readme(bundle: Path, plan: Plan, guide: Guide, *, inputs: Sequence[str] = ()) -> None:
    """Write ``README.md`` at the root of ``bundle`` (`readme`)."""
    (Path(bundle) / README_FILE).write_text(readme(plan, guide, inputs=inputs))
