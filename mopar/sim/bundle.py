"""A bundle under traffic: its functions (`mopar.sim.model`), the arrivals
(`mopar.sim.traffic`) and the engine (`mopar.sim.engine`) put together, with the notes that
say what was assumed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from mopar.bundle.document import BundleDocument
from mopar.errors import Option, OptionError
from mopar.facts import Platform
from mopar.runner.report import SliceStats
from mopar.sim.engine import SimConfig, simulate
from mopar.sim.model import functions_of
from mopar.sim.result import SimResult
from mopar.sim.traffic import Traffic, arrivals

__all__ = ["simulate_bundle"]


def simulate_bundle(
    document: BundleDocument,
    platform: Platform,
    traffic: Traffic,
    config: SimConfig,
    *,
    profile: Mapping[str, SliceStats] | None = None,
    spread: float = 0.25,
    new_tokens: int | None = None,
    prompt_tokens: int | None = None,
) -> SimResult:
    """Serve ``traffic`` through the bundle whose ``plan.json`` is ``document`` on ``platform``.

    Args:
        profile: a ``mopar run --json`` report's slices (their measured times and starts).
        spread: the log-normal shape of a time known only by its median.
        new_tokens: a ``--generate`` bundle: the tokens each request generates (None: each
            request is one step).
        prompt_tokens: with ``new_tokens``, each request's prompt (None: compile's timed one).

    Raises:
        OptionError: traffic with no arrival, or options that cannot run.
        BundleError: a profile of another bundle.
    """
    generates = new_tokens if document.generation is not None else None
    functions = functions_of(
        document,
        platform,
        profile=profile,
        spread=spread,
        measured_vcpus=config.measured_vcpus,
        new_tokens=generates,
        prompt_tokens=prompt_tokens,
    )
    times = arrivals(traffic, config.seed)
    if not len(times):
        raise OptionError(
            f"the traffic ({traffic.describe()}) brings no request; raise ",
            Option("rate"),
            " or ",
            Option("duration"),
        )
    result = simulate(functions, platform, times, config, span_s=traffic.duration_s)
    rules = config.rules
    keep = "never" if rules.keep_alive_s is None else f"after {rules.keep_alive_s:g} s idle"
    cpu = (
        f"instances share {config.host_cores} cores of one machine at the CPU measured there"
        if config.host_cores is not None
        else f"each instance gets {platform.target}'s CPU for its memory (parallel share "
        f"{config.parallel_share:g} of each time, assumed)"
    )
    sources = sorted({f"{f.service.source}" for f in functions})
    inits = sorted({f.init_source for f in functions})
    notes = (
        f"traffic: {traffic.describe()}, seed {config.seed}",
        f"chain mode {config.chain}; {cpu}",
        f"instances: {rules.concurrency} request(s) each, {rules.min_instances}-"
        f"{rules.max_instances} per function, stopped {keep}; "
        f"{config.initial_instances} warm at the start",
        f"pool rules: {rules.source}",
        f"service times: {'; '.join(sources)}",
        f"cold starts: {'; '.join(inits)}",
    )
    if generates:
        notes = (
            *notes,
            f"each request generates {generates} tokens after a prompt of "
            + (f"{prompt_tokens} tokens" if prompt_tokens else "compile's timed length")
            + "; $ per 1,000 tokens is the bill per request over its tokens",
        )
    return replace(result, notes=notes, new_tokens=generates)
