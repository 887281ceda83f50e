"""Frozen configuration for compiling and running, with the unit of every field."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mopar.errors import MoparError, Option, OptionError, PlanError

__all__ = [
    "hot_experts_value",
    "CompileConfig",
    "DynamicDim",
    "parse_dynamic",
    "RunConfig",
    "SPACING_BITS",
    "SPACING_UNITS",
    "Tolerance",
    "spacing",
    "PROFILES_DIR",
    "TEMPLATES_DIR",
    "DEFAULT_GATEWAY",
    "check_deploy",
    "load_profile",
    "shipped_dir",
]


def shipped_dir(name: str) -> Path:
    """The folder of data mopar ships as ``name`` (``profiles``, ``templates``).

    An installed wheel holds it as package data, ``mopar/<name>``; a checkout (on ``PYTHONPATH``,
    or installed with ``pip install -e .``) has it as a top-level folder beside ``mopar/``.
    """
    installed = resources.files("mopar") / name
    if installed.is_dir():  # a wheel installs mopar unpacked: a real folder
        return Path(str(installed))
    return Path(__file__).resolve().parent.parent / name


DEFAULT_TARGET = "openfaas"
"""The target a plan is made for unless told otherwise (``--target``), and a plan's that names none."""

DEFAULT_GATEWAY = "http://127.0.0.1:8080"
"""Where faas-cli reaches the OpenFaaS gateway unless told otherwise (its own default)."""

PROFILES_DIR = shipped_dir("profiles")
"""The shipped platform profiles, predictors and transport figures."""
TEMPLATES_DIR = shipped_dir("templates")
"""The shipped deployment templates (the OpenFaaS language template ``openfaas/mopar-onnx``)."""


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    """The allclose tolerances of a check.

    Attributes:
        rtol: relative tolerance, a fraction of |expected| per element.
        atol: absolute tolerance, in the output's own units.
    """

    rtol: float = 1e-3
    atol: float = 1e-4

    def __str__(self) -> str:
        return f"rtol {self.rtol:g}, atol {self.atol:g}"

    @classmethod
    def given(cls, rtol: float | None, atol: float | None) -> Tolerance | None:
        """What a user gave as ``--rtol``/``--atol`` (``rtol=``/``atol=``): None where neither
        was (the outputs' types decide: `following`); one of them alone, the other is
        ``Tolerance()``'s."""
        if rtol is None and atol is None:
            return None
        base = cls()
        return cls(
            rtol=base.rtol if rtol is None else rtol, atol=base.atol if atol is None else atol
        )

    @classmethod
    def following(cls, outputs: Mapping[str, tuple[str, float]]) -> Tolerance:
        """The default tolerance of a model whose outputs have these types and magnitudes
        (``{name: (dtype, largest |value|)}``): ``Tolerance()`` where none is of a type in
        `SPACING_BITS`; else `SPACING_UNITS` units of that type's rounding step, relative to
        each element (``rtol``: units x its machine epsilon) and to the output's largest value
        (``atol``: units x ``np.spacing`` there), the widest over the outputs, and never below
        ``Tolerance()``."""
        low = [(t, m) for t, m in outputs.values() if t in SPACING_BITS]
        if not low:
            return cls()
        base = cls()
        return cls(
            rtol=max(base.rtol, *(SPACING_UNITS * spacing(t, 1.0) for t, _ in low)),
            atol=max(base.atol, *(SPACING_UNITS * spacing(t, m) for t, m in low)),
        )


SPACING_BITS = {"float16": (10, -14), "bfloat16": (7, -126)}
"""The floating types whose outputs are checked at a few of their rounding steps: each with
(bits of its significand after the point, its smallest normal exponent)."""

SPACING_UNITS = 4
"""Rounding steps of its type an output of a type in `SPACING_BITS` may differ by. Measured
(docs/exportable.md): a random-weight Llama of 22 layers, computed in float32, differs from its
own bfloat16 or float16 computation in torch by at most 2.1 of them at its largest logit."""


def spacing(dtype: str, magnitude: float) -> float:
    """``np.spacing`` of a value of ``magnitude`` in ``dtype`` (a key of `SPACING_BITS`): the
    distance from it to the next larger value of that type (the subnormals' below the smallest
    normal value)."""
    bits, lowest = SPACING_BITS[dtype]
    exponent = math.frexp(abs(magnitude))[1] - 1 if magnitude else lowest
    return math.ldexp(1.0, max(exponent, lowest) - bits)


