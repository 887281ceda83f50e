"""The shm runner's session: one OS process per slice instance, tensors handed over through
/dev/shm (`mopar.runner.local.run_bundles` runs it).

The parent process is the coordinator: it writes each request's inputs into a per-run tmpfs
folder, announces to a slice over its stdin pipe when all of that slice's input tensors exist,
and learns over the slice's stdout pipe when its outputs have been written. Skip connections
need nothing special: a slice is dispatched when every tensor it reads exists, wherever it was
made.

Each request in flight holds a slot, and each (slot, value) pair has one reusable mapped buffer
(`mopar.runner.shmbuf`), so the folder holds at most slots x values files however many requests
run, and a handoff is one copy into a mapping that is already faulted in. A slot is reused only
after its request has finished, so no buffer is overwritten while a slice still reads it.

Each slice writes its outputs with the codecs the manifest gives them (`BundleSlice.codecs`);
every reader decodes whatever a file's header says, so the coordinator needs no table of them.

Load is a closed loop (``requests`` at ``concurrency``) or an open loop of Poisson arrivals
(``rate`` for ``duration_s``, `mopar.runner.load`). A function runs as one or more instances
(`mopar.runner.instances`): the session's autoscaler starts one when the others are busy, up to
``instances``, and stops those idle for ``idle_s``; every start is a cold start, timed. An
instance that dies fails only the requests it held: killed for memory (``enforce_memory``),
killed for holding a request past ``timeout_s``, or crashed.

A dispatch function (a mixture-of-experts layer) is dispatched like a slice; when it asks for
expert functions (a ``call`` event: those its tokens reached, their tokens and gates already in
their buffers), the coordinator sends each of them its request and, once all have answered,
resumes the dispatch. Expert functions no token reached get no message at all.

With ``cold_experts`` the expert functions start cold, as on a platform that scaled them to
zero: none runs before it is first needed, and all stop after each request. A call to a stopped
one starts it (a cold start, timed) and waits for it; a ``warm`` event from a dispatch -- the
next layer's expert functions it predicts -- starts the predicted ones that are stopped, so
their start overlaps the layers in between (``prewarm``). A request that finds the chain's entry
cold likewise starts the chain's other functions at once.
"""

from __future__ import annotations

import logging
import math
import selectors
import time
from pathlib import Path

import numpy as np

from mopar.config import RunConfig
from mopar.errors import RuntimeFailure
from mopar.runner.bundle import BundleManifest
from mopar.runner.chain import chain_mode_of
from mopar.runner.check import Comparison, compare_outputs
from mopar.runner.instances import Instance, MemoryGuard
from mopar.runner.load import GRACE_S, Drops, check_rate, load_summary, pct, poisson_arrivals
from mopar.runner.report import RunReport, Served, SliceStats
from mopar.runner.shmbuf import BufferPool
from mopar.runner.worker import peak_rss_mb
from mopar.runtime.chains import ChainMode, Span
from mopar.runtime.dispatch import expert_tensors

__all__ = ["ShmSession"]

log = logging.getLogger(__name__)

START_BUDGET_S = 60.0
"""Seconds an instance may take to start, at least (``timeout_s`` when that is longer)."""


