"""Every shared option of the command line, described once.

Read in order:

* `Spec` (`mopar.cli.spec`, re-exported here): one option: its flags, click type, default and
  its one description (``help``, what ``--help`` prints; docs/cli.md's detail beyond it is
  the checkout's, in ``tools/cli_more.py``).
* The groups: tuples of `Spec` that several commands take (the model's inputs, what the
  planner is asked, the output budget, how a bundle is served, its autoscaler, containers,
  open-loop traffic, the bill). `options(*groups)` gives a command the options of the groups,
  in the order given, which is the order of ``--help`` and of the docs' table.
* `Spec.row` is the option's row in docs/cli.md, from the same description:
  `python -m tools.cli_docs` rewrites the file's tables (``tools/cli_docs.py``), and
  tests/test_cli_docs.py fails, naming that command, when the file is out of date.

Choices that come from registries (strategies, targets, transports, chain modes) are read when a
group is applied, which is when ``mopar.cli`` is imported: those registries import no torch, so
``mopar --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import math

import click

from mopar.cli.spec import Number, Spec, SpecOption, options, refuse, registry
from mopar.config import DEFAULT_TARGET, KEEP_POSITIONS
from mopar.runner.load import GRACE_S

__all__ = [
    "AUTOSCALER",
    "BASELINE",
    "BILLING",
    "BUDGET",
    "CONTAINER_BUILD",
    "CONTAINERS",
    "INPUTS",
    "Number",
    "OneTarget",
    "REDIS_URL",
    "SERVING",
    "Spec",
    "SpecOption",
    "TIMEOUT_MAX_S",
    "TRAFFIC",
    "json_output",
    "options",
    "planning",
    "timeout",
    "tolerance",
    "transport",
]


TIMEOUT_MAX_S = 86_400.0
"""The longest ``--timeout``, s (a day): longer waits overflow the operating system's."""


# --- the model and its inputs (compile, plan, inspect, profile experts) --------------------------

INPUTS: tuple[Spec, ...] = (
    Spec(
        decls=("--input", "input_specs"),
        help="An example input, e.g. x=1x3x224x224:float32 (repeatable).",
        metavar="NAME=SHAPE:DTYPE",
        extra={"multiple": True},
        arg="NAME=SHAPE:DTYPE[:LOW..HIGH]",
    ),
    Spec(
        decls=("--example-inputs", "example_npz"),
        help="An .npz of example inputs, keyed by forward() argument name.",
        type=click.Path(dir_okay=False),
        arg="FILE.npz",
    ),
    Spec(
        decls=("--trust-pickle",),
        help="Allow loading a pickled nn.Module (unpickling runs code from the file).",
        extra={"is_flag": True},
    ),
    Spec(
        decls=("--depth",),
        help="Group layers by module path truncated to this depth (default: leaf modules).",
        type=click.IntRange(min=1),
        arg="N",
        shown="leaf modules",
    ),
)
"""``--input``, ``--example-inputs``, ``--trust-pickle`` and ``--depth``."""


# --- what the partitioner is asked (compile, plan) -----------------------------------------------