MEASURE_IN = ("host", "containers")
"""Where compile may measure each function's peak memory (`CompileConfig.measure`)."""

QUANTIZE_MODES = ("none", "auto", "int8", "int4")
"""The weights' forms compile may be asked for (`CompileConfig.quantize`): none (exact), auto
(each function's cheapest within the budget), or one form for every function it applies to."""

KEEP_POSITIONS = ("all", "last")
"""``keep_positions``'s choices: an answer of every position, or of the last alone."""


@dataclass(frozen=True, kw_only=True)
class DynamicDim:
    """One dimension of a model input that a bundle takes at any size in a range.

    Attributes:
        input: the model input's name.
        axis: the dimension, counted from 0.
        min, max: the smallest and largest size a request may have, both included.
    """

    input: str
    axis: int
    min: int
    max: int

    def __str__(self) -> str:
        return f"{self.input}:{self.axis}={self.min}..{self.max}"


_DYNAMIC = re.compile(r"(?P<input>[A-Za-z_][\w.]*):(?P<axis>\d+)=(?P<min>\d+)\.\.(?P<max>\d+)")


def parse_dynamic(text: str) -> DynamicDim:
    """``NAME:AXIS=MIN..MAX`` (``input_ids:1=1..512``) as a `DynamicDim`.

    Raises:
        OptionError: ``text`` is not of that form, or its range is empty or starts below 1.
    """
    m = _DYNAMIC.fullmatch(text.strip())
    if m is None:
        raise OptionError(
            f"dynamic dimension {text!r} is not NAME:AXIS=MIN..MAX; write it as e.g. "
            "input_ids:1=1..512 (",
            Option("dynamic"),
            ")",
        )
    dim = DynamicDim(input=m["input"], axis=int(m["axis"]), min=int(m["min"]), max=int(m["max"]))
    if not 1 <= dim.min < dim.max:
        raise OptionError(
            f"dynamic dimension {text!r} has the range {dim.min}..{dim.max}, expected "
            "1 <= MIN < MAX; widen it (",
            Option("dynamic"),
            "), or leave the dimension out to keep it at the example's size",
        )
    return dim


@dataclass(frozen=True, kw_only=True)
class CompileConfig:
    """Options of `mopar.compile`.

    A field is the option of `mopar compile` of the same name (``max_memory_mb`` is
    ``--max-memory-mb``, ``profiles_dir`` is ``--profiles``), with its meaning, unit and default;
    each is described once, in `mopar.cli.options` and `mopar.cli.compile` (``mopar compile
    --help``, and docs/cli.md's table written from them). What is the API's own:

    Attributes:
        target: an entry of ``platforms.json``; the API's ``platform=`` replaces it with a
            `mopar.facts.Platform` built in code.
        simplify_threshold: node elimination merges neighbours whose memory differs by less
            (no option).
        tolerance: how close the chained slices' outputs must be to the model's (allclose), the
            CLI's ``--rtol`` and ``--atol``; None: `Tolerance.following` the outputs' types.
        opset: ONNX opset version (None: the exporter's default; no option).
        calibration, trace, profiles_dir: paths. ``profiles_dir`` is read once, by the API and
            the CLI (`mopar.facts.load_facts`), never by the phases below them.
        rate, trace: the traffic; both None: `mopar.traffic.DEFAULT_RATE_RPS`.
        dynamic: `DynamicDim` records; the API also takes their ``NAME:AXIS=MIN..MAX`` strings.

    Raises:
        OptionError: ``image_prefix``, ``gateway`` or ``redis_url`` is malformed.
    """

    slices: int | None = None
    strategy: str = "mopar"
    target: str = DEFAULT_TARGET
    transport: str | None = None
    colocate: bool = False
    arch: str = "x86_64"
    slo_ms: float | None = None
    max_slowdown: float = 1.05
    max_memory_mb: int | None = None
    cold_start_rate: float | None = None
    simplify_threshold: float = 0.05
    min_memory: bool = False
    parallel: int = 1
    force_parallel: bool = False
    codec: str = "none"
    calibration: Path | None = None
    max_output_error: float | None = None
    max_top1_change: float | None = None
    min_cosine: float | None = None
    quantize: str = "none"
    codec_budget_s: float = 60.0
    seed: int = 0
    depth: int | None = None
    tolerance: Tolerance | None = None
    opset: int | None = None
    experts: str = "functions"
    expert_group: int | None = None
    hot_experts: str | int = "auto"
    rate: float | None = None
    trace: Path | None = None
    chain: str | None = None
    check_latency: bool = True
    measure: str = "host"
    base_image: str = ""
    profiles_dir: Path = PROFILES_DIR
    image_prefix: str = ""
    gateway: str = DEFAULT_GATEWAY
    redis_url: str = ""
    generate: bool = False
    max_seq_len: int | None = None
    dynamic: tuple[DynamicDim, ...] = ()
    keep_positions: str = "all"

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "dynamic",
            tuple(d if isinstance(d, DynamicDim) else parse_dynamic(d) for d in self.dynamic),
        )
        check_deploy(image_prefix=self.image_prefix, gateway=self.gateway, redis_url=self.redis_url)
        if self.measure not in MEASURE_IN:
            raise OptionError(
                Option("measure", value=self.measure),
                f" is not a place to measure in; pass one of {', '.join(MEASURE_IN)}",
            )
        if self.quantize not in QUANTIZE_MODES:
            raise OptionError(
                "unknown ",
                Option("quantize", value=self.quantize, quoted=True),
                f"; choose one of {', '.join(QUANTIZE_MODES)}",
            )