class ShmSession:
    """One bundle's instances and the requests in flight through them, in one thread.

    Every function has a pool of instances (`mopar.runner.instances.Instance`). A request for a
    function goes to its least-loaded instance while that one has fewer than
    ``instance_concurrency`` in flight; otherwise a new instance is started (a cold start) while
    the pool is under ``instances``, and at the cap it waits at the least-loaded one. Instances
    idle for ``idle_s`` are stopped, down to none (scale to zero); an instance that dies --
    killed for memory, killed for not answering, or crashed -- fails the requests it held, and
    the next request starts another.
    """

    def __init__(
        self,
        manifest: BundleManifest,
        shm: Path,
        config: RunConfig,
        *,
        tag: int,
        mode: ChainMode | None = None,
    ) -> None:
        self.manifest = manifest
        self.mode = mode or chain_mode_of(manifest)
        self.tag = tag  # keeps file names of bundles sharing the folder apart
        self.shm = shm
        self.config = config
        self.selector = selectors.DefaultSelector()
        slices = manifest.slices
        self.pools: list[list[Instance]] = [[] for _ in slices]
        self.guard = MemoryGuard() if config.enforce_memory else None
        values = list(manifest.inputs) + [v for s in slices for v in (*s.inputs, *s.outputs)]
        self.index = {s.name: i for i, s in enumerate(slices)}
        self.value_index = {v: k for k, v in enumerate(dict.fromkeys(values))}
        # the chain's entry: the functions that read only model inputs
        self.entry = {
            i
            for i, s in enumerate(slices)
            if not s.called and all(v in manifest.inputs for v in s.inputs)
        }
        # a start (process, imports, session) may take longer than a request on a busy machine
        self._start_budget = max(config.timeout_s, START_BUDGET_S)
        self.cold_possible = config.cold_experts or config.start_cold or config.idle_s is not None
        self.prewarming = config.prewarm and self.cold_possible
        self.next_id = 0
        self.pool = BufferPool(shm)
        self.free_slots: list[int] = []
        self.slots = 0
        self.state: dict[int, dict] = {}  # requests in flight
        self.measuring = False
        self.lives: list[list[list[float]]] = [[] for _ in slices]  # [start, end] per instance
        self.warmed: set[Instance] = set()  # started ahead of need, not called yet
        self.warm_log: list[tuple[int, str]] = []  # (request, function) of each expert warm-up
        self.load_ms = [0.0] * len(slices)
        self.peak_rss = [0.0] * len(slices)
        self.reset()

    def reset(self) -> None:
        """Forget what was measured (a new load step)."""
        n = len(self.manifest.slices)
        self.slice_ms: list[list[float]] = [[] for _ in range(n)]
        self.start_ms: list[list[float]] = [[] for _ in range(n)]  # cold starts, spawn to ready
        self.oom_kills = [0] * n
        self.most = [len(p) for p in self.pools]  # instances at once
        self.latencies: list[float] = []
        self.records: list[tuple[float, float | None]] = []  # (arrival s, latency ms or None)
        self.errors: list[str] = []  # of measured requests
        self.drops = Drops()  # open loop: arrivals dropped at the in-flight cap
        self.warmup_errors: list[str] = []
        self.comparison = Comparison()
        self.window = [time.perf_counter(), time.perf_counter()]
        self.cold = {"cold_starts": 0, "prewarmed": 0, "prewarm_used": 0}
        self.first_ms: float | None = None
        self.served: list[Served] = []

    # -- instances ---------------------------------------------------------------------------

    def start(self, *, wait: bool = True) -> None:
        """Start one instance of every function that starts warm, and, with ``wait``, wait
        until all are ready (else `wait_started` does)."""
        for i, s in enumerate(self.manifest.slices):
            if not (self.config.start_cold or (self.config.cold_experts and s.called)):
                self._spawn(i)
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Wait until every instance started is ready."""
        while any(x.queue is not None for pool in self.pools for x in pool):
            self._step(starting=True)

    def stop(self) -> None:
        if self.guard is not None:
            self.guard.close()
        self.selector.close()
        for pool in self.pools:
            for x in pool:
                x.stop()
        self.pool.close()

    def _spawn(self, i: int, *, warm: bool = False) -> Instance:
        """Start an instance of function ``i``; requests sent to it wait until it is ready."""
        s = self.manifest.slices[i]
        x = Instance(
            i,
            self.manifest.function_dir(s),
            self.shm,
            self.config.intra_op_threads,
            s.dispatch,
            prewarm=self.prewarming,
        )
        self.pools[i].append(x)
        self.lives[i].append([x.spawned, math.inf])
        self.most[i] = max(self.most[i], len(self.pools[i]))
        self.selector.register(x.stdout_fd, selectors.EVENT_READ, x)
        if self.guard is not None:
            self.guard.watch(x, s.memory_mb)
        if warm:
            self.warmed.add(x)
            self.cold["prewarmed"] += self.measuring
        elif self.measuring:
            self.cold["cold_starts"] += 1
        x.counted = self.measuring  # its start is one of the measured cold starts
        return x

    def _ready(self, x: Instance, msg: dict) -> None:
        x.ready()
        self.load_ms[x.index] = msg["load_ms"]
        self.peak_rss[x.index] = max(self.peak_rss[x.index], msg["peak_rss_mb"])
        if x.counted:
            self.start_ms[x.index].append((x.ready_at - x.spawned) * 1e3)

    def _retire(self, x: Instance) -> None:
        """Stop an instance (scaled in, or scaled to zero)."""
        self.peak_rss[x.index] = max(self.peak_rss[x.index], peak_rss_mb(x.proc.pid))
        self._forget(x)
        x.stop()

    def _forget(self, x: Instance) -> None:
        x.alive = False
        self.selector.unregister(x.stdout_fd)
        self.pools[x.index].remove(x)
        self.warmed.discard(x)
        if self.guard is not None:
            self.guard.forget(x)
        for life in self.lives[x.index]:
            if life[1] == math.inf and life[0] == x.spawned:
                life[1] = time.perf_counter()

    def _instance_for(self, i: int) -> Instance:
        """The instance a request for function ``i`` goes to (the autoscaler's choice)."""
        pool = self.pools[i]
        # the least loaded; of equals, one that is ready before one still starting
        best = min(pool, key=lambda x: (x.load, x.queue is not None), default=None)
        if best is not None and best.load < self.config.instance_concurrency:
            return best
        if best is None or len(pool) < self.config.instances:
            return self._spawn(i)  # a cold start
        # at the cap: it waits its turn at a running instance rather than behind a start
        ready = [x for x in pool if x.queue is None]
        return min(ready, key=lambda x: x.load) if ready else best

    def _send(self, i: int, rid: int, st: dict, msg: dict) -> None:
        x = self._instance_for(i)
        if x in self.warmed:
            self.warmed.discard(x)
            self.cold["prewarm_used"] += self.measuring
        st["at"][i] = x
        st["pending"] += 1
        x.send(rid, msg)

    def _warm(self, rid: int, names: list[str]) -> None:
        """Start the predicted expert functions that have no instance, and only those."""
        if not self.prewarming:
            return
        for name in names:
            i = self.index[name]
            if not self.pools[i]:
                self._spawn(i, warm=True)
                self.warm_log.append((rid, name))

    def _warm_chain(self) -> None:
        """The chain's entry is cold: start every other function with no instance now, so that
        their starts overlap the entry's (pre-warm)."""
        for i, s in enumerate(self.manifest.slices):
            if not s.called and i not in self.entry and not self.pools[i]:
                self._spawn(i, warm=True)

    def _reap(self) -> None:
        """Scale in: stop instances idle for ``idle_s`` (down to none); with ``cold_experts``,
        stop every expert function once no request is in flight."""
        now = time.perf_counter()
        for i, pool in enumerate(self.pools):
            for x in list(pool):
                if x.inflight or x.held or x.queue is not None:
                    continue
                if (self.config.idle_s is not None and now - x.idle_since > self.config.idle_s) or (
                    self.config.cold_experts and self.manifest.slices[i].called and not self.state
                ):
                    self._retire(x)

    def _lost(self, x: Instance, *, starting: bool) -> None:
        """An instance died: fail what it held; an always-on function gets a new one."""
        i, s = x.index, self.manifest.slices[x.index]
        self._forget(x)
        if x.killed == "oom":
            self.oom_kills[i] += 1
            peak = math.ceil(x.peak_mb * 10) / 10  # rounded up: a page over reads as over
            why = (
                f"killed for memory: peak {peak:.1f} MB over its {s.memory_mb} MB "
                "allocation; recompile the bundle on this machine (compile sizes each "
                "function at its measured peak x 1.25) or run without --enforce-memory"
            )
        elif x.killed == "start":
            why = (
                f"its instance did not start within {self._start_budget:g} s, so it was "
                "killed; check the machine's load and the slice's size"
            )
        elif x.killed == "timeout":
            why = (
                f"no answer within {self.config.timeout_s:g} s, so its instance was killed; "
                "raise --timeout if the slice is that slow"
            )
        else:
            why = f"its instance {x.last_words()}"
        if starting:  # a function that cannot start fails the run
            raise RuntimeFailure(f"slice {s.name} {why.removeprefix('its instance ')}")
        for rid in list(x.inflight):
            st = self.state.get(rid)
            if st is None:
                continue
            self._fail(st, f"{s.name}: {why}")
            st["pending"] -= 1
            self._answered(rid, st, i)
            self._settle(rid, st)
        always_on = not (s.called and self.config.cold_experts) and self.config.idle_s is None
        if always_on and not self.pools[i]:
            self._spawn(i)

    # -- the loop ----------------------------------------------------------------------------

    def _step(self, *, wake_at: float | None = None, starting: bool = False) -> None:
        """Wait for events (until ``wake_at`` at most), handle them, enforce the timeout."""
        now = time.perf_counter()
        deadlines = [wake_at] if wake_at is not None else []
        for pool in self.pools:
            for x in pool:
                if x.queue is not None:  # starting
                    deadlines.append(x.spawned + self._start_budget)
                elif x.head_since is not None:
                    deadlines.append(x.head_since + self.config.timeout_s)
        if self.config.idle_s is not None:
            deadlines.append(now + min(self.config.idle_s, 0.25))
        timeout = max(0.0, min(deadlines) - now) if deadlines else None
        for key, _ in self.selector.select(timeout=timeout):
            x = key.data
            if not x.alive:  # stopped by an earlier event of this round
                continue
            for msg in x.read_events():
                self._handle(x, msg, starting=starting)
                if not x.alive:
                    break
        now = time.perf_counter()
        for pool in self.pools:
            for x in pool:
                if x.queue is not None:
                    if now - x.spawned > self._start_budget:
                        x.kill("start")
                elif x.head_since is not None and now - x.head_since > self.config.timeout_s:
                    x.kill("timeout")
        if not starting:
            self._reap()

    def _handle(self, x: Instance, msg: dict, *, starting: bool) -> None:
        event = msg["event"]
        if event == "exit":
            self._lost(x, starting=starting)
            return
        if event == "ready":
            self._ready(x, msg)
            return
        rid = msg.get("id")
        st = self.state.get(rid)
        if st is None:
            x.answered(rid)
            return
        if event == "call":  # a dispatch asks for its expert functions; it waits, not works
            x.head_since = None
            self._call(rid, st, x.index, msg["calls"])
            return
        if event == "warm":  # a dispatch predicts the next layer's
            self._warm(rid, msg["functions"])
            return
        s = self.manifest.slices[x.index]
        if event != "error" and self.mode.caller_waits and not s.called:
            x.hold(rid)  # it waits for the rest of the chain, busy, until the request ends
        else:
            x.answered(rid)
        init_ms = x.init_ms()
        if event == "error":
            self._fail(st, f"{s.name}: {msg['message']}")
        else:
            if st["measure"]:
                self.slice_ms[x.index].append(msg["ms"])
            st["spans"].append((s.name, msg["ms"], time.perf_counter(), init_ms, s.called))
            st["have"].update(s.outputs)
        st["pending"] -= 1
        self._answered(rid, st, x.index)
        if not st.get("failed"):
            self._dispatch(rid, st)
        self._settle(rid, st)

    def _fail(self, st: dict, message: str) -> None:
        if not st.get("failed"):  # one message per failed request
            (self.errors if st["measure"] else self.warmup_errors).append(message)
        st["failed"] = True

    def _settle(self, rid: int, st: dict) -> None:
        if st["pending"] == 0 and (st.get("failed") or self._complete(st)):
            self._finish(rid, st)

    # -- requests ----------------------------------------------------------------------------

    def _file(self, slot: int, value: str) -> str:
        return f"r{self.tag}x{slot}-v{self.value_index[value]}.t"

    def _take_slot(self) -> int:
        if not self.free_slots:
            self.free_slots.append(self.slots)
            self.slots += 1
        return self.free_slots.pop()

    def serve(self, inputs, *, requests, concurrency, expected, measure) -> None:
        """A closed loop: ``requests`` requests, ``concurrency`` in flight at once."""
        self.measuring = measure
        if measure and not self.records:
            self.window[0] = time.perf_counter()
        started = 0
        while started < requests or self.state:
            while started < requests and len(self.state) < concurrency:
                self._begin(inputs, time.perf_counter(), expected, measure)
                started += 1
            if self.state:
                self._step()
        self.window[1] = time.perf_counter()

    def serve_open(
        self, inputs, *, rate: float, duration_s: float, expected, seed: int = 0
    ) -> None:
        """An open loop: Poisson arrivals at ``rate`` per second for ``duration_s``; each
        request's latency counts from when it was due, not from when it could be sent, so a
        backlog shows in the figures (no coordinated omission). Arrivals while
        ``max_in_flight`` requests are in flight are dropped (throttled), counted as errors
        (`mopar.runner.load.Drops`). It ends `GRACE_S` after the last arrival at the latest;
        requests still in flight then fail.

        Raises:
            OptionError: ``rate`` is more than the runner can generate (`check_rate`).
        """
        check_rate(rate)
        self.measuring = True
        arrivals = poisson_arrivals(rate, duration_s, seed)
        t0 = self.window[0] = time.perf_counter()
        end = t0 + duration_s + GRACE_S
        due = t0 + next(arrivals, math.inf)
        while (due < math.inf or self.state) and time.perf_counter() < end:
            while due <= time.perf_counter():
                if len(self.state) >= self.config.max_in_flight:
                    self.drops.add(due - t0)
                else:
                    self._begin(inputs, due, expected, True)
                due = t0 + next(arrivals, math.inf)
            self._step(wake_at=min(due, end))
        for rid, st in list(self.state.items()):  # its workers may still write: slot kept
            self._fail(st, f"not answered within the open loop's {GRACE_S:g} s grace")
            self._finish(rid, st, reuse_slot=False)
        self.window[1] = time.perf_counter()

    def _begin(self, inputs: dict[str, np.ndarray], t0: float, expected, measure: bool) -> None:
        if self.prewarming and any(not self.pools[i] for i in self.entry):
            self._warm_chain()
        rid = self.next_id
        self.next_id += 1
        slot = self._take_slot()
        for name in self.manifest.inputs:
            self.pool.write(self._file(slot, name), inputs[name])
        st = {
            "t0": t0,
            "slot": slot,
            "have": set(self.manifest.inputs),
            "sent": set(),
            "pending": 0,
            "at": {},
            "measure": measure,
            "expected": expected,
            "spans": [],  # (function, own ms, done at, INIT ms, called) of each invocation
        }
        self.state[rid] = st
        self._dispatch(rid, st)

    def _call(self, rid: int, st: dict, caller: int, names: list[str]) -> None:
        """Run the expert functions a dispatch asked for; it is resumed when all have answered."""
        st.setdefault("waiting", {})[caller] = set(names)
        for name in names:
            i = self.index[name]
            self._send(i, rid, st, self._message(rid, st["slot"], i))

    def _answered(self, rid: int, st: dict, index: int) -> None:
        """An expert function answered: resume its dispatch once the last of its calls has."""
        for caller, names in st.get("waiting", {}).items():
            name = self.manifest.slices[index].name
            if name in names:
                names.discard(name)
                if not names:
                    x = st["at"][caller]
                    x.head_since = time.perf_counter()  # its own work again
                    x.post({"id": rid, "resume": True, "abort": bool(st.get("failed"))})
                return

    def _dispatch(self, rid: int, st: dict) -> None:
        for i, s in enumerate(self.manifest.slices):
            if s.called or i in st["sent"] or not all(v in st["have"] for v in s.inputs):
                continue
            st["sent"].add(i)
            slot = st["slot"]
            msg = self._message(rid, slot, i)
            if s.codecs:
                msg["codecs"] = dict(s.codecs)
            if s.dispatch is not None:
                msg["calls"] = {
                    c: {
                        k: self._file(slot, v)
                        for k, v in zip(("tokens", "gates", "out"), expert_tensors(c))
                    }
                    for c in s.dispatch.callees
                }
            self._send(i, rid, st, msg)

    def _message(self, rid: int, slot: int, i: int) -> dict:
        """What function ``i`` is sent to run request ``rid``: its input and output files."""
        s = self.manifest.slices[i]
        return {
            "id": rid,
            "inputs": {v: self._file(slot, v) for v in s.inputs},
            "outputs": {v: self._file(slot, v) for v in s.outputs},
        }

    def _complete(self, st: dict) -> bool:
        return all(value in st["have"] for _, value in self.manifest.outputs)

    def _finish(self, rid: int, st: dict, *, reuse_slot: bool = True) -> None:
        del self.state[rid]
        end = time.perf_counter()
        for x in st["at"].values():
            x.release(rid)
        ms = None
        if not st.get("failed"):
            got = {
                pub: self.pool.read(self._file(st["slot"], value))
                for pub, value in self.manifest.outputs
            }
            ms = (time.perf_counter() - st["t0"]) * 1e3
            if st["measure"]:
                self.latencies.append(ms)
                if self.first_ms is None and self.config.start_cold:
                    self.first_ms = ms
            if st["expected"] is not None:
                self.comparison = self.comparison.merge(
                    compare_outputs(got, st["expected"], self.config.tolerance)
                )
        if st["measure"]:
            self.records.append((st["t0"] - self.window[0], ms))
            self.served.append(
                Served(
                    arrival_s=st["t0"] - self.window[0],
                    latency_ms=ms,
                    invocations=self._spans(st, end),
                    answered_ms=tuple(
                        round((done - st["t0"]) * 1e3, 3) for _, _, done, _, _ in st["spans"]
                    ),
                )
            )
        if reuse_slot:
            self.free_slots.append(st["slot"])  # every slice of this request has answered

    def _spans(self, st: dict, end: float) -> tuple[Span, ...]:
        """A finished request's invocations: each one's own ms (its worker's), and, where the
        chain mode makes a caller wait, a function on the path waits from its answer to the
        request's end."""
        waits = self.mode.caller_waits
        return tuple(
            Span(
                function=name,
                own_ms=round(own, 3),
                wait_ms=round((end - done) * 1e3, 3) if waits and not called else 0.0,
                init_ms=round(init, 1),
            )
            for name, own, done, init, called in st["spans"]
        )

    # -- the report --------------------------------------------------------------------------

    def report(self, *, checked: bool) -> RunReport:
        for pool in self.pools:  # still running: their VmHWM covers every request
            for x in pool:
                self.peak_rss[x.index] = max(self.peak_rss[x.index], peak_rss_mb(x.proc.pid))
        lo, hi = self.window
        dropped = self.drops.messages(self.config.max_in_flight)
        slices = tuple(
            SliceStats(
                name=s.name,
                peak_rss_mb=round(self.peak_rss[i], 1),
                allocated_mb=s.memory_mb,
                p50_ms=pct(self.slice_ms[i], 50),
                p95_ms=pct(self.slice_ms[i], 95),
                load_ms=round(self.load_ms[i], 1),
                calls=len(self.slice_ms[i]),
                billed_ms=float(sum(math.ceil(ms) for ms in self.slice_ms[i])),
                cold_starts=len(self.start_ms[i]),
                cold_start_ms=pct(self.start_ms[i], 50),
                init_ms=round(sum(self.start_ms[i]), 1),
                instances=self.most[i],
                instance_s=round(
                    sum(max(0.0, min(end, hi) - max(start, lo)) for start, end in self.lives[i]), 3
                ),
                oom_kills=self.oom_kills[i],
                samples_ms=tuple(round(ms, 2) for ms in self.slice_ms[i]),
            )
            for i, s in enumerate(self.manifest.slices)
        )
        return RunReport(
            slices=slices,
            latency_p50_ms=pct(self.latencies, 50),
            latency_p95_ms=pct(self.latencies, 95),
            latency_p99_ms=pct(self.latencies, 99),
            requests=len(self.records) + self.drops.total,
            errors=len(self.errors) + self.drops.total,
            comparison=self.comparison if checked else None,
            tolerance=self.config.tolerance,
            error_messages=tuple((self.warmup_errors + dropped + self.errors)[:5]),
            chain=self.mode.name,
            served=tuple(self.served),
            cold=None
            if not self.cold_possible
            else {
                **self.cold,
                "start_ms_p50": pct([v for ms in self.start_ms for v in ms], 50),
                "first_request_ms": None if self.first_ms is None else round(self.first_ms, 3),
            },
            load=None
            if self.config.rate is None
            else load_summary(self.records, self.config, hi - lo, drops=self.drops),
        )
