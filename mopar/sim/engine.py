"""The platform simulator: a bundle's functions as SimPy instance pools under traffic.

Read in this order: `SimConfig` (what the user chose: pool rules, CPU, seed), `simulate` (the
entry point: arrivals in, `mopar.sim.result.SimResult` out), then `_Sim` (the SimPy model:
`_Sim._request` walks a request along the path, `_Sim._visit` is one invocation) and `_Pool`
(one function's instances: routing, cold starts, keep-alive).

What it models, per function:

- an instance pool: a request goes to the least-loaded instance that has a free slot (ready
  ones first); when none has, another starts, up to ``max_instances``, and beyond that the
  request queues at the least loaded (the same autoscaler as ``mopar run``'s, and Lambda's);
  or, where the platform's autoscaler sets the instances from the load (``scale_every_s``:
  OpenFaaS), every so often as many as the mean load since it last looked calls for, and
  requests beyond their slots queue at the least loaded;
- a cold start takes the function's INIT time before the instance serves, and where INIT is
  billed the invocation that met it pays it;
- an instance idle ``keep_alive_s`` is stopped, down to ``min_instances`` (scale to zero at 0);
- each instance gets the platform's CPU for its memory (`mopar.facts.Platform.cpu`), and its
  service times are scaled from the CPU they were measured with (`mopar.sim.model.cpu_factor`);
  with ``host_cores``, instances instead share that many cores of one machine, at the CPU they
  were measured with (this machine, to check the simulator against ``mopar run``);
- ``concurrency`` requests in flight per instance, sharing its whole vCPUs;
- the chain mode (`mopar.bill.CHAINS`): where a caller waits (``invoke``, ``http``) it holds
  its instance, and is billed, until the rest of the path has answered; otherwise it hands on
  and is free. A called function (a sub-slice, an expert function) is always waited for by its
  caller, whose own time includes that wait.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import simpy

from mopar.bill import CHAINS, Invocation
from mopar.errors import Option, OptionError
from mopar.facts import Platform
from mopar.sim.model import PoolRules, SimFunction, cpu_factor
from mopar.sim.result import Served, SimResult, summarise

__all__ = ["SimConfig", "simulate"]


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """What one simulation runs with.

    Attributes:
        rules: the instance pools' rules (`mopar.sim.model.pool_rules` gives each platform's).
        chain: the chain mode, a key of `mopar.bill.CHAINS`.
        seed: seeds the service times and the coin flips of called functions (the arrivals
            have their own, `mopar.sim.traffic.arrivals`).
        initial_instances: warm instances of every function at the start (at least
            ``rules.min_instances``): 1, as after earlier traffic (where an autoscaler sets the
            instances, as many as it keeps at the traffic's mean rate); 0 starts cold.
        host_cores: instances share this many cores of one machine at the CPU they were
            measured with (None: each gets the platform's CPU for its memory).
        parallel_share: the share of a function's time that runs in parallel across vCPUs.
        measured_vcpus: the CPU the service times were measured with (None: this machine's
            cores).
    """

    rules: PoolRules
    chain: str
    seed: int = 0
    initial_instances: int = 1
    host_cores: int | None = None
    parallel_share: float = 0.5
    measured_vcpus: float | None = None


def simulate(
    functions: Sequence[SimFunction],
    platform: Platform,
    times_s: np.ndarray,
    config: SimConfig,
    *,
    span_s: float | None = None,
) -> SimResult:
    """Serve requests arriving at ``times_s`` (s, sorted) through ``functions`` on ``platform``.

    Args:
        span_s: the span the arrivals cover, s (None: up to the last arrival); replicas are
            billed from 0 to the later of it and the last answer.

    Raises:
        OptionError: a chain mode of another platform, or pool rules that cannot run.
    """
    _check(config, platform)
    times_s = np.asarray(times_s, dtype=float)
    span = float(span_s or (times_s[-1] if len(times_s) else 0.0))
    sim = _Sim(functions, platform, config, rate_rps=len(times_s) / span if span > 0 else 0.0)
    sim.env.process(sim._arrive(times_s))
    sim.env.run()  # to the last reaper: instances stopped after the span are clipped to it
    for pool in sim.pools:
        pool.close()
    end = max(float(span_s or 0.0), sim.last_answer_s, float(times_s[-1]) if len(times_s) else 0)
    served = [
        Served(
            function=f,
            invocations=tuple(sim.invocations[k]),
            own_ms=tuple(sim.own_ms[k]),
            cold=sim.pools[k].cold_starts,
            most=sim.pools[k].most,
            lives=tuple((born, min(died, end)) for born, died in sim.pools[k].lives if born < end),
        )
        for k, f in enumerate(functions)
    ]
    return summarise(
        served,
        platform=platform,
        chain=config.chain,
        latencies_ms=np.asarray(sim.latencies_ms),
        cold_requests=sim.cold_requests,
        span_s=end,
    )


def _check(config: SimConfig, platform: Platform) -> None:
    offered = [c.name for c in platform.chains]  # its target's modes (none: any)
    if config.chain not in CHAINS or (offered and config.chain not in offered):
        fits = offered or list(CHAINS)
        raise OptionError(
            Option("chain", value=config.chain, quoted=True),
            f" is not a chain mode of {platform.target}; choose one of {', '.join(fits)}",
        )
    rules = config.rules
    if rules.concurrency < 1 or rules.max_instances < 1 or rules.min_instances < 0:
        raise OptionError(
            "each instance serves at least 1 request and a pool may hold at least 1; got "
            f"concurrency {rules.concurrency}, max instances {rules.max_instances}, min "
            f"instances {rules.min_instances}; raise them"
        )
    if rules.min_instances > rules.max_instances:
        raise OptionError(
            Option("min_instances", value=rules.min_instances),
            " is above ",
            Option("max_instances", value=rules.max_instances),
            "; lower it",
        )


class _Instance:
    """One instance: ready once started, its slots (requests it serves at once), its cores."""

    __slots__ = (
        "ready",
        "slots",
        "cores",
        "load",
        "idle_tick",
        "init_ms",
        "fresh",
        "life",
        "draining",
    )

    def __init__(self, env: simpy.Environment, concurrency: int, cores: int) -> None:
        self.ready = env.event()
        self.slots = simpy.Resource(env, capacity=concurrency)
        # requests in flight on one instance share its whole vCPUs (none to share at 1)
        self.cores = simpy.Resource(env, capacity=cores) if concurrency > cores else None
        self.load = 0  # requests routed to it and not finished
        self.idle_tick = 0  # bumped each time it goes idle; a reaper acts only on its own tick
        self.init_ms = 0.0  # its INIT, paid by its first invocation
        self.fresh = True  # no invocation has run on it yet
        self.life: list[float] = []
        self.draining = False  # scaled in: gets no new request, stops once idle


class _Pool:
    """One function's instances, as the platform's autoscaler runs them."""

    def __init__(self, sim: _Sim, function: SimFunction) -> None:
        self.sim, self.function = sim, function
        self.rules = sim.config.rules
        self.live: list[_Instance] = []
        self.lives: list[tuple[float, float]] = []  # (born, died) of every stopped instance
        self.cold_starts = 0
        self.most = 0
        self.load = 0  # invocations routed to its instances and not finished
        self.load_s = 0.0  # the load integrated over time, request-seconds
        self.load_at = 0.0  # when ``load_s`` was last brought up to date
        # the CPU the platform gives it; on one shared machine, the CPU measured there
        vcpus = (
            sim.platform.cpu_of(function.memory_mb, function.vcpus)
            if sim.host is None
            else sim.measured
        )
        self.cores = max(1, math.floor(vcpus))
        self.factor = cpu_factor(function.service.vcpus, vcpus, sim.config.parallel_share)
        warm = max(sim.config.initial_instances, self.rules.min_instances)
        if self.rules.scale_every_s is not None and sim.config.initial_instances > 0:
            warm = max(warm, self._steady())
        for _ in range(warm):
            x = self._spawn(cold=False)
            self._idle(x)
        if self.rules.scale_every_s is not None:
            sim.env.process(self._autoscale())

    def _steady(self) -> int:
        """The instances the autoscaler keeps under the traffic's mean rate (warm at the start,
        as after earlier traffic at that rate): its mean load, each invocation held for its mean
        time and, where callers wait, the mean times of the path after it, over
        ``target_load``."""
        sim, f = self.sim, self.function
        held = f.service.mean_ms() * f.steps * self.factor
        share = f.probability
        if f.called:  # per step of its caller: a generation's main function calls per token
            caller = next(g for g in sim.functions if g.name == f.caller)
            share *= caller.probability * caller.steps
        elif sim.waits:
            after = sim.path[sim.path.index(sim.functions.index(f)) + 1 :]
            held += sum(sim.functions[k].service.mean_ms() for k in after)
        load = sim.rate_rps * share * held / 1e3
        return min(math.ceil(load / self.rules.target_load - 1e-9), self.rules.max_instances)

    def _spawn(self, *, cold: bool) -> _Instance:
        env = self.sim.env
        x = _Instance(env, self.rules.concurrency, self.cores)
        x.life.append(env.now)
        self.live.append(x)
        self.most = max(self.most, len(self.live))
        if cold:
            self.cold_starts += 1
            x.init_ms = self.function.init_ms
            env.process(self._boot(x))
        else:
            x.ready.succeed()
        return x

    def _boot(self, x: _Instance):
        # a start takes its INIT; on a shared machine the measured start already holds the
        # contention it met, so it takes no core here
        yield self.sim.env.timeout(x.init_ms / 1e3)
        x.ready.succeed()

    def _count(self, change: int) -> None:
        now = self.sim.env.now
        self.load_s += self.load * (now - self.load_at)
        self.load, self.load_at = self.load + change, now

    def _autoscale(self):
        """The platform's autoscaler: every ``scale_every_s``, as many instances as the mean load
        since it last looked calls for (``target_load`` in flight on each, between the pool's
        bounds); new ones start cold, idle ones above the count are stopped."""
        rules, env = self.rules, self.sim.env
        while not self.sim.finished():
            self._count(0)
            before = self.load_s
            yield env.timeout(rules.scale_every_s)
            self._count(0)
            mean = (self.load_s - before) / rules.scale_every_s
            want = min(
                max(math.ceil(mean / rules.target_load - 1e-9), rules.min_instances),
                rules.max_instances,
            )
            active = [x for x in self.live if not x.draining]
            for _ in range(want - len(active)):
                self._idle(self._spawn(cold=True))
            # scaled in: the least loaded, newest first, take no new request and stop once idle
            for x in sorted(reversed(active), key=lambda x: x.load)[: max(len(active) - want, 0)]:
                x.draining = True
                if x.load == 0:
                    self._stop(x)

    def pick(self) -> _Instance:
        """The instance a new invocation goes to; a cold start when every one is full (where the
        autoscaler sets the instances, only when there is none)."""
        self._count(+1)
        scales_per_request = self.rules.scale_every_s is None
        if scales_per_request:
            best = min(self.live, key=lambda x: (x.load, not x.ready.triggered), default=None)
        else:  # routed to ready replicas only while there are any (readiness probes)
            open_ = [x for x in self.live if not x.draining]
            best = min(open_, key=lambda x: (not x.ready.triggered, x.load), default=None)
        if best is None or (
            scales_per_request
            and best.load >= self.rules.concurrency
            and len(self.live) < self.rules.max_instances
        ):
            best = self._spawn(cold=True)
        elif best.load >= self.rules.concurrency:
            # at the cap: it waits its turn at a running instance rather than behind a start
            ready = [x for x in self.live if x.ready.triggered and not x.draining]
            best = min(ready, key=lambda x: x.load) if ready else best
        best.load += 1
        return best

    def release(self, x: _Instance) -> None:
        self._count(-1)
        x.load -= 1
        if x.load == 0 and x.draining:
            self._stop(x)
        elif x.load == 0:
            self._idle(x)

    def _idle(self, x: _Instance) -> None:
        x.idle_tick += 1
        if self.rules.keep_alive_s is not None:
            self.sim.env.process(self._reap(x, x.idle_tick))

    def _reap(self, x: _Instance, tick: int):
        yield self.sim.env.timeout(self.rules.keep_alive_s)
        if (
            x in self.live
            and x.load == 0
            and x.idle_tick == tick
            and len(self.live) > self.rules.min_instances
        ):
            self._stop(x)

    def _stop(self, x: _Instance) -> None:
        self.live.remove(x)
        self.lives.append((x.life[0], self.sim.env.now))

    def close(self) -> None:
        """Every instance still running lives to the end of the span."""
        self.lives += [(x.life[0], math.inf) for x in self.live]
        self.live = []


class _Sim:
    """The SimPy model of one bundle on one platform."""

    def __init__(
        self,
        functions: Sequence[SimFunction],
        platform: Platform,
        config: SimConfig,
        *,
        rate_rps: float,
    ) -> None:
        self.env = simpy.Environment()
        self.platform, self.config = platform, config
        self.waits = CHAINS[config.chain].caller_waits
        self.rng = np.random.default_rng([config.seed, 2])
        self.measured = float(config.measured_vcpus or os.cpu_count() or 1)
        self.host = (
            simpy.Resource(self.env, capacity=config.host_cores)
            if config.host_cores is not None
            else None
        )
        self.functions = tuple(functions)
        self.path = [k for k, f in enumerate(functions) if not f.called]
        self.callees = {
            k: [j for j, g in enumerate(functions) if g.called and g.caller == f.name]
            for k, f in enumerate(functions)
        }
        self.arriving = True  # arrivals still to come
        self.in_flight = 0  # requests arrived and not answered
        self.rate_rps = rate_rps
        self.pools = [_Pool(self, f) for f in functions]
        self.invocations: list[list[Invocation]] = [[] for _ in functions]
        self.own_ms: list[list[float]] = [[] for _ in functions]
        self.latencies_ms: list[float] = []
        self.cold_requests = 0
        self.last_answer_s = 0.0

    def compute(self, x: _Instance, ms: float):
        """Hold a core (of the instance, then of the machine, where shared) for ``ms``."""
        held = [r.request() for r in (x.cores, self.host) if r is not None]
        for req in held:
            yield req
        yield self.env.timeout(ms / 1e3)
        for req in held:
            req.resource.release(req)

    def finished(self) -> bool:
        """Every request has arrived and been answered."""
        return not self.arriving and self.in_flight == 0

    def _arrive(self, times_s: np.ndarray):
        for t in times_s:
            yield self.env.timeout(max(0.0, float(t) - self.env.now))
            self.in_flight += 1
            self.env.process(self._request())
        self.arriving = False

    def _request(self):
        arrived = self.env.now
        met_cold = [False]
        yield from self._visit(0, met_cold)
        self.latencies_ms.append((self.env.now - arrived) * 1e3)
        self.cold_requests += met_cold[0]
        self.last_answer_s = self.env.now
        self.in_flight -= 1

    def _visit(self, step: int, met_cold: list[bool]):
        """Function ``path[step]`` serves one invocation, then hands on (or calls and waits)."""
        k = self.path[step]
        pool, f = self.pools[k], self.functions[k]
        x = pool.pick()
        if not x.ready.triggered:
            met_cold[0] = True
            yield x.ready
        wait_ms = 0.0
        with x.slots.request() as slot:
            yield slot
            start = self.env.now
            init_ms, x.fresh = (x.init_ms if x.fresh else 0.0), False
            for _ in range(f.steps):  # a generation's main function: once per token
                calls = [
                    self.env.process(self._called(j, met_cold))
                    for j in self.callees[k]
                    if self.rng.random() < self.functions[j].probability
                ]
                if calls:
                    yield simpy.AllOf(self.env, calls)
                yield from self.compute(x, f.service.draw(self.rng) * pool.factor)
            own_ms = (self.env.now - start) * 1e3
            last = step + 1 == len(self.path)
            if self.waits and not last:
                handed = self.env.now
                yield self.env.timeout(self.platform.hop_ms / 1e3)
                yield from self._visit(step + 1, met_cold)
                wait_ms = (self.env.now - handed) * 1e3
        pool.release(x)
        self._record(k, f, own_ms, wait_ms, init_ms)
        if not self.waits and not last:
            yield self.env.timeout(self.platform.hop_ms / 1e3)
            yield from self._visit(step + 1, met_cold)

    def _called(self, k: int, met_cold: list[bool]):
        """A called function's invocation: its caller waits for it (inside its own time)."""
        pool, f = self.pools[k], self.functions[k]
        x = pool.pick()
        if not x.ready.triggered:
            met_cold[0] = True
            yield x.ready
        with x.slots.request() as slot:
            yield slot
            start = self.env.now
            init_ms, x.fresh = (x.init_ms if x.fresh else 0.0), False
            yield from self.compute(x, f.service.draw(self.rng) * pool.factor)
            own_ms = (self.env.now - start) * 1e3
        pool.release(x)
        self._record(k, f, own_ms, 0.0, init_ms)

    def _record(self, k: int, f: SimFunction, own_ms: float, wait_ms: float, init_ms: float):
        self.own_ms[k].append(own_ms)
        self.invocations[k].append(
            Invocation(
                function=f.name,
                memory_mb=f.memory_mb,
                vcpus=self.platform.cpu_of(f.memory_mb, f.vcpus),
                own_ms=own_ms,
                wait_ms=wait_ms,
                init_ms=init_ms,
            )
        )