# The image reference grammar of the OCI distribution spec (docker/distribution's reference):
# a registry host (with a port) is a first component holding a '.' or a ':', or localhost.
_HOST = re.compile(
    r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
    r"(?:\.(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9]))*(?::[0-9]+)?"
)
_NAMESPACE = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")


def _image_prefix_ok(prefix: str) -> bool:
    parts = prefix.removesuffix("/").split("/")
    first = parts[0]
    if "." in first or ":" in first or first == "localhost":
        if not _HOST.fullmatch(first):
            return False
        parts = parts[1:]
    return all(_NAMESPACE.fullmatch(p) for p in parts)


def _url_ok(url: str, schemes: tuple[str, ...]) -> bool:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        return False
    return parts.scheme in schemes and bool(parts.hostname) and not parts.fragment


def check_deploy(*, image_prefix: str, gateway: str, redis_url: str) -> None:
    """Check the values the deployment files carry (`CompileConfig`'s last three fields).

    Raises:
        OptionError: one of them is malformed, naming it, what was expected and the fix.
    """
    for name, value in (("gateway", gateway), ("redis_url", redis_url)):
        if "$" in value:
            raise OptionError(
                Option(name, value=value, quoted=True),
                " holds a '$', which faas-cli would substitute as a variable in stack.yml; "
                "leave the option out and write the value into stack.yml yourself",
            )
    if image_prefix and not _image_prefix_ok(image_prefix):
        raise OptionError(
            Option("image_prefix", value=image_prefix, quoted=True),
            " is not an image registry and namespace; expected lower-case names separated by "
            "'/', a registry host first, without a scheme, e.g. registry.example.com/team or "
            "docker.io/myuser",
        )
    if not _url_ok(gateway, ("http", "https")):
        raise OptionError(
            Option("gateway", value=gateway, quoted=True),
            " is not an http(s) URL of the OpenFaaS gateway; give its address with the "
            f"scheme, e.g. {DEFAULT_GATEWAY} or https://gateway.example.com",
        )
    if redis_url and not _url_ok(redis_url, ("redis", "rediss")):
        raise OptionError(
            Option("redis_url", value=redis_url, quoted=True),
            " is not a Redis URL; give redis://HOST:PORT/DB or rediss://HOST:PORT/DB (TLS), "
            "e.g. redis://my-cache:6379/0",
        )


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Options of `mopar run`.

    Attributes:
        requests: measured requests (after one warm-up request).
        concurrency: requests in flight at once.
        timeout_s: seconds one instance may work on one request (or take to start); past it,
            the instance is killed and its requests fail.
        intra_op_threads: onnxruntime intra-op threads per slice (0: onnxruntime's default).
        tolerance: how close outputs must be to the expected ones when they are checked.
        cold_experts: expert functions start cold, as on a platform that scaled them to zero:
            none runs before it is called or pre-warmed, and all stop after each request
            (``shm`` only).
        prewarm: where functions can be cold (``cold_experts``, ``start_cold``, ``idle_s``):
            start the expert functions a dispatch predicts for the next layer as soon as it
            predicts them, and when a request finds the chain's entry cold, start every other
            function with no instance at once.
        rate: an open loop of Poisson arrivals at this many requests per second, for
            ``duration_s`` (None: the closed loop of ``requests`` and ``concurrency``).
        duration_s: seconds of open-loop arrivals.
        seed: seed of the arrival times.
        max_in_flight: in the open loop, arrivals while this many requests are in flight are
            refused (throttled, as a platform's concurrency limit does) and count as errors.
        instances: the most instances (worker processes) one function may run at once.
        instance_concurrency: requests in flight per instance before another is started (1:
            as Lambda); at ``instances`` they wait at the least-loaded one.
        idle_s: an instance idle this many seconds is stopped, down to none (None: never).
        start_cold: no function runs before the first request, which is not a warm-up but
            measured (its latency is the report's ``first_request_ms``).
        enforce_memory: kill an instance whose peak RSS goes over its function's allocation,
            as the platform would; its requests fail and the report counts the kill.
        start_one_at_a_time: start each function's process once the one before is ready, so
            that no two load their weights at once (onnxruntime's load peak is about twice
            the weights: `profiles/runtime.json`); a compile of a large model does.
        in_turn: serve the functions one at a time, each on every request before the next
            starts, fed the frames the one before handed on (`mopar.runner.stepwise`): the
            machine holds one function, not the plan; how compile measures a large model.
        redis_stand_in: no redis-server here (compile's measurement): every frame planned
            through Redis goes inline instead, with no payload limit; the caller adds the Redis
            hops' cost from the profiles (`mopar.pipeline.serving.serve`).
    """

    requests: int = 10
    concurrency: int = 1
    timeout_s: float = 300.0
    intra_op_threads: int = 0
    tolerance: Tolerance = Tolerance()
    cold_experts: bool = False
    prewarm: bool = True
    rate: float | None = None
    duration_s: float = 10.0
    seed: int = 0
    max_in_flight: int = 256
    instances: int = 1
    instance_concurrency: int = 1
    idle_s: float | None = None
    start_cold: bool = False
    enforce_memory: bool = False
    start_one_at_a_time: bool = False
    in_turn: bool = False
    redis_stand_in: bool = False


@cache
def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def load_profile(profiles_dir: Path, name: str) -> dict[str, Any]:
    """Read ``name.json`` from ``profiles_dir``, else from the shipped profiles.

    A user's folder (``mopar profile train --out DIR``) holds their predictors; platform facts
    they did not measure themselves come from the shipped ones.
    """
    path = Path(profiles_dir) / f"{name}.json"
    if not path.is_file():
        path = PROFILES_DIR / f"{name}.json"
    if not path.is_file():
        raise MoparError(*_missing(profiles_dir, name))
    try:
        return _read_json(path)
    except json.JSONDecodeError as exc:
        raise MoparError(f"profile {str(path)!r} is not valid JSON ({exc}); restore it") from None


def _missing(profiles_dir: Path, name: str) -> tuple[str | Option, ...]:
    """The message for a profile that neither ``profiles_dir`` nor the shipped folder holds:
    each folder named once, and the fix that fits it."""
    shipped = str(PROFILES_DIR)
    if Path(profiles_dir).resolve() == PROFILES_DIR.resolve():
        return (
            f"the shipped profile {name}.json is missing from {shipped!r}, so this mopar is "
            "incomplete; reinstall mopar with pip, or pass ",
            Option("profiles_dir", cli="profiles", metavar="DIR"),
            f" a folder holding {name}.json",
        )
    return (
        f"profile {name}.json is in neither {str(profiles_dir)!r} nor the shipped profiles "
        f"({shipped!r}, incomplete: reinstall mopar); put {name}.json in the folder given as ",
        Option("profiles_dir", cli="profiles", metavar="DIR"),
    )


def hot_experts_value(value: str | int) -> str | int:
    """``auto``, ``none`` or a count of hot experts, from the option's value."""
    text = str(value).strip().lower()
    if text in ("auto", "none"):
        return text
    if text.isdigit():
        return int(text)
    raise PlanError(
        Option("hot_experts"), f" must be auto, none or a count of experts, got {value!r}"
    )
