"""Options and rendering shared by the commands."""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console

__all__ = [
    "Number",
    "TIMEOUT_MAX_S",
    "compile_config",
    "emit_json",
    "human_bytes",
    "model_options",
    "need_examples",
    "parse_inputs",
    "plan_options",
    "profiles_out",
    "redis_url_option",
    "stderr",
    "stdout",
    "stdout_to_stderr",
    "timeout_option",
    "tolerance_options",
    "transport_option",
]

# Piped output (CI logs, `| tee`) gets a wide table rather than rich's 80-column default.
stdout = Console(width=None if sys.stdout.isatty() else 132)
stderr = Console(stderr=True)


class Number(click.FloatRange):
    """A finite number within a range: the type of every real-valued option. (click's
    FloatRange takes ``nan``, which compares false with every bound, and ``inf`` where no
    maximum is set; no option of mopar means either.)"""

    name = "number"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


TIMEOUT_MAX_S = 86_400.0
"""The longest ``--timeout``, s (a day): longer waits overflow the operating system's."""


def timeout_option(*, default: float, help: str) -> Callable:
    """``--timeout`` (``timeout_s``), seconds above 0 and at most `TIMEOUT_MAX_S`."""
    return click.option(
        "--timeout",
        "timeout_s",
        type=Number(min=0, min_open=True, max=TIMEOUT_MAX_S),
        default=default,
        show_default=True,
        metavar="SECONDS",
        help=help,
    )


def transport_option(*, help: str) -> Callable:
    """``--transport``: how a bundle's functions hand tensors to each other (default shm)."""
    from mopar.runtime.transports import names

    return click.option(
        "--transport",
        type=click.Choice(names()),
        default="shm",
        show_default=True,
        help=help,
    )


def redis_url_option(fn: Callable) -> Callable:
    """``--redis-url``: the Redis of ``--transport redis``."""
    return click.option(
        "--redis-url",
        default="",
        metavar="URL",
        help="Redis for --transport redis (default: a private redis-server on 127.0.0.1, "
        "started for the command).",
    )(fn)


def model_options(fn: Callable) -> Callable:
    """``--input``, ``--example-inputs``, ``--trust-pickle`` and ``--depth``."""
    fn = click.option(
        "--depth",
        type=click.IntRange(min=1),
        default=None,
        help="Group layers by module path truncated to this depth (default: leaf modules).",
    )(fn)
    fn = click.option(
        "--trust-pickle",
        is_flag=True,
        help="Allow loading a pickled nn.Module (unpickling runs code from the file).",
    )(fn)
    fn = click.option(
        "--example-inputs",
        "example_npz",
        type=click.Path(dir_okay=False),
        default=None,
        help="An .npz of example inputs, keyed by forward() argument name.",
    )(fn)
    fn = click.option(
        "--input",
        "input_specs",
        multiple=True,
        metavar="NAME=SHAPE:DTYPE",
        help="An example input, e.g. x=1x3x224x224:float32 (repeatable).",
    )(fn)
    return fn


def budget_options(fn: Callable) -> Callable:
    """How much lossy codecs and quantised weights may change the final outputs, and the
    weights' form (`mopar.compress.budget`, `mopar.compress.quantize`)."""
    from mopar.config import QUANTIZE_MODES

    fn = click.option(
        "--quantize",
        type=click.Choice(QUANTIZE_MODES),
        default="none",
        show_default=True,
        help="The weights' form: none (float, exact to the model), auto (each function's "
        "cheapest form within the budget), int8 or int4 (on every function, within the "
        "budget if one is given).",
    )(fn)
    fn = click.option(
        "--min-cosine",
        type=Number(min=-1, max=1),
        default=None,
        help="The lowest cosine similarity an output row (an embedding) may keep with the model's.",
    )(fn)
    fn = click.option(
        "--max-top1-change",
        type=Number(min=0, max=100),
        default=None,
        help="Percent of samples whose top-1 class codecs and quantised weights may change "
        "(classifiers).",
    )(fn)
    return click.option(
        "--max-output-error",
        type=Number(min=0),
        default=None,
        help="Relative change of the final outputs codecs and quantised weights may cause "
        "(default: exact only).",
    )(fn)


