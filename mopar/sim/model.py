"""What the simulator knows of a bundle and of a platform: its functions (`SimFunction`: memory,
INIT, service times) and how the platform runs their instances (`PoolRules`).

Read in this order: `ServiceTimes` (a function's own time per invocation, where it came from),
`SimFunction`, `functions_of` (a bundle's functions, from its ``plan.json`` and, when given, a
``mopar run --json`` report), `PoolRules` and `pool_rules` (keep-alive, replicas, per-instance
concurrency per platform), then `cpu_factor` (a time measured on one CPU share, on another).

Service times, best first:

1. a ``mopar run --json`` report (``--profile``): each function's measured samples
   (``samples_ms``), else a log-normal through its p50 and p95;
2. ``plan.json``'s ``sizing`` section: the p50 compile measured on this machine, with a stated
   log-normal spread;
3. ``plan.json``'s predicted ``time_ms`` (already at the platform's CPU share), with that spread.

A cold start takes the measured start (``cold_start_ms``) of the report, else the platform's
INIT model (`mopar.facts.Platform.init_ms`: measured here, 200 ms + 2.3 ms per MB of weights).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from mopar.bundle.document import BundleDocument
from mopar.bundle.generation import GenerationSpec
from mopar.errors import BundleError, Option, OptionError
from mopar.facts import Platform
from mopar.plan import Plan
from mopar.runner.report import SliceStats

__all__ = ["PoolRules", "ServiceTimes", "SimFunction", "cpu_factor", "functions_of", "pool_rules"]

Z95 = 1.6448536269514722
"""The standard normal's 95th percentile: a log-normal's p95 / p50 is exp(sigma x Z95)."""


@dataclass(frozen=True, kw_only=True)
class ServiceTimes:
    """A function's own time per invocation where it was measured (or predicted).

    Attributes:
        samples_ms: measured times, ms, drawn from with replacement (empty: use the log-normal).
        median_ms: the log-normal's median, ms.
        sigma: the log-normal's shape (0: always the median).
        vcpus: the CPU the times were measured or predicted with.
        source: where they came from, for people.
    """

    samples_ms: tuple[float, ...] = ()
    median_ms: float = 0.0
    sigma: float = 0.0
    vcpus: float
    source: str

    def mean_ms(self) -> float:
        """The mean time, ms."""
        if self.samples_ms:
            return float(np.mean(self.samples_ms))
        return self.median_ms * math.exp(self.sigma**2 / 2)

    def draw(self, rng: np.random.Generator) -> float:
        """One time, ms."""
        if self.samples_ms:
            return self.samples_ms[int(rng.integers(len(self.samples_ms)))]
        if self.sigma <= 0:
            return self.median_ms
        return self.median_ms * math.exp(self.sigma * rng.standard_normal())


@dataclass(frozen=True, kw_only=True)
class SimFunction:
    """One function as the simulator runs it.

    Attributes:
        name: its name in the plan.
        memory_mb: its memory.
        vcpus: the CPU it requested (its plan's ``vcpus``; 0: none); what it gets is the
            platform's `mopar.facts.Platform.cpu_of`.
        called: invoked by the function that consumes its outputs (a sub-slice, an expert
            function), which waits for it; else on the request path.
        caller: the function that calls it (None: on the path).
        probability: the share of its caller's invocations (or of requests) that invoke it.
        init_ms: a cold start's INIT time, ms.
        init_source: where ``init_ms`` came from.
        service: its own time per invocation (per step, with ``steps``).
        steps: how many times one invocation calls its callees and computes: a generation's
            main function, once per token.
    """

    name: str
    memory_mb: int
    vcpus: float = 0.0
    called: bool = False
    caller: str | None = None
    probability: float = 1.0
    init_ms: float
    init_source: str
    service: ServiceTimes
    steps: int = 1


def functions_of(
    document: BundleDocument,
    platform: Platform,
    *,
    profile: Mapping[str, SliceStats] | None = None,
    spread: float = 0.25,
    measured_vcpus: float | None = None,
    new_tokens: int | None = None,
    prompt_tokens: int | None = None,
) -> tuple[SimFunction, ...]:
    """The functions of the bundle whose ``plan.json`` is ``document``, in plan order.

    Args:
        platform: where they run (its INIT model, for functions the profile does not time).
        profile: a ``mopar run --json`` report's slices by name (`mopar.runner.report.read_run`).
        spread: the log-normal shape given to a time known only by its median.
        measured_vcpus: the CPU this machine gave each measured process (None: its cores).
        new_tokens: a ``--generate`` bundle: each request generates this many tokens, and its
            main function is busy for the whole generation (`_generation_times`).
        prompt_tokens: with ``new_tokens``, each request's prompt (None: compile's timed one).

    Raises:
        BundleError: the profile is of another bundle (it lacks one of the plan's functions).
    """
    plan = Plan.from_dict(dict(document.plan))
    here = float(measured_vcpus or os.cpu_count() or 1)
    sized = {s.function: s for s in document.sizing or ()}
    if profile is not None:
        missing = [f.name for f in plan.functions if f.name not in profile]
        if missing:
            raise BundleError(
                "the ",
                Option("profile", metavar="RUN.json"),
                f" report has no function {missing[0]} of this bundle (it has "
                f"{', '.join(sorted(profile))}); run `mopar load BUNDLE --rate R --json` on this "
                "bundle to make one",
            )
    out = []
    for f in plan.functions:
        measured = profile.get(f.name) if profile is not None else None
        if measured is not None and measured.samples_ms:
            service = ServiceTimes(
                samples_ms=tuple(measured.samples_ms),
                vcpus=here,
                source=f"{len(measured.samples_ms)} samples measured by mopar run",
            )
        elif measured is not None and measured.p50_ms:
            p95 = measured.p95_ms or measured.p50_ms
            service = ServiceTimes(
                median_ms=measured.p50_ms,
                sigma=max(0.0, math.log(p95 / measured.p50_ms) / Z95),
                vcpus=here,
                source="log-normal through p50 and p95 measured by mopar run",
            )
        elif f.name in sized and sized[f.name].p50_ms is not None:  # None: never invoked
            service = ServiceTimes(
                median_ms=sized[f.name].p50_ms,
                sigma=spread,
                vcpus=here,
                source=f"p50 measured by compile, log-normal spread {spread:g} (assumed)",
            )
        else:
            service = ServiceTimes(
                median_ms=f.time_ms,
                sigma=spread,
                vcpus=platform.cpu_of(f.memory_mb, f.vcpus),
                source=f"predicted time_ms, log-normal spread {spread:g} (assumed)",
            )
        generation = document.generation
        if generation is not None and new_tokens and f.name == generation.function:
            if not generation.callees:
                service = _generation_times(service, generation, new_tokens, spread, prompt_tokens)
        if measured is not None and measured.cold_start_ms:
            init_ms, init_source = measured.cold_start_ms, "median start measured by mopar run"
        else:
            init_ms = platform.init_ms(f.param_bytes)
            init_source = "INIT model of profiles/runtime.json (measured here)"
        called = f.spec.called
        out.append(
            SimFunction(
                name=f.name,
                # deployed at the platform's smallest size at least (a bundle planned for
                # OpenFaaS, simulated on Lambda)
                memory_mb=max(f.memory_mb, platform.min_mb),
                vcpus=f.vcpus,
                called=called,
                caller=plan.caller(f.name).name if called else None,
                probability=plan.invocation_probability(f.name),
                init_ms=float(init_ms),
                init_source=init_source,
                service=service,
            )
        )
    generation = document.generation
    if generation is not None and new_tokens and generation.callees:
        return _main_and_callees(
            tuple(out), plan, generation, new_tokens, platform, spread, prompt_tokens
        )
    return tuple(out)


def _main_and_callees(
    functions: tuple[SimFunction, ...],
    plan: Plan,
    generation: GenerationSpec,
    new_tokens: int,
    platform: Platform,
    spread: float,
    prompt_tokens: int | None = None,
) -> tuple[SimFunction, ...]:
    """A generation bundle with expert functions as it is deployed: one main function (its
    path's units together, sized by compile's measured need, else their memory summed) that,
    ``new_tokens`` times per request, calls each expert function with the chance that one
    token reaches it, then computes its step; and the expert functions, called per step.

    The chance per token comes from the plan's chance per request of the example's tokens,
    taken as independent tokens. The main function's step is compile's timed step (its expert
    functions in process) less the expected time of the experts it then called.
    """
    by_name = {f.name: f for f in functions}
    units = [by_name[n] for n in generation.units]
    tokens = generation.timing.prompt_tokens if generation.timing else 1
    callees = []
    for name in generation.callees:
        per_request = plan.invocation_probability(name)
        per_token = 1.0 - (1.0 - min(per_request, 1.0)) ** (1.0 / max(tokens, 1))
        callees.append(replace(by_name[name], caller=generation.function, probability=per_token))
    experts_ms = sum(c.probability * c.service.mean_ms() for c in callees)
    if generation.timing is not None:
        step_ms = generation.timing.request_ms(new_tokens, prompt_tokens) / new_tokens
        source = (
            f"{new_tokens} steps of {step_ms:.3g} ms (compile's timed generation) less the "
            f"expected {experts_ms:.3g} ms of expert functions called per step"
        )
    else:
        step_ms = sum(u.service.mean_ms() for u in units)
        source = f"{new_tokens} steps, each the path's units' times"
    main = SimFunction(
        name=generation.function,
        memory_mb=platform.round_mb(generation.main_need_mb([u.memory_mb for u in units])),
        vcpus=units[0].vcpus,
        init_ms=sum(u.init_ms for u in units),
        init_source=units[0].init_source,
        service=ServiceTimes(
            median_ms=max(step_ms - experts_ms, 0.2 * step_ms),
            sigma=spread,
            vcpus=units[0].service.vcpus,
            source=source,
        ),
        steps=new_tokens,
    )
    return (main, *callees)


def _generation_times(
    step: ServiceTimes,
    generation: GenerationSpec,
    new_tokens: int,
    spread: float,
    prompt_tokens: int | None = None,
) -> ServiceTimes:
    """A main function's time per request when each generates ``new_tokens`` after
    ``prompt_tokens``: compile's timed generation (its first token, scaled to the prompt, then
    its per-token p50 for each later one), else ``step``'s median for every token (the prompt's
    step included)."""
    timing = generation.timing
    if timing is not None:
        prompt = prompt_tokens or timing.prompt_tokens
        return ServiceTimes(
            median_ms=timing.request_ms(new_tokens, prompt_tokens),
            sigma=spread,
            vcpus=step.vcpus,
            source=f"a generation of {new_tokens} tokens after {prompt} prompt tokens: the "
            f"first in {timing.first_token_ms:g} ms x {prompt}/{timing.prompt_tokens}, each "
            f"later in {timing.token_p50_ms:g} ms (p50s of compile's timed generation after "
            f"{timing.prompt_tokens} prompt tokens), log-normal spread {spread:g} (assumed)",
        )
    median = float(np.median(step.samples_ms)) if step.samples_ms else step.median_ms
    return ServiceTimes(
        median_ms=median * new_tokens,
        sigma=spread,
        vcpus=step.vcpus,
        source=f"a generation of {new_tokens} tokens, each a step of {median:g} ms ({step.source})",
    )


@dataclass(frozen=True, kw_only=True)
class PoolRules:
    """How a platform runs one function's instances.

    Attributes:
        keep_alive_s: an instance idle this long is stopped (None: never; scale to zero only
            down to ``min_instances``).
        min_instances: instances kept however idle (OpenFaaS's min replicas; 0: scale to zero).
        max_instances: the most instances at once; past it requests queue at the least loaded.
        concurrency: requests one instance serves at once (Lambda 1; OpenFaaS: the function
            server's threads, of-watchdog's ``max_inflight`` where set).
        source: where these figures come from, for people.
        scale_every_s: None: an instance starts whenever a request finds every one full (Lambda,
            ``mopar run``); else the autoscaler sets the instances every this many seconds from
            the mean load since it last looked, and requests beyond their slots queue (OpenFaaS).
        target_load: with ``scale_every_s``, the requests in flight it keeps per instance.
    """

    keep_alive_s: float | None
    min_instances: int
    max_instances: int
    concurrency: int
    source: str
    scale_every_s: float | None = None
    target_load: float = 1.0


def pool_rules(platform: Platform) -> PoolRules:
    """``platform``'s instance-pool rules, from its facts (``profiles/platforms.json``, which
    the planner prices with): the keep-alive, the replicas kept however idle and each
    instance's concurrency; and the most instances at once (``Platform.max_replicas``)."""
    keep = None if math.isinf(platform.keep_alive_s) else platform.keep_alive_s
    every = platform.scale_every_s or None
    scaling = (
        f"set every {every:g} s for {platform.target_load:g} in flight each"
        if every
        else "one started whenever all are full"
    )
    return PoolRules(
        keep_alive_s=keep,
        min_instances=platform.min_replicas,
        max_instances=platform.max_replicas,
        concurrency=platform.max_inflight,
        scale_every_s=every,
        target_load=platform.target_load,
        source=f"{platform.target}: instances {scaling}; idle ones "
        + ("kept" if keep is None else f"stopped after {keep:g} s")
        + f"; at least {platform.min_replicas}, {platform.max_inflight} request(s) each, at "
        f"most {platform.max_replicas} (profiles/platforms.json)",
    )


def cpu_factor(measured_vcpus: float, vcpus: float, parallel_share: float) -> float:
    """How much longer a time measured with ``measured_vcpus`` takes with ``vcpus``.

    The planner's CPU-share model (`mopar.planner.cost.slice_time_ms`), with the parallel part a
    fixed share of the time: below one vCPU everything slows down in proportion (Lambda
    throttles the whole process), above one only ``parallel_share`` speeds up.

    Raises:
        OptionError: a share outside 0-1 or a CPU that is not positive.
    """
    if not 0 <= parallel_share <= 1:
        raise OptionError(
            Option("parallel_share", value=parallel_share),
            " must be between 0 and 1 (the share of a function's time that runs in parallel)",
        )
    if vcpus <= 0 or measured_vcpus <= 0:
        raise OptionError(
            Option("vcpus", value=vcpus), " must be above 0 (each instance's CPU, in vCPUs)"
        )

    def time(c: float) -> float:
        return (1 - parallel_share) / min(c, 1.0) + parallel_share / c

    return time(vcpus) / time(measured_vcpus)
