"""Run a bundle locally: every function as an OS process, under load, measured.

Read in this order: `run_bundles` (one bundle, or several side by side, their requests
interleaved), `max_rate`. By transport, a run's sessions are `mopar.runner.shm_session`'s
(tensors handed over through /dev/shm, the default), `mopar.runner.chain`'s (the real function
servers or Lambda handlers, chained on 127.0.0.1), `mopar.runner.stepwise`'s (one function at a
time, as compile measures a large model), or a caller's (`mopar.container.session`).

The per-run folder is removed on every exit path: success, a failing slice, a timeout, Ctrl-C;
that of a run killed with SIGKILL, by the next run (`run_folder`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from mopar._files import owned_folder, sweep_leftovers
from mopar.config import RunConfig
from mopar.errors import RuntimeFailure
from mopar.runner.bundle import BundleManifest
from mopar.runner.chain import AS_PLANNED, ChainSession, chain_mode_of
from mopar.runner.load import RateStep, find_max_rate
from mopar.runner.processes import local_redis
from mopar.runner.report import RunReport
from mopar.runner.shm_session import ShmSession
from mopar.runner.shmbuf import no_room
from mopar.runner.stepwise import InTurnSession
from mopar.runtime.transports import inline, transport_named

__all__ = ["run_bundles", "max_rate", "run_folder", "shm_root"]

log = logging.getLogger(__name__)

MIN_ARRIVALS = 20
"""Arrivals a step of `max_rate` expects at least: a short step at a low rate is lengthened."""


RUN_PREFIX = "mopar-run-"
"""The name of a run's handoff folder in `shm_root`: ``mopar-run-<pid>-<random>``."""


@contextlib.contextmanager
def run_folder() -> Iterator[Path]:
    """A run's handoff folder in `shm_root`, gone when the run ends. The folders of runs whose
    process was killed (SIGKILL leaves no chance to clean up) are removed first
    (`mopar._files.sweep_leftovers`: only folders a run made, of a process that is gone)."""
    root = shm_root()
    sweep_leftovers(root, RUN_PREFIX)
    with contextlib.ExitStack() as stack:
        try:
            folder = stack.enter_context(owned_folder(root, RUN_PREFIX))
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            raise no_room(root / f"{RUN_PREFIX}{os.getpid()}-*", "the run's folder") from None
        yield folder.path