def plan_options(fn: Callable | None = None, *, deploy: bool = False) -> Callable:
    """What the partitioner is asked: strategy, slices, target, latency bound, profiles.

    With ``deploy`` (``mopar compile``), ``--target`` also takes ``all``: the plan is priced for
    OpenFaaS, and the bundle carries the deployment files of both platforms, as always.
    """
    if fn is None:
        return lambda f: plan_options(f, deploy=deploy)
    from mopar.bill import CHAINS
    from mopar.facts import target_names
    from mopar.planner import STRATEGIES
    from mopar.runtime.transports import names

    targets = target_names()

    fn = click.option(
        "--max-seq-len",
        type=click.IntRange(min=2),
        default=None,
        help="With --generate: prompt and generated tokens together, at most (default: 256, "
        "or the model's positions where fewer).",
    )(fn)
    fn = click.option(
        "--generate",
        is_flag=True,
        help="Compile a transformers decoder for text generation: its step with the key-value "
        "cache, in a main function that runs the decoding loop (serve it with mopar generate).",
    )(fn)
    fn = click.option(
        "--dynamic",
        multiple=True,
        metavar="NAME:AXIS=MIN..MAX",
        help="Take this input dimension at any size in MIN..MAX, e.g. input_ids:1=1..512 "
        "(repeatable): planned at the example's size, sized at MAX, verified at MIN, MAX and "
        "between. A .pt2's own bounded dynamic dimensions are kept without it.",
    )(fn)
    fn = click.option(
        "--calibrate/--no-calibrate",
        default=True,
        show_default=True,
        help="Price with predicted times calibrated to this machine: a probe of a few "
        "operators (1-3 s), cached per machine and load; off: the times of the machine the "
        "predictors were measured on.",
    )(fn)
    fn = click.option(
        "--profiles",
        "profiles_dir",
        type=click.Path(file_okay=False),
        default=None,
        help="Folder of predictors and platform profiles (default: the shipped profiles/).",
    )(fn)
    fn = click.option(
        "--experts",
        type=click.Choice(["functions", "inline"]),
        default="functions",
        show_default=True,
        help="Mixture-of-experts models: each expert (or group) a function invoked "
        "only when tokens reach it, or inline in its slice as a dense "
        "translation.",
    )(fn)
    fn = click.option(
        "--expert-group",
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        help="Experts per expert function (default: the cheapest grouping, or "
        "inline where that is cheaper).",
    )(fn)
    fn = click.option(
        "--hot-experts",
        default="auto",
        show_default=True,
        metavar="auto|none|N",
        help="Experts of each MoE layer its dispatch function keeps and runs itself "
        "(the most loaded first, by the activation trace): the cheapest count, "
        "none, or N.",
    )(fn)
    fn = click.option(
        "--chain",
        type=click.Choice(tuple(CHAINS)),
        default=None,
        help="Price plans in this chain mode only (default: every mode the target "
        "offers, and the cheapest within the bound is taken): invoke, stepfunctions, event "
        "on Lambda; http, callback, shm on OpenFaaS.",
    )(fn)
    fn = click.option(
        "--trace",
        type=click.Path(dir_okay=False),
        default=None,
        metavar="FILE",
        help="Price plans under this traffic: a file of arrival times in seconds, one "
        "per line (instead of --rate).",
    )(fn)
    fn = click.option(
        "--rate",
        type=Number(min=0, min_open=True),
        default=None,
        metavar="RPS",
        help="Price plans under this traffic: requests per second, Poisson (default: "
        "1, stated in the notes); the most loaded expert functions also get replicas.",
    )(fn)
    fn = click.option(
        "--force-parallel",
        is_flag=True,
        help="Shard every slice a rule applies to into --parallel sub-slices, "
        "whatever the prediction says (for testing and measurement).",
    )(fn)
    fn = click.option(
        "--parallel",
        type=click.IntRange(min=1, max=16),
        default=1,
        show_default=True,
        metavar="MAX",
        help="Cap on η, the parameter-sharded sub-slices run side by side for a "
        "slice; η > 1 is taken only where predicted faster (1: off).",
    )(fn)
    fn = click.option(
        "--min-memory",
        is_flag=True,
        help="Size every slice at the smallest memory that holds it, never more for CPU.",
    )(fn)
    fn = click.option(
        "--cold-start-rate",
        type=Number(min=0, max=1),
        default=None,
        help="Share of invocations that start cold, instead of the share the "
        "traffic implies with the platform's keep-alive; where INIT is billed "
        "(Lambda), invocations pay their share of one.",
    )(fn)
    fn = click.option(
        "--max-memory-mb",
        type=click.IntRange(min=1),
        default=None,
        help="The largest function allowed, MB (an account's limit, a node's "
        "size); the plan splits as much as needed to fit.",
    )(fn)
    fn = click.option(
        "--max-slowdown",
        type=Number(min=1),
        default=1.05,
        show_default=True,
        help="The cheapest plan whose predicted latency is within this multiple "
        "of the unsplit plan's (ignored with --slo-ms or --slices).",
    )(fn)
    fn = click.option(
        "--slo-ms",
        type=Number(min=0, min_open=True),
        default=None,
        help="Latency bound per request, ms (default: --max-slowdown x the "
        "unsplit plan's predicted latency).",
    )(fn)
    fn = click.option(
        "--transport",
        type=click.Choice(names()),
        default=None,
        help="Hand every cut over by this transport (default: the fastest per cut "
        "that the target offers; shm needs co-located functions).",
    )(fn)
    fn = click.option(
        "--arch",
        type=click.Choice(["x86_64", "arm64"]),
        default="x86_64",
        show_default=True,
        help="Lambda architecture (prices differ).",
    )(fn)
    fn = click.option(
        "--target",
        type=click.Choice((*targets, "all") if deploy else targets),
        default="openfaas",
        show_default=True,
        help="Platform whose billing and limits the plan is made for"
        + (" (all: OpenFaaS's; every bundle has stack.yml and template.yaml)." if deploy else "."),
    )(fn)
    fn = click.option(
        "--strategy",
        type=click.Choice(STRATEGIES),
        default="mopar",
        show_default=True,
        help="Partition strategy.",
    )(fn)
    fn = click.option(
        "--slices",
        type=int,
        default=None,
        help="Exactly this many slices (default: the strategy decides).",
    )(fn)
    return fn


