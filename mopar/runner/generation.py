"""Generate text with a ``--generate`` bundle on this machine: its main function served as it
is deployed, requests sent to it, their tokens and times back.

`Generation` starts the main function (`mopar.runtime.generate.MainFunction`) and the expert
functions it calls, each as its own function server process on 127.0.0.1, and sends the main
function a JSON request (what an OpenFaaS or Lambda URL client sends); or runs them all inside
this process (``inprocess``: the same cores and loop, no server). Each request's answer is its
tokens, its time to the first token and each later token's time, as the main function measured
them, and how well its dispatches foresaw the next layer's experts; `summary` gives the figures
a run reports; `time_generation` times one generation as compile writes it into plan.json.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mopar.bundle.generation import GenerationSpec, GenerationTiming
from mopar.bundle.layout import FUNCTIONS_DIR
from mopar.errors import BundleError, RuntimeFailure
from mopar.runner.bundle import BundleManifest
from mopar.runner.gateway import SERVER_CMD, ColdGateway, GatewayCounts
from mopar.runner.local import shm_root
from mopar.runner.processes import ServerProcess, listening_socket
from mopar.runner.worker import peak_rss_mb
from mopar.runtime.core import RequestError
from mopar.runtime.framed import Fork
from mopar.runtime.generate import Generated, GenerateRequest
from mopar.runtime.transports import HopError, HttpClient

__all__ = [
    "Generation",
    "GenerationSummary",
    "summary",
    "generation_of",
    "generation_figures",
    "time_generation",
    "in_process",
    "TIMED_TOKENS",
]

TIMED_TOKENS = 32
"""The tokens compile generates to time a generation (fewer where the sequence has less room)."""


def generation_of(manifest: BundleManifest) -> GenerationSpec:
    """The bundle's generation section.

    Raises:
        BundleError: the bundle was compiled without ``--generate``.
    """
    spec = manifest.document.generation
    if spec is None:
        raise BundleError(
            f"bundle {str(manifest.root)!r} serves one forward pass, not text generation; "
            "compile the model with mopar compile MODEL --generate (or run this one with "
            "mopar run)"
        )
    return spec


class Generation:
    """The main function of ``manifest`` and the expert functions it calls, started; `run`
    serves one request. ``transport``: the main function calls its expert functions through
    /dev/shm (``shm``, co-located, as OpenFaaS's shm chain mode) or over HTTP (``http``); or
    everything runs in this process (``inprocess``).

    With ``cold_experts`` the expert functions start scaled to zero behind a gateway
    (`mopar.runner.gateway.ColdGateway`): each starts when a call or the main function's
    warm-up reaches it (``prewarm``: warm-ups start them), and stops once idle for ``idle_s``
    (None: never), which the main function's `Warmer` is told as their keep-alive.

    Raises:
        RuntimeFailure: a function did not start (its last line of stderr).
    """

    def __init__(
        self,
        spec: GenerationSpec,
        folders: Mapping[str, Path],
        *,
        transport: str = "http",
        timeout_s: float = 120.0,
        cold_experts: bool = False,
        idle_s: float | None = None,
        prewarm: bool = True,
    ) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self._servers: list[ServerProcess] = []
        self._server: ServerProcess | None = None
        self._local = None
        self._shm: Path | None = None
        self.gateway: ColdGateway | None = None
        if transport == "inprocess":
            self._local = in_process(dict(folders), self.spec)
            return
        handoff = {"MOPAR_TRANSPORT": transport}
        if transport == "shm":  # a folder of its own, removed at close
            self._shm = Path(tempfile.mkdtemp(prefix="mopar-generate-", dir=shm_root()))
            handoff["MOPAR_SHM_DIR"] = str(self._shm)
        try:  # the expert functions first: the main function is told their URLs
            if cold_experts:
                self.gateway = ColdGateway(
                    {n: folders[n] for n in self.spec.callees},
                    self._env(**handoff),
                    idle_s=idle_s,
                    prewarm=prewarm,
                    timeout_s=timeout_s,
                )
                urls = [self.gateway.url(n) for n in self.spec.callees]
                if idle_s is not None:
                    handoff["MOPAR_WARM_KEEP_S"] = str(idle_s)
            else:
                urls = [self._start(n, folders[n], **handoff).url for n in self.spec.callees]
            self._server = self._start(
                self.spec.function,
                folders[self.spec.function],
                MOPAR_CALLS=",".join(urls),
                **handoff,
            )
        except BaseException:
            self.close()
            raise

    def _env(self, **more: str) -> dict[str, str]:
        return {
            **os.environ,
            "MOPAR_HOST": "127.0.0.1",
            "MOPAR_NEXT": "",
            "MOPAR_CALLS": "",
            "PYTHONUNBUFFERED": "1",
            "MOPAR_TIMEOUT_S": str(self.timeout_s),
            **more,
        }

    def _start(self, name: str, folder, **more: str) -> ServerProcess:
        env = self._env(MOPAR_FUNCTION_DIR=str(folder), **more)
        server = ServerProcess(list(SERVER_CMD), env, name, self.timeout_s, sock=listening_socket())
        self._servers.append(server)
        return server

    @classmethod
    def of(cls, manifest: BundleManifest, **options) -> Generation:
        """The generation of a bundle on disk (``options``: as the constructor's).

        Raises:
            BundleError: the bundle has no generation section.
        """
        folders = {s.name: manifest.function_dir(s) for s in manifest.slices}
        return cls(generation_of(manifest), folders, **options)

    @property
    def main_pid(self) -> int | None:
        """The main function server's process id (None: in process)."""
        return self._server.proc.pid if self._server is not None else None

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.gateway is not None:
            self.gateway.close()
        for server in self._servers:
            server.terminate()
        for server in self._servers:
            server.stop()
        self._servers, self._server = [], None
        if self._shm is not None:
            shutil.rmtree(self._shm, ignore_errors=True)
            self._shm = None

    def run(self, request: GenerateRequest | dict) -> tuple[Generated, float]:
        """Serve ``request`` (or a request's JSON body, such as one with ``"text"``); its answer
        and the wall time the client waited, s.

        Raises:
            RuntimeFailure: the function refused the request or failed (its message).
        """
        data = request.to_dict() if isinstance(request, GenerateRequest) else dict(request)
        start = time.perf_counter()
        if self._local is not None:
            try:
                return self._local.answer(data), time.perf_counter() - start
            except RequestError as exc:  # as the server answers it: 4xx, one line
                raise RuntimeFailure(f"the main function refused the request: {exc}") from None
        client = HttpClient(self._server.url + "generate", timeout_s=self.timeout_s, retries=0)
        try:
            answer = client.post(json.dumps(data).encode(), {"Content-Type": "application/json"})
        except HopError as exc:
            raise RuntimeFailure(
                f"the main function did not answer in {self.timeout_s:g} s ({exc}); "
                "raise --timeout-s"
            ) from None
        if answer.status != 200:
            raise RuntimeFailure(f"the main function refused the request: {answer.error()}")
        return Generated.from_dict(answer.json()), time.perf_counter() - start


@dataclass(frozen=True, kw_only=True)
class GenerationSummary:
    """A run's figures: requests, tokens, time to first token (p50), per-token latency (p50
    and p95, over every later token) and tokens per second (generated tokens over the requests'
    wall time); for a mixture of experts with expert functions, how well its dispatches
    predicted the next layer's expert functions (`mopar.runtime.generate.Foresight`): precision
    and recall over every step, and per step (the first, the prompt's, then each token's),
    pooled over the requests (None where nothing was predicted or called). Where the expert
    functions started cold (`Generation`'s ``cold_experts``): ``warm_steps``, the share of
    steps whose every expert call found its function ready (kept warm, or pre-warmed in time),
    the calls that waited for a start, the p50 of what a step that waited lost, and what the
    gateway saw (`GatewayCounts`)."""

    requests: int
    tokens: int
    first_token_p50_ms: float
    token_p50_ms: float | None
    token_p95_ms: float | None
    tokens_per_s: float
    precision: float | None = None
    recall: float | None = None
    by_step: tuple[tuple[float | None, float | None], ...] = ()
    warm_steps: float | None = None
    cold_calls: int = 0
    cold_wait_p50_ms: float | None = None
    gateway: GatewayCounts | None = None

    def to_dict(self) -> dict:
        return {
            "requests": self.requests,
            "new_tokens": self.tokens,
            "first_token_p50_ms": round(self.first_token_p50_ms, 3),
            "token_p50_ms": None if self.token_p50_ms is None else round(self.token_p50_ms, 3),
            "token_p95_ms": None if self.token_p95_ms is None else round(self.token_p95_ms, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            **(
                {
                    "prewarm_precision": _round(self.precision),
                    "prewarm_recall": _round(self.recall),
                    "prewarm_by_step": [[_round(p), _round(r)] for p, r in self.by_step],
                }
                if self.by_step
                else {}
            ),
            **(
                {
                    "warm_steps": _round(self.warm_steps),
                    "cold_calls": self.cold_calls,
                    "cold_wait_p50_ms": _round(self.cold_wait_p50_ms),
                    "gateway": self.gateway.to_dict(),
                }
                if self.gateway is not None
                else {}
            ),
        }

    def describe(self) -> str:
        """One line: requests and tokens, first token, per token, tokens per second."""
        token = (
            f"per token p50 {self.token_p50_ms:.2f} ms, p95 {self.token_p95_ms:.2f} ms"
            if self.token_p50_ms is not None
            else "no later tokens"
        )
        foresight = (
            f"; next layer's experts predicted with precision {_share(self.precision)}, recall "
            f"{_share(self.recall)}"
            if self.by_step
            else ""
        )
        cold = (
            f"; {_share(self.warm_steps)} of steps found their expert functions warm "
            f"({self.gateway.prewarmed} calls pre-warmed in time, {self.gateway.late} late, "
            f"{self.gateway.cold} cold)"
            if self.gateway is not None
            else ""
        )
        return (
            f"{self.requests} requests, {self.tokens} tokens; first token p50 "
            f"{self.first_token_p50_ms:.2f} ms, {token}, {self.tokens_per_s:.1f} tokens/s"
            f"{foresight}{cold}"
        )


def generation_figures(
    manifest: BundleManifest,
    inputs: dict[str, np.ndarray],
    max_new_tokens: int,
    requests: int,
    timeout_s: float,
    *,
    transport: str = "http",
) -> GenerationSummary:
    """``requests`` greedy generations of up to ``max_new_tokens`` (fewer where the sequence
    has less room) after the prompt of ``inputs`` (a step's reference: its token ids), served by
    the main function, one after another (``transport``: as `Generation`)."""
    spec = generation_of(manifest)
    prompt = [int(t) for t in np.asarray(inputs[spec.input_ids]).reshape(-1)]
    room = max(1, spec.max_seq_len - len(prompt))
    request = GenerateRequest(input_ids=tuple(prompt), max_new_tokens=min(max_new_tokens, room))
    with Generation.of(manifest, transport=transport, timeout_s=timeout_s) as generation:
        return summary([generation.run(request) for _ in range(requests)])


def in_process(folders: dict[str, Path], spec: GenerationSpec):
    """The main function of ``spec`` with its expert functions, all loaded in this process
    from ``folders`` (by name): a `mopar.runtime.generate.MainFunction`."""
    from mopar.runtime.framed import SliceFunction
    from mopar.runtime.generate import MainFunction

    fork = local_fork(folders) if spec.callees else None
    return MainFunction.of(SliceFunction(folders[spec.function]), fork)


def local_fork(folders: dict[str, Path]) -> Fork:
    """A main function's way to its expert functions in this process: each loaded from its
    folder (of ``folders``, by name) when first called, and sent its frame."""
    from mopar.runtime.framed import SliceFunction

    loaded: dict[str, SliceFunction] = {}

    def fork(names: list[str], frames: list[bytes]) -> list[bytes]:
        out = []
        for name, frame in zip(names, frames):
            if name not in loaded:
                loaded[name] = SliceFunction(folders[name])
            out.append(loaded[name].process(frame)[0])
        return out

    return fork


def time_generation(
    root: Path, spec: GenerationSpec, prompt: np.ndarray, *, margin: float, timeout_s: float = 120.0
) -> GenerationTiming:
    """One greedy generation of up to `TIMED_TOKENS` after ``prompt``, by the main function of
    the bundle being written at ``root`` (its ``function.json`` written), in this process, after
    one untimed generation of 2 tokens (onnxruntime's first runs allocate). Where the main
    function runs several units, the same generation again with the main function served in a
    process of its own, calling its expert functions over HTTP, as deployed: its peak RSS, and
    that peak x (1 + ``margin``), the need its deployed size covers."""
    folders = {name: root / FUNCTIONS_DIR / name for name in (*spec.units, *spec.callees)}
    main = in_process(folders, spec)
    ids = [int(t) for t in np.asarray(prompt).reshape(-1)]
    new = max(2, min(TIMED_TOKENS, spec.max_seq_len - len(ids)))
    main.answer({"input_ids": ids, "max_new_tokens": 2})
    done = main.answer({"input_ids": ids, "max_new_tokens": new})
    later = [s * 1e3 for s in done.token_s] or [done.first_token_s * 1e3]
    peak = None
    if len(spec.units) > 1:
        with Generation(spec, folders, timeout_s=timeout_s) as served:
            served.run({"input_ids": ids, "max_new_tokens": new})
            peak = peak_rss_mb(served.main_pid)
    return GenerationTiming(
        prompt_tokens=len(ids),
        new_tokens=len(done.tokens),
        first_token_ms=done.first_token_s * 1e3,
        token_p50_ms=float(np.percentile(later, 50)),
        token_p95_ms=float(np.percentile(later, 95)),
        main_peak_rss_mb=peak,
        main_need_mb=None if peak is None else peak * (1 + margin),
    )


def summary(
    answers: Sequence[tuple[Generated, float]], gateway: GatewayCounts | None = None
) -> GenerationSummary:
    """The figures of ``answers`` (each a `Generated` and the client's wall time, s); with
    ``gateway``, those of expert functions that started cold."""
    later = [s * 1e3 for g, _ in answers for s in g.token_s]
    tokens = sum(len(g.tokens) for g, _ in answers)
    wall = sum(w for _, w in answers)
    steps = max((len(g.foresight) for g, _ in answers), default=0)
    per_step = [
        np.sum([g.foresight[k] for g, _ in answers if k < len(g.foresight)], axis=0)
        for k in range(steps)
    ]
    total = np.sum(per_step, axis=0) if per_step else np.zeros(3)
    cold = [step for g, _ in answers for step in g.cold]
    waits = [ms for n, ms in cold if n]
    return GenerationSummary(
        requests=len(answers),
        tokens=tokens,
        first_token_p50_ms=float(np.median([g.first_token_s * 1e3 for g, _ in answers])),
        token_p50_ms=float(np.percentile(later, 50)) if later else None,
        token_p95_ms=float(np.percentile(later, 95)) if later else None,
        tokens_per_s=tokens / wall if wall > 0 else 0.0,
        precision=_ratio(total[0], total[1]),
        recall=_ratio(total[0], total[2]),
        by_step=tuple((_ratio(h, p), _ratio(h, c)) for h, p, c in per_step),
        warm_steps=_ratio(len(cold) - len(waits), len(cold)) if gateway is not None else None,
        cold_calls=sum(n for n, _ in cold),
        cold_wait_p50_ms=float(np.median(waits)) if waits else None,
        gateway=gateway,
    )


def _ratio(part: float, whole: float) -> float | None:
    return float(part / whole) if whole else None


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"