_PLANNING: tuple[Spec, ...] = (
    Spec(
        decls=("--slices",),
        help="Exactly this many slices (default: the strategy decides).",
        type=int,
        arg="N",
        shown="the strategy decides",
    ),
    Spec(
        decls=("--strategy",),
        help="Partition strategy.",
        type=registry("mopar.planner", "STRATEGIES"),
        default="mopar",
    ),
    Spec(
        decls=("--target",),
        help="Platform whose billing and limits the plan is made for.",
        type=registry("mopar.facts", "target_names"),
        default=DEFAULT_TARGET,
    ),
    Spec(
        decls=("--arch",),
        help="Lambda architecture (prices differ).",
        type=click.Choice(["x86_64", "arm64"]),
        default="x86_64",
    ),
    Spec(
        decls=("--transport",),
        help="Hand every cut over by this transport (default: the fastest per cut that the "
        "target offers; shm needs co-located functions: --colocate).",
        type=registry("mopar.runtime.transports", "names"),
        shown="per cut",
    ),
    Spec(
        decls=("--colocate",),
        help="Offer co-located functions to the planner: the shm transport and chain mode, "
        "tensors handed over through a shared tmpfs. On OpenFaaS that needs OpenFaaS "
        "Standard or Enterprise (Profiles: k8s/profile.yaml), a hostPath volume and a root "
        "init container patched in by `sh k8s/apply.sh` after every deploy; Lambda cannot. "
        "Default: none, so an OpenFaaS bundle deploys on Community Edition.",
        extra={"is_flag": True},
    ),
    Spec(
        decls=("--slo-ms",),
        help="Latency bound per request, ms (default: --max-slowdown x the unsplit plan's "
        "predicted latency).",
        type=Number(min=0, min_open=True),
        arg="MS",
        shown="`--max-slowdown` x unsplit",
    ),
    Spec(
        decls=("--max-slowdown",),
        help="The cheapest plan whose predicted latency is within this multiple of the "
        "unsplit plan's (ignored with --slo-ms or --slices).",
        type=Number(min=1),
        default=1.05,
        arg="F",
    ),
    Spec(
        decls=("--max-memory-mb",),
        help="The largest function allowed, MB (an account's limit, a node's size); the plan "
        "splits as much as needed to fit.",
        type=click.IntRange(min=1),
        arg="MB",
        shown="the platform's largest",
    ),
    Spec(
        decls=("--cold-start-rate",),
        help="Share of invocations that start cold, instead of the share the traffic implies "
        "with the platform's keep-alive; where INIT is billed (Lambda), invocations pay their "
        "share of one.",
        type=Number(min=0, max=1),
        arg="R",
        shown="from the traffic",
    ),
    Spec(
        decls=("--min-memory",),
        help="Size every slice at the smallest memory that holds it, never more for CPU.",
        extra={"is_flag": True},
    ),
    Spec(
        decls=("--parallel",),
        help="Cap on η, the parameter-sharded sub-slices run side by side for a slice; η > 1 "
        "is taken only where predicted faster (1: off).",
        type=click.IntRange(min=1, max=16),
        default=1,
        metavar="MAX",
    ),
    Spec(
        decls=("--force-parallel",),
        help="Shard every slice a rule applies to into --parallel sub-slices, whatever the "
        "prediction says (for testing and measurement).",
        extra={"is_flag": True},
    ),
    Spec(
        decls=("--rate",),
        help="Price plans under this traffic: requests per second, Poisson (default: 1, "
        "stated in the notes); the most loaded expert functions also get replicas.",
        type=Number(min=0, min_open=True),
        metavar="RPS",
        shown="1, stated in the notes",
    ),
    Spec(
        decls=("--trace",),
        help="Price plans under this traffic: a file of arrival times in seconds, one per line "
        "(instead of --rate).",
        type=click.Path(dir_okay=False),
        metavar="FILE",
    ),
    Spec(
        decls=("--chain",),
        help="Price plans in this chain mode only (default: every mode the target offers, and "
        "the cheapest within the bound is taken): invoke, stepfunctions, event on Lambda; "
        "http, callback, shm on OpenFaaS.",
        type=registry("mopar.bill", "CHAINS"),
        arg="MODE",
        shown="every mode",
    ),
    Spec(
        decls=("--hot-experts",),
        help="Experts of each MoE layer its dispatch function keeps and runs itself (the most "
        "loaded first, by the activation trace): the cheapest count, none, or N.",
        default="auto",
        metavar="auto|none|N",
    ),
    Spec(
        decls=("--expert-group",),
        help="Experts per expert function (default: the cheapest grouping, or inline where "
        "that is cheaper).",
        type=click.IntRange(min=1),
        metavar="N",
        shown="cheapest",
    ),
    Spec(
        decls=("--experts",),
        help="Mixture-of-experts models: each expert (or group) a function invoked only when "
        "tokens reach it, or inline in its slice as a dense translation.",
        type=click.Choice(["functions", "inline"]),
        default="functions",
    ),
    Spec(
        decls=("--profiles", "profiles_dir"),
        help="Folder of predictors and platform profiles (default: the shipped profiles/).",
        type=click.Path(file_okay=False),
        arg="DIR",
        shown="`profiles/`",
    ),
    Spec(
        decls=("--calibrate/--no-calibrate", "removed_calibrate"),
        help="plans are priced for the target's CPU (its speed in profiles/platforms.json), "
        "never this machine's",
        extra={"hidden": True, "expose_value": False, "callback": refuse},
        instead="measure a target's speed with `mopar profile calibrate --speed TARGET --out DIR`, "
        "then pass --profiles DIR",
    ),
    Spec(
        decls=("--dynamic",),
        help="Take this input dimension at any size in MIN..MAX, e.g. input_ids:1=1..512 "
        "(repeatable): planned at the example's size, sized at MAX, verified at MIN, MAX and "
        "between. A .pt2's own bounded dynamic dimensions are kept without it.",
        metavar="NAME:AXIS=MIN..MAX",
        extra={"multiple": True},
    ),
    Spec(
        decls=("--generate",),
        help="Compile a transformers decoder for text generation: its step with the key-value "
        "cache, in a main function that runs the decoding loop (serve it with mopar generate).",
        extra={"is_flag": True},
    ),
    Spec(
        decls=("--max-seq-len",),
        help="With --generate: prompt and generated tokens together, at most (default: 256, "
        "or the model's positions where fewer).",
        type=click.IntRange(min=2),
        arg="N",
        shown="256, or the model's positions where fewer",
    ),
    Spec(
        decls=("--keep-positions",),
        help="The positions the answer keeps of each output with them (batch x positions x "
        "...: a decoder's logits): all, or the last alone (cut before the head that makes them, "
        "as transformers' logits_to_keep=1), for an answer that fits the target's payload.",
        type=click.Choice(KEEP_POSITIONS),
        default="all",
    ),
)