def shm_root() -> Path:
    """The tmpfs folder for handoff: /dev/shm when it exists, else the temp dir (logged)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    log.warning("/dev/shm is not available; handing tensors over through %s", tempfile.gettempdir())
    return Path(tempfile.gettempdir())


def run_bundles(
    manifests: list[BundleManifest],
    inputs: dict[str, np.ndarray],
    *,
    config: RunConfig,
    expected: dict[str, np.ndarray] | None = None,
    on_request: Callable[[int], None] | None = None,
    transport: str | Sequence[str] = "shm",
    redis_url: str = "",
    session_for: Callable | None = None,
    settle: int = 0,
) -> list[RunReport]:
    """Run several bundles of one model side by side, interleaving their requests (A B A B ...).

    All bundles' processes are up at once, and each round serves ``config.concurrency`` requests
    on every bundle in turn, so that machine drift does not favour one of them.

    Args:
        transport: a colocated transport (``shm``) runs the slices as pipe-driven workers
            handing over through /dev/shm; the others (``http``, ``redis``) run each slice's
            real function server on 127.0.0.1 and chain them (`mopar.runner.chain`);
            `mopar.runner.chain.AS_PLANNED` runs each function as it deploys: its target's
            process (the function server, or the Lambda handler behind
            `mopar.targets.aws_lambda.emulate.LambdaHost`) handing on by the plan's transports. One per
            manifest, or one for all.
        redis_url: the Redis for ``redis``; empty starts a private redis-server for the run.
        session_for: ``(manifest, index, redis_url) -> session``: serve each bundle in a
            session of the caller's (`mopar.container.session.ContainerSession`), not by
            ``transport``.
        settle: after the measured requests, serve each bundle this many more, not measured
            (their peaks count, their times do not), so that a peak that creeps up over the
            first requests reaches its level (compile's sizing).
    """
    for manifest in manifests:
        manifest.check_inputs(inputs)
    transports = [transport] * len(manifests) if isinstance(transport, str) else list(transport)
    modes = [chain_mode_of(m) for m in manifests]
    with contextlib.ExitStack() as stack:
        if config.redis_stand_in and any(m.rendezvous == "redis" for m in modes):
            raise RuntimeFailure(
                "the event chain mode leaves each answer in Redis, and redis-server is not on "
                "PATH; install it (apt-get install redis-server) or compile with --chain invoke"
            )
        redis = any(transport_named(t).needs_redis for t in transports if t != AS_PLANNED) or any(
            m.rendezvous == "redis" for m in modes
        )
        if redis and not redis_url and session_for is None:
            redis_url = stack.enter_context(local_redis())
        shm = stack.enter_context(run_folder())
        sessions = []
        for i, (m, kind, mode) in enumerate(zip(manifests, transports, modes, strict=True)):
            colocated = kind != AS_PLANNED and transport_named(kind).colocated
            if session_for is not None:
                sessions.append(session_for(m, i, redis_url))
            elif kind == AS_PLANNED and config.in_turn:
                sessions.append(InTurnSession(m, config, redis_url=redis_url, shm_dir=str(shm)))
            elif colocated and not mode.rendezvous:
                sessions.append(ShmSession(m, shm, config, tag=i, mode=mode))
            else:  # real functions: as planned (each as it deploys), or an asynchronous chain
                sessions.append(
                    ChainSession(
                        m,
                        config,
                        transport=inline().name if colocated else kind,
                        redis_url=redis_url,
                        shm_dir=str(shm),
                        mode=mode,
                        lambda_handlers=kind == AS_PLANNED,
                    )
                )
        return _interleave(sessions, inputs, config, expected, on_request, settle)


def _interleave(
    sessions, inputs, config: RunConfig, expected, on_request, settle: int = 0
) -> list[RunReport]:
    try:
        for session in sessions:  # all bundles' processes start at once
            session.start(wait=False)
        for session in sessions:
            session.wait_started()
        if not config.start_cold:
            for session in sessions:  # warm-up: one request each, not measured
                session.serve(inputs, requests=1, concurrency=1, expected=expected, measure=False)
        if config.rate is not None:  # open loop: one bundle after the other
            for k, session in enumerate(sessions):
                session.serve_open(
                    inputs,
                    rate=config.rate,
                    duration_s=config.duration_s,
                    expected=expected,
                    seed=config.seed,
                )
                if on_request is not None:
                    on_request(k + 1)
            return [s.report(checked=expected is not None) for s in sessions]
        done = 0
        while done < config.requests:
            batch = min(config.concurrency, config.requests - done)
            for session in sessions:
                session.serve(
                    inputs, requests=batch, concurrency=batch, expected=expected, measure=True
                )
            done += batch
            if on_request is not None:
                on_request(done)
        for session in sessions if settle > 0 else ():
            session.serve(inputs, requests=settle, concurrency=1, expected=expected, measure=False)
        return [s.report(checked=expected is not None) for s in sessions]
    finally:
        for session in sessions:
            session.stop()


def max_rate(
    manifest: BundleManifest,
    inputs: dict[str, np.ndarray],
    *,
    config: RunConfig,
    slo_ms: float,
    expected: dict[str, np.ndarray] | None = None,
    on_step: Callable[[float, RunReport], None] | None = None,
    session=None,
) -> tuple[float | None, list[RateStep], RunReport | None]:
    """The highest open-loop rate whose p95 stays within ``slo_ms`` with no failed request.

    One session serves every step (its instances stay up between steps), each ``duration_s``
    long (up to 5 x longer at a rate too low for `MIN_ARRIVALS` arrivals), starting at
    ``config.rate`` (`mopar.runner.load.find_max_rate`).

    Returns:
        The best rate (None: not even the first), every step, and the best step's report.

    Args:
        session: what serves the steps (default: the shm runner's workers).
    """
    manifest.check_inputs(inputs)
    folder = contextlib.ExitStack()
    session = session or ShmSession(manifest, folder.enter_context(run_folder()), config, tag=0)
    reports: dict[float, RunReport] = {}

    def measure(rate: float) -> tuple[float | None, int]:
        session.reset()
        # long enough for MIN_ARRIVALS arrivals on average (a p95 of a handful means little),
        # but at most 5 x --duration: bisecting towards zero must not take forever
        duration = min(max(config.duration_s, MIN_ARRIVALS / rate), 5 * config.duration_s)
        session.config = replace(config, rate=rate, duration_s=duration)
        session.serve_open(
            inputs,
            rate=rate,
            duration_s=session.config.duration_s,
            expected=expected,
            seed=config.seed,
        )
        report = reports[round(rate, 3)] = session.report(checked=expected is not None)
        if on_step is not None:
            on_step(rate, report)
        return report.latency_p95_ms, report.errors

    try:
        session.start()
        session.serve(inputs, requests=1, concurrency=1, expected=expected, measure=False)
        best, steps = find_max_rate(measure, slo_ms=slo_ms, start=config.rate or 1.0)
        return best, steps, reports.get(best) if best is not None else None
    finally:
        session.stop()
        folder.close()