def tolerance_options(*, decided: str) -> Callable:
    """``--rtol`` and ``--atol``: outputs pass when |got - model| <= atol + rtol*|model|
    elementwise, as numpy.allclose; left out, None: ``decided`` says what decides them."""

    def decorate(fn: Callable) -> Callable:
        for name, unit in (
            ("atol", "absolute, in the output's units"),
            ("rtol", "relative to |expected| per element"),
        ):
            fn = click.option(
                f"--{name}",
                type=Number(min=0),
                default=None,
                help=f"Tolerance of the output check, {unit}: an element passes when "
                f"|got - model| <= atol + rtol*|model| (default: {decided}).",
            )(fn)
        return fn

    return decorate


def compile_config(planning: dict[str, Any], **more: Any):
    """A `CompileConfig` from `plan_options` values (and ``more`` fields)."""
    from mopar.arguments import check_choices
    from mopar.config import CompileConfig

    folder = planning.pop("profiles_dir", None)
    if planning.get("target") == "all":
        planning["target"] = "openfaas"
    if planning.get("trace"):
        planning["trace"] = Path(planning["trace"])
    config = CompileConfig(**planning, **more, **({"profiles_dir": Path(folder)} if folder else {}))
    check_choices(config)  # before the model loads: a bad value costs no wait
    return config


def need_examples(command: str) -> Any:
    """The repository's ``examples`` package, which ``command`` runs; imported here, at once
    (`mopar.cli.checkout.need_checkout`: the wheel holds mopar alone).

    Raises:
        MoparError: ``examples`` is not importable, in one line that says where to run from.
    """
    from mopar.cli.checkout import need_checkout

    return need_checkout(command, "examples")


USER_PROFILES = "mopar-profiles"
"""Where ``mopar profile calibrate`` and ``train`` write unless told: a folder of the user's
own, which ``--profiles`` then names (what it lacks comes from the shipped profiles)."""


def profiles_out(out: str) -> Path:
    """The folder a profile command writes to, created; never inside the installed package
    (a reinstall would replace it, and it may not be the user's to write).

    Raises:
        MoparError: ``out`` is in the package, or cannot be created or written, in one line.
    """
    import os

    import mopar
    from mopar.errors import MoparError

    folder = Path(out)
    package = Path(mopar.__file__).resolve().parent
    if folder.resolve() == package or package in folder.resolve().parents:
        raise MoparError(
            f"--out {out!r} is inside the installed mopar package ({package}), which a "
            f"reinstall replaces; write to a folder of your own (default ./{USER_PROFILES}) and "
            "plan with --profiles DIR"
        )
    try:  # before measuring or training, not after
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MoparError(
            f"cannot create --out {out!r} ({exc.strerror}); pass a writable folder"
        ) from None
    if not os.access(folder, os.W_OK):
        raise MoparError(f"--out {out!r} is not writable; pass a writable folder")
    return folder


def parse_inputs(input_specs: tuple[str, ...], example_npz: str | None) -> Any:
    """Convert the input options to what `mopar.api` takes; both at once is a user error."""
    from mopar.errors import InputSpecError
    from mopar.frontend.inputs import parse_input_spec

    if input_specs and example_npz:
        raise InputSpecError("give either --input or --example-inputs, not both")
    if example_npz:
        return example_npz
    return [parse_input_spec(s) for s in input_specs] or None


def stdout_to_stderr():
    """Keep stdout for our own output: model code that prints (a factory saying "loaded
    weights") would otherwise corrupt ``--json``."""
    return contextlib.redirect_stdout(sys.stderr)


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str, allow_nan=False))


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"