def planning(*, deploy: bool = False) -> tuple[Spec, ...]:
    """What the partitioner is asked: strategy, slices, target, latency bound, traffic, profiles.

    With ``deploy`` (``mopar compile``), ``--target all`` is refused in one line that says what
    to do instead (`OneTarget`): a bundle is planned, sized and deployed for one target.
    """
    if not deploy:  # mopar plan: several rates, one table across them
        several = {
            "--rate": lambda s: dataclasses.replace(
                s,
                type=Rates(),
                metavar="RPS[,RPS...]",
                help=s.help + " Several, comma-separated (1,10,100), print one table across "
                "them, saying where splitting starts to pay.",
            )
        }
        return tuple(several.get(s.flag, lambda s: s)(s) for s in _PLANNING)
    deployed = {
        "--target": lambda s: dataclasses.replace(
            s,
            type=lambda: OneTarget(registry("mopar.facts", "target_names")().choices),
            help="Platform whose billing and limits the plan is made for; the bundle holds "
            "that target's deployment files alone, sized for it.",
        )
    }
    return tuple(deployed.get(s.flag, lambda s: s)(s) for s in _PLANNING)


class Rates(click.ParamType):
    """``mopar plan --rate``: one rate, or several comma-separated, each a finite number of
    requests per second above 0; a tuple of them."""

    name = "rates"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        parts = [p.strip() for p in str(value).split(",")]
        rates = []
        for part in parts:
            try:
                rate = float(part)
            except ValueError:
                rate = math.nan
            if not (math.isfinite(rate) and rate > 0):
                self.fail(f"{part!r} is not a rate above 0 (requests per second)", param, ctx)
            rates.append(rate)
        return tuple(rates)


class OneTarget(click.Choice):
    """``mopar compile --target``: one of the targets; ``all``, which older bundles took (priced
    for OpenFaaS, both targets' files), is refused with the way to get both."""

    def convert(self, value, param, ctx):
        if value == "all":
            each = ", ".join(f"--target {t} --out bundle-{t}" for t in self.choices)
            self.fail(
                "'all' is not a target: a bundle is planned and sized for one target and holds "
                f"its files alone; compile once per target into its own folder ({each})",
                param,
                ctx,
            )
        return super().convert(value, param, ctx)


