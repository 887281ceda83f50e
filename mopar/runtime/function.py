"""One deployed function: a slice, what it receives, what it hands on. torch-free.

`SliceFunction` is what a server or a Lambda handler calls per request; what it receives, sends
and returns is its `mopar.bundle.function.FunctionSpec` (the ``function.json`` every function
folder carries; the compiler derives them from the plan graph, `mopar.emit.functions`).

A request travels the functions on the plan's path: the first receives the model inputs; each
one runs its slice and sends on a frame (`mopar.runtime.frame`) of the tensors that later
functions still read: its own outputs and, for skip connections, tensors it only carries. The
last one answers with the model outputs under their public names. Carried tensors are forwarded
byte for byte. A function may call others before it runs (the sub-slices of a sharded slice):
it sends each the tensors it reads and gathers their answers; those answer and go no further.
A dispatch function (a mixture-of-experts layer, `mopar.runtime.dispatch`) calls only the expert
functions its tokens were routed to, each with those tokens, adds their answers, and runs its
model (the rest of its layer) on that sum.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path

from mopar.bundle.function import FunctionSpec
from mopar.bundle.layout import HOT_DIR, WARM_DIR
from mopar.codec import PayloadError
from mopar.runtime import wire
from mopar.runtime.dispatch import (
    DispatchError,
    combine,
    expert_tensors,
    route,
    run_local,
    to_warm,
)
from mopar.runtime.frame import decode_payloads, join_frame, split_frame

__all__ = ["SliceFunction", "RequestError"]

Fork = Callable[[list[str], list[bytes]], list[bytes]]
"""(called functions' names, their incoming frames) -> their answers, in order."""


class RequestError(ValueError):
    """A request this function cannot serve, by the caller's fault (an HTTP 4xx)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class SliceFunction:
    """A slice ready to serve: its spec and its onnxruntime session.

    `process` is the whole per-request work of a function minus the handoff: validate the
    incoming frame against the spec, run the slice, and build the outgoing frame.
    """

    def __init__(self, function_dir: Path, *, intra_op_threads: int = 0) -> None:
        from mopar.runtime.handler import SliceHandler

        self.dir = Path(function_dir)
        self.spec = FunctionSpec.load(self.dir)
        self.handler = SliceHandler(self.dir, intra_op_threads=intra_op_threads)
        self._receives = {t.name: t for t in self.spec.receives}
        # a dispatch function's own (hot) experts, the next layer's router it predicts with,
        # and its requests counted for replicas' turns
        dispatch = self.spec.dispatch
        self.hot = (
            SliceHandler(self.dir / HOT_DIR, intra_op_threads=intra_op_threads)
            if dispatch is not None and dispatch.hot
            else None
        )
        self.predictor = (
            SliceHandler(self.dir / WARM_DIR, intra_op_threads=intra_op_threads)
            if dispatch is not None and dispatch.warm
            else None
        )
        self._requests = itertools.count()
        self._pool = None

    def check(self, data: bytes | memoryview) -> dict[str, memoryview]:
        """Split a frame and check it holds exactly the expected tensors, shapes and dtypes.

        Raises:
            RequestError: (400) naming the first problem, before anything is decoded.
        """
        try:
            payloads = split_frame(data)
        except PayloadError as exc:
            raise RequestError(f"malformed frame: {exc}") from None
        missing = [n for n in self._receives if n not in payloads]
        extra = [n for n in payloads if n not in self._receives]
        if missing or extra:
            raise RequestError(
                f"slice {self.spec.slice} expects tensors {list(self._receives)}; "
                f"missing {missing}, unexpected {extra}"
            )
        for name, payload in payloads.items():
            want = self._receives[name]
            try:
                dtype, shape, _ = wire.describe(payload)
            except PayloadError as exc:
                raise RequestError(f"tensor {name!r}: {exc}") from None
            if dtype.name != want.dtype or not want.fits(shape):
                rows = f" with up to {want.shape[0]} rows" if want.rows else ""
                raise RequestError(
                    f"tensor {name!r} is {dtype.name}{list(shape)}, expected "
                    f"{want.dtype}{list(want.shape)}{rows}"
                )
        tokens, gates, _ = expert_tensors(self.spec.slice)
        if tokens in payloads and gates in payloads:  # an expert function: one gate row a token
            n = [wire.describe(payloads[x])[1][0] for x in (tokens, gates)]
            if n[0] != n[1]:
                raise RequestError(
                    f"expert function {self.spec.slice} got {n[0]} tokens but "
                    f"{n[1]} rows of gates; send one row of gates per token"
                )
        return payloads

    def process(
        self,
        data: bytes | memoryview,
        fork: Fork | None = None,
        warm: Callable[[list[str]], None] | None = None,
    ) -> tuple[bytes, float]:
        """Run the slice on one incoming frame; return the outgoing frame and the compute ms.

        Args:
            fork: how to run the functions this one calls: given each one's name and incoming
                frame, it returns their answers (frames of their outputs) in the same order.
            warm: a dispatch's way to pre-warm functions: given the next layer's expert
                functions it predicts, it sends those it takes to be cold a warm-up.
        """
        payloads = self.check(data)
        if self.spec.dispatch is not None:
            return self._dispatch(payloads, fork, warm)
        if self.spec.calls:
            if fork is None:
                raise RuntimeError(
                    f"function {self.spec.slice} calls "
                    f"{[x.slice for x in self.spec.calls]} but was given no way "
                    "to reach them; set MOPAR_CALLS"
                )
            payloads.update(self._gather(payloads, fork))
        start = time.perf_counter()
        own = set(self.handler.inputs)
        try:
            inputs = decode_payloads({k: v for k, v in payloads.items() if k in own})
        except PayloadError as exc:
            raise RequestError(str(exc)) from None
        frame = self._outgoing(self.handler.handle(inputs), payloads)
        return frame, (time.perf_counter() - start) * 1e3

    def _outgoing(self, results: dict, payloads: dict[str, memoryview]) -> bytes:
        """The outgoing frame: the slice's results it sends, encoded, and the tensors it only
        carries, byte for byte; the last slice's under the model's public names."""
        out: dict[str, bytes | memoryview] = {}
        for name in self.spec.sends:
            if name in results:
                out[name] = wire.encode(results[name], self.spec.codecs.get(name, "none"))
            else:
                out[name] = payloads[name]
        if self.spec.last:
            out = {self.spec.returns.get(k, k): v for k, v in out.items()}
        return join_frame(out)

    def _dispatch(
        self,
        payloads: dict[str, memoryview],
        fork: Fork | None,
        warm: Callable[[list[str]], None] | None,
    ) -> tuple[bytes, float]:
        """Predict the next layer's expert functions and ``warm`` them; route the tokens, call
        the expert functions that received any while the hot experts run here, add all their
        answers, and run the rest of the layer."""
        spec = self.spec.dispatch
        start = time.perf_counter()
        own = set(self.handler.inputs)  # its tail's inputs, all decoded before any expert runs
        try:
            got = decode_payloads(
                {
                    k: v
                    for k, v in payloads.items()
                    if k in own or k in (spec.hidden, spec.index, spec.weights)
                }
            )
            calls = route(
                spec, got[spec.hidden], got[spec.index], got[spec.weights], next(self._requests)
            )
        except (PayloadError, DispatchError) as exc:
            raise RequestError(str(exc)) from None
        if warm is not None and self.predictor is not None:
            predicted = self.predictor.handle({spec.hidden: got[spec.hidden]})
            warm(to_warm(spec, predicted[self.predictor.output_names[0]]))
        remote = [c for c in calls if not c.local]
        hot = next((c for c in calls if c.local), None)
        if remote and fork is None:
            raise RuntimeError(
                f"function {self.spec.slice} calls expert functions but was given "
                "no way to reach them; set MOPAR_CALLS"
            )
        pending = None
        if hot is not None:  # in a thread of its own while the called functions work
            if remote and self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(max_workers=1)
            pending = self._pool.submit(run_local, self.hot, hot) if remote else None
        answers = {}
        if remote:
            frames = []
            for c in remote:
                tokens, gates, _ = expert_tensors(c.function)
                frames.append(
                    join_frame({tokens: wire.encode(c.tokens), gates: wire.encode(c.gates)})
                )
            for call, answer in zip(remote, fork([c.function for c in remote], frames)):
                try:
                    out = expert_tensors(call.function)[2]
                    answers[call.function] = decode_payloads(split_frame(answer))[out]
                except (PayloadError, KeyError) as exc:
                    raise RuntimeError(
                        f"expert function {call.function} answered a malformed frame ({exc})"
                    ) from None
        if hot is not None:
            answers[hot.function] = pending.result() if pending else run_local(self.hot, hot)
        try:
            combined = combine(
                spec, calls, [answers[c.function] for c in calls], got[spec.hidden].dtype
            )
        except DispatchError as exc:
            raise RuntimeError(str(exc)) from None
        results = self.handler.handle(
            {**{k: v for k, v in got.items() if k in own}, spec.output: combined}
        )
        return self._outgoing(results, payloads), (time.perf_counter() - start) * 1e3

    def _gather(self, payloads: dict[str, memoryview], fork: Fork) -> dict[str, memoryview]:
        """Scatter the inputs to the called functions and gather their outputs: the framing
        and the names are checked here, each tensor's header when it is decoded, its shape by
        the slice."""
        frames = [
            join_frame({t.name: payloads[t.name] for t in spec.receives})
            for spec in self.spec.calls
        ]
        gathered: dict[str, memoryview] = {}
        for spec, answer in zip(self.spec.calls, fork([s.slice for s in self.spec.calls], frames)):
            try:
                got = split_frame(answer)
            except PayloadError as exc:
                raise RuntimeError(
                    f"function {spec.slice} answered a malformed frame: {exc}"
                ) from None
            if set(got) != set(spec.sends):
                raise RuntimeError(
                    f"function {spec.slice} answered {sorted(got)}, expected {list(spec.sends)}"
                )
            gathered.update(got)
        return gathered
