"""The simulator against ``mopar run``: the same bundles, traffic and keep-alive, on this machine.

``python -m benchmarks.sim_validate BUNDLE [BUNDLE ...] --rates 1,4,8 --duration 30 --idle-s 2``

For each bundle, a profiling run first (an open loop at ``--profile-rate`` with another seed,
instances stopped after ``--idle-s``, so that cold starts are measured too) gives the simulator
its service times and starts: each warm call's time as the runner saw it (`occupancy`), which on
a busy machine holds the scheduler's delays that a function's own time leaves out. Each
function's start is the median the compared run measured (on a busy machine starts range over
an order of magnitude from one minute to the next), so the check is of the pools, queues,
keep-alive and bill, not of the INIT model.

Then, at each rate, ``mopar run``'s open loop (Poisson arrivals,
seed 0, at most ``--instances`` per function, one request each, stopped after ``--idle-s``, no
pre-warm) and the simulator with the same arrivals and pool rules, its instances sharing this
machine's cores (``host_cores``). Both are billed by `mopar.bill` for Lambda (chain ``invoke``)
and OpenFaaS (``http``), under the run's pool rules: it checks the simulator's mechanics, not the
platforms' rules. Prints a markdown table (and ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from mopar.bill import default_chain
from mopar.config import PROFILES_DIR, RunConfig
from mopar.facts import load_platform
from mopar.runner.bundle import read_manifest, read_reference
from mopar.runner.report import RunReport, SliceStats
from mopar.sim.bundle import simulate_bundle
from mopar.sim.engine import SimConfig
from mopar.sim.model import PoolRules
from mopar.sim.served import bill_run
from mopar.sim.traffic import Traffic

__all__ = ["Row", "validate", "markdown"]

TARGETS = ("lambda", "openfaas")


@dataclass(frozen=True, kw_only=True)
class Row:
    """One bundle at one rate, billed for one target: measured against simulated."""

    bundle: str
    target: str
    rate_rps: float
    requests: int
    run_usd_per_m: float | None
    sim_usd_per_m: float | None
    run_p95_ms: float | None
    sim_p95_ms: float | None
    run_cold_starts: int
    sim_cold_starts: int
    start_ms: float = 0.0  # the run's slowest median start, ms
    # the simulator timed by the compared run's own calls (`occupancy`): its mechanics alone
    replay_usd_per_m: float | None = None
    replay_p95_ms: float | None = None
    replay_cold_starts: int = 0

    def ratio(self, what: str, by: str = "sim") -> float | None:
        run, sim = getattr(self, f"run_{what}"), getattr(self, f"{by}_{what}")
        return None if not run or sim is None else sim / run


def validate(
    bundles: Sequence[Path],
    rates: Sequence[float],
    *,
    duration_s: float,
    idle_s: float,
    instances: int = 4,
    profile_rate: float = 2.0,
    tell: Callable[[str], None] = lambda _: None,
) -> list[Row]:
    """Run and simulate every bundle at every rate (see the module's docstring)."""
    from mopar.runner.local import run_bundles

    rules = PoolRules(
        keep_alive_s=idle_s,
        min_instances=0,
        max_instances=instances,
        concurrency=1,
        source=f"as mopar run --instances {instances} --idle-s {idle_s:g}",
    )
    rows = []
    for bundle in bundles:
        manifest = read_manifest(bundle)
        inputs, _ = read_reference(bundle / "reference.npz")

        def run(rate: float, seed: int, manifest=manifest, inputs=inputs):
            config = RunConfig(
                rate=rate,
                duration_s=duration_s,
                seed=seed,
                instances=instances,
                idle_s=idle_s,
                prewarm=False,
                timeout_s=120.0,
            )
            return run_bundles([manifest], inputs, config=config)[0]

        tell(f"{bundle.name}: profiling at {profile_rate:g} req/s")
        profile = occupancy(run(profile_rate, seed=99))
        for rate in rates:
            tell(f"{bundle.name}: mopar run at {rate:g} req/s")
            report = run(rate, seed=0)
            # starts took 0.3-9 s here as the machine's load came and went: the simulator takes
            # each function's median start from the run it is compared with
            starts = {
                s.name: replace(profile[s.name], cold_start_ms=s.cold_start_ms)
                for s in report.slices
                if s.cold_start_ms
            }
            for target in TARGETS:
                platform = load_platform(PROFILES_DIR, target)
                chain = default_chain(platform)
                bill = bill_run(report, manifest.document, platform, chain)
                config = SimConfig(rules=rules, chain=chain, host_cores=os.cpu_count() or 1)
                traffic = Traffic(rate=rate, duration_s=duration_s)
                sim, replay = (
                    simulate_bundle(manifest.document, platform, traffic, config, profile=times)
                    for times in ({**profile, **starts}, occupancy(report))
                )
                rows.append(
                    Row(
                        bundle=bundle.name,
                        target=target,
                        rate_rps=rate,
                        requests=bill.requests,
                        run_usd_per_m=bill.cost_per_1m_usd,
                        sim_usd_per_m=sim.cost_per_1m_usd,
                        run_p95_ms=report.latency_p95_ms,
                        sim_p95_ms=sim.p95_ms,
                        run_cold_starts=sum(s.cold_starts for s in report.slices),
                        start_ms=max((s.cold_start_ms or 0 for s in report.slices), default=0),
                        sim_cold_starts=sum(f.cold_starts for f in sim.functions),
                        replay_usd_per_m=replay.cost_per_1m_usd,
                        replay_p95_ms=replay.p95_ms,
                        replay_cold_starts=sum(f.cold_starts for f in replay.functions),
                    )
                )
    return rows


def markdown(rows: Sequence[Row]) -> str:
    """The table for docs/simulate.md."""

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = [
        "| bundle | target | req/s | served | $/1M run | sim/run | replay/run | p95 run ms "
        "| sim/run | replay/run | cold starts run / sim / replay | start ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.bundle} | {r.target} | {r.rate_rps:g} | {r.requests} "
            f"| {num(r.run_usd_per_m, '.4g')} | {num(r.ratio('usd_per_m'), '.2f')} "
            f"| {num(r.ratio('usd_per_m', 'replay'), '.2f')} | {num(r.run_p95_ms, '.1f')} "
            f"| {num(r.ratio('p95_ms'), '.2f')} | {num(r.ratio('p95_ms', 'replay'), '.2f')} "
            f"| {r.run_cold_starts} / {r.sim_cold_starts} / {r.replay_cold_starts} "
            f"| {r.start_ms:.0f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sim_validate", description=__doc__)
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--rates", default="1,4,8", help="comma-separated req/s")
    parser.add_argument("--duration", type=float, default=30.0, help="s of arrivals per run")
    parser.add_argument("--idle-s", type=float, default=2.0, help="keep-alive, s")
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--profile-rate", type=float, default=2.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = validate(
        args.bundles,
        [float(r) for r in args.rates.split(",")],
        duration_s=args.duration,
        idle_s=args.idle_s,
        instances=args.instances,
        profile_rate=args.profile_rate,
        tell=lambda line: print(line, file=sys.stderr, flush=True),
    )
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        print(markdown(rows))
    return 0


def occupancy(report: RunReport) -> dict[str, SliceStats]:
    """A run's slices with, as their samples, each warm call's time as the runner saw it: from
    the answer of the function before it on the path (the request's arrival for the first) to its
    own. On a busy machine a function's own time leaves out what its instance is really held for
    (the scheduler's delays of its process and of the runner's); this puts them back, so that the
    simulator's instances are busy as long as the run's were. Calls that met a start are left out.
    """
    index = {s.name: k for k, s in enumerate(report.slices)}
    seen: list[list[float]] = [[] for _ in report.slices]
    for request in report.served:
        if request.latency_ms is None:
            continue
        before = 0.0
        for done, span in sorted(zip(request.answered_ms, request.invocations)):
            if span.init_ms == 0:
                seen[index[span.function]].append(round(max(done - before, 0.0), 3))
            before = done
    return {
        s.name: replace(s, samples_ms=tuple(seen[k]) or s.samples_ms)
        for k, s in enumerate(report.slices)
    }


if __name__ == "__main__":
    sys.exit(main())