BUDGET: tuple[Spec, ...] = (
    Spec(
        decls=("--max-output-error",),
        help="Relative change of the final outputs codecs and quantised weights may cause "
        "(default: exact only).",
        type=Number(min=0),
        arg="REL",
    ),
    Spec(
        decls=("--max-top1-change",),
        help="Percent of samples whose top-1 class codecs and quantised weights may change "
        "(classifiers).",
        type=Number(min=0, max=100),
        arg="PCT",
    ),
    Spec(
        decls=("--min-cosine",),
        help="The lowest cosine similarity an output row (an embedding) may keep with the model's.",
        type=Number(min=-1, max=1),
        arg="C",
    ),
    Spec(
        decls=("--quantize",),
        help="The weights' form: none (float, exact to the model), auto (each function's "
        "cheapest form within the budget), int8 or int4 (on every function, within the budget "
        "if one is given).",
        type=registry("mopar.config", "QUANTIZE_MODES"),
        default="none",
    ),
)
"""How much lossy codecs and quantised weights may change the final outputs, and the weights'
form (`mopar.compress.budget`, `mopar.compress.quantize`)."""


# --- options several commands take with their own wording ----------------------------------------


def tolerance(*, decided: str, shown: str | None = None) -> tuple[Spec, ...]:
    """``--rtol`` and ``--atol``: outputs pass when |got - model| <= atol + rtol*|model|
    elementwise, as numpy.allclose; left out, None: ``decided`` says what decides them."""
    return tuple(
        Spec(
            decls=(f"--{name}",),
            help=f"Tolerance of the output check, {unit}: an element passes when "
            f"|got - model| <= atol + rtol*|model| (default: {decided}).",
            type=Number(min=0),
            arg=name[0].upper(),
            shown=shown,
        )
        for name, unit in (
            ("rtol", "relative to |expected| per element"),
            ("atol", "absolute, in the output's units"),
        )
    )


def timeout(*, default: float, help: str) -> Spec:
    """``--timeout`` (``timeout_s``), seconds above 0 and at most `TIMEOUT_MAX_S`."""
    return Spec(
        decls=("--timeout", "timeout_s"),
        help=help,
        type=Number(min=0, min_open=True, max=TIMEOUT_MAX_S),
        default=default,
        metavar="SECONDS",
    )


def transport(*, help: str) -> Spec:
    """``--transport``: how a bundle's functions hand tensors to each other (default shm)."""
    return Spec(
        decls=("--transport",),
        help=help,
        type=registry("mopar.runtime.transports", "names"),
        default="shm",
    )


REDIS_URL = Spec(
    decls=("--redis-url",),
    help="Redis for --transport redis (default: a private redis-server on 127.0.0.1, "
    "started for the command).",
    default="",
    metavar="URL",
    shown="private server",
)
"""``--redis-url``: the Redis of ``--transport redis``."""


def json_output(help: str) -> Spec:
    """``--json`` (``as_json``)."""
    return Spec(decls=("--json", "as_json"), help=help, extra={"is_flag": True})


# --- serving a bundle on this machine (run, load, max-rate) --------------------------------------

SERVING: tuple[Spec, ...] = (
    Spec(
        decls=("--input", "input_file"),
        help="An .npz of inputs (default: the bundle's reference.npz).",
        type=click.Path(dir_okay=False),
        arg="FILE.npz",
        shown="`reference.npz`",
    ),
    Spec(
        decls=("--check",),
        help="Compare outputs with the reference; exit 1 on mismatch.",
        extra={"is_flag": True},
    ),
    transport(
        help="How slices hand tensors over: shm (pipe-driven workers, /dev/shm), http (each "
        "slice's function server on 127.0.0.1, chained) or redis (the same servers, frames "
        "handed over through Redis)."
    ),
    REDIS_URL,
    Spec(
        decls=("--threads",),
        help="onnxruntime intra-op threads per slice (0: onnxruntime's default).",
        type=click.IntRange(min=0),
        default=0,
        arg="T",
    ),
    *tolerance(decided="the bundle's, from compile", shown="the bundle's"),
    timeout(default=300.0, help="Seconds to wait for a slice before failing."),
)
"""What every command that serves a bundle here takes: its inputs, the check, the transport."""

BASELINE = Spec(
    decls=("--baseline",),
    help="Also run this bundle (e.g. the model compiled with --slices 1), requests interleaved "
    "A B A B, and print the ratios of the two.",
    type=click.Path(file_okay=False),
    arg="DIR",
)

AUTOSCALER: tuple[Spec, ...] = (
    Spec(
        decls=("--cold-experts",),
        help="Expert functions start cold, as scaled to zero: each is started when first "
        "called or pre-warmed, and all stop after every request (shm only).",
        extra={"is_flag": True},
    ),
    Spec(
        decls=("--prewarm/--no-prewarm",),
        help="With --cold-experts: start the expert functions a dispatch predicts for the "
        "next layer as soon as it predicts them.",
        default=True,
    ),
    Spec(
        decls=("--instances",),
        help="The most instances (worker processes) each function may run; another starts "
        "(a cold start) when the running ones are busy.",
        type=click.IntRange(min=1),
        default=1,
        arg="N",
    ),
    Spec(
        decls=("--instance-concurrency",),
        help="Requests in flight per instance before another starts (1: as Lambda).",
        type=click.IntRange(min=1),
        default=1,
        arg="C",
    ),
    Spec(
        decls=("--idle-s",),
        help="Stop an instance idle this many seconds, down to none (scale to zero; default: "
        "never).",
        type=Number(min=0),
        arg="S",
        shown="never",
    ),
    Spec(
        decls=("--cold", "start_cold"),
        help="Start with every function scaled to zero: no warm-up request; the first request "
        "starts them and its latency is reported.",
        extra={"is_flag": True},
    ),
    Spec(
        decls=("--enforce-memory",),
        help="Kill an instance whose peak RSS goes over its allocation, as the platform "
        "would; its requests fail and the kill is counted.",
        extra={"is_flag": True},
    ),
)
"""The shm runner's autoscaler (`mopar.runner.autoscale`): refused with another transport."""

CONTAINER_BUILD: tuple[Spec, ...] = (
    Spec(
        decls=("--engine",),
        help="Container engine (default: whichever is installed and answers).",
        type=click.Choice(["podman", "docker"]),
        shown="whichever answers",
    ),
    Spec(
        decls=("--base-image",),
        help="The image the Dockerfiles start from (default: the public python:3.11-slim ones "
        "they name; `make base-image` makes localhost/mopar-base:bookworm where no registry is "
        "reachable). Env: MOPAR_BASE_IMAGE.",
        metavar="IMAGE",
        extra={"envvar": "MOPAR_BASE_IMAGE"},
        shown="the Dockerfiles'",
    ),
    Spec(
        decls=("--wheelhouse",),
        help="Folder of wheels the images install from (default: mopar's cache; what is "
        "missing is downloaded into it, unless --offline).",
        type=click.Path(file_okay=False),
        arg="DIR",
        shown="mopar's cache",
    ),
    Spec(
        decls=("--offline",),
        help="Take every wheel from --wheelhouse; never reach a package index.",
        extra={"is_flag": True},
    ),
)
"""``--engine``, ``--base-image``, ``--wheelhouse`` and ``--offline`` (build, and serving in
containers)."""

CONTAINERS: tuple[Spec, ...] = (
    Spec(
        decls=("--containers",),
        help="Run each function as a container of its image (built first if missing, as "
        "`mopar build` does), with the plan's memory and CPU as its limits; co-located "
        "functions share a tmpfs, the others talk HTTP on loopback.",
        extra={"is_flag": True},
    ),
    *CONTAINER_BUILD,
)

TRAFFIC: tuple[Spec, ...] = (
    Spec(
        decls=("--duration", "duration_s"),
        help=f"Seconds of open-loop arrivals (per step); requests still in flight {GRACE_S:g} s "
        "after the last arrival count as failed.",
        type=Number(min=0, min_open=True),
        default=10.0,
        arg="S",
    ),
    Spec(
        decls=("--max-in-flight",),
        help="Open loop: arrivals while this many requests are in flight are dropped "
        "(throttled), never queued, and count as errors.",
        type=click.IntRange(min=1),
        default=256,
        arg="N",
    ),
    Spec(decls=("--seed",), help="Seed of the open loop's arrivals.", type=int, default=0, arg="N"),
)
"""An open loop's arrivals (load, max-rate), besides its rate."""

BILLING: tuple[Spec, ...] = (
    Spec(
        decls=("--target", "bill_target"),
        help="The platform whose bill of what was served is reported (default: the one the "
        "bundle was planned for).",
        arg="T",
        shown="the plan's",
    ),
)
