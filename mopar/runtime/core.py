"""One function's work, whatever door a request comes in by. torch-free.

Read in this order: `Door` (the I/O one request brings), then `FunctionCore.run`.

A function is reached through one of three doors: the local runner's shm buffers and pipes
(`mopar.runner.worker`), an HTTP frame (`mopar.runtime.server`, through
`mopar.runtime.framed.SliceFunction`) or a Lambda event (`mopar.runtime.aws`, the same). Its work
is the same behind each, and is done here once:

1. receive: check what arrived against what the function receives (`FunctionCore.check`);
2. gather: a sharded slice's join calls its parts, each with the tensors it reads, and takes
   their outputs;
3. decode the slice's inputs and run the slice (onnxruntime, `mopar.runtime.handler`);
4. or, for a dispatch function (a mixture-of-experts layer, `mopar.runtime.dispatch`): route its
   tokens, name the next layer's expert functions to pre-warm, call the expert functions the
   tokens reached while its hot experts run here, add all their answers, and run the rest of
   the layer on the sum;
5. encode and send its outputs.

A `Door` says only where the tensors come from and go (shm buffers, frames), how a callee is
invoked (the runner's pipes, HTTP, a Lambda invoke) and how a warm-up is sent. The shm door reads
numpy views over its mapped buffers, so onnxruntime reads them in place: no frame, no copy.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from mopar.bundle.dispatch import DispatchSpec
from mopar.bundle.layout import FUNCTION_FILE, HOT_DIR, WARM_DIR
from mopar.codec import PayloadError, get_codec
from mopar.runtime.dispatch import (
    Call,
    DispatchError,
    combine,
    expert_tensors,
    route,
    run_local,
    to_warm,
)

if TYPE_CHECKING:
    from mopar.bundle.function import FunctionSpec, TensorSpec

__all__ = ["Door", "FunctionCore", "RequestError", "Load"]

Load = Callable[[Path], Any]
"""A model folder -> its `mopar.runtime.handler.SliceHandler` (``inputs``, ``output_names``,
``handle``)."""


class RequestError(ValueError):
    """A request this function cannot serve, by the caller's fault (an HTTP 4xx)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Door(Protocol):
    """The I/O around `FunctionCore.run`, for one request.

    Attributes:
        prewarms: whether it can send warm-ups; a dispatch runs its predictor only then.
    """

    prewarms: bool

    def received(self) -> Mapping[str, Any]:
        """The tensors the request brought, by name, as the door holds them (undecoded)."""

    def describe(self, item: Any) -> tuple[np.dtype, tuple[int, ...], str]:
        """The dtype, shape and codec name of a received tensor, before it is decoded.

        Raises:
            PayloadError: its header is malformed.
        """

    def gather(self, calls: Sequence[FunctionSpec]) -> None:
        """Call each function of ``calls`` (a join's parts) with the received tensors it
        receives; their outputs are received from then on."""

    def decode(self, names: Collection[str]) -> dict[str, np.ndarray]:
        """The received tensors of ``names`` (those there are), decoded.

        Raises:
            PayloadError: a payload does not decode.
        """

    def call(self, calls: Sequence[Call]) -> list[np.ndarray]:
        """Send each expert function of ``calls`` its tokens and gates, all at once, and wait;
        their answers, in order."""

    def warm(self, names: list[str]) -> None:
        """Send warm-ups to the functions ``names`` (the door picks the cold ones), not waiting."""

    def send(self, results: Mapping[str, np.ndarray]) -> None:
        """Encode the function's results and hand them on."""


class FunctionCore:
    """A function's models and its per-request work (`run`), behind any `Door`.

    Args:
        function_dir: the function's folder: ``model.onnx`` (a dispatch's: the rest of its
            layer), and a dispatch's ``HOT_DIR`` and ``WARM_DIR`` models.
        name: the function's name.
        load: how a model folder becomes a handler.
        receives: the tensors a request brings, exactly (``function.json``'s); None when the
            door brings only what the slice reads (the shm runner), which the slice checks.
        calls: the functions it calls before it runs (a join's parts).
        dispatch: a dispatch function's layer.
        predict: load the next layer's router, to pre-warm with (a dispatch that has one).
    """

    def __init__(
        self,
        function_dir: Path,
        *,
        name: str,
        load: Load,
        receives: Sequence[TensorSpec] | None = None,
        calls: Sequence[FunctionSpec] = (),
        dispatch: DispatchSpec | None = None,
        predict: bool = True,
    ) -> None:
        self.name = name
        self.dispatch = dispatch
        self.calls = tuple(calls)
        self.receives = None if receives is None else {t.name: t for t in receives}
        self._expert_in = expert_tensors(name)[:2]  # what it receives if an expert function
        self.handler = load(function_dir)
        self.hot = load(function_dir / HOT_DIR) if dispatch is not None and dispatch.hot else None
        self.predictor = (
            load(function_dir / WARM_DIR)
            if dispatch is not None and dispatch.warm and predict
            else None
        )
        self._requests = itertools.count()  # a dispatch's requests, for replicas' turns
        self._pool: ThreadPoolExecutor | None = None  # where hot experts run meanwhile

    def run(self, door: Door) -> float:
        """Serve one request through ``door``; return the compute ms (a join's: from when its
        parts have answered; a dispatch's: its expert functions' calls included).

        Raises:
            RequestError: the request is at the caller's fault (the door's 4xx).
        """
        self.check(door)
        if self.calls and self.dispatch is None:
            door.gather(self.calls)
        start = time.perf_counter()
        if self.dispatch is not None:
            results = self._dispatch(door, self.dispatch)
        else:
            results = self.handler.handle(self._decode(door, self.handler.inputs))
        door.send(results)
        return (time.perf_counter() - start) * 1e3

    def check(self, door: Door) -> None:
        """Check the received tensors against ``receives``: exactly those names, each of its
        dtype, shape and codec; an expert function's tokens and gates of one row per token. Without
        ``receives`` (the shm runner's slices, fed by the slices before them), only the rows:
        the slice checks its inputs' dtypes and shapes itself.

        Raises:
            RequestError: (400) naming the first problem, before anything is decoded.
        """
        got = door.received()
        if self.receives is not None:
            missing = [n for n in self.receives if n not in got]
            extra = [n for n in got if n not in self.receives]
            if missing or extra:
                raise RequestError(
                    f"slice {self.name} expects tensors {list(self.receives)}; "
                    f"missing {missing}, unexpected {extra}"
                )
        names = got if self.receives is not None else [n for n in self._expert_in if n in got]
        shapes = {}
        for name in names:
            item = got[name]
            try:
                dtype, shapes[name], codec = door.describe(item)
            except PayloadError as exc:
                raise RequestError(f"tensor {name!r}: {exc}") from None
            want = self.receives.get(name) if self.receives is not None else None
            if want is not None and (dtype.name != want.dtype or not want.fits(shapes[name])):
                raise RequestError(
                    f"tensor {name!r} is {dtype.name}{list(shapes[name])}, expected "
                    f"{want.describe()}"
                )
            # a payload says its codec's family (zstd, not zstd:9): a codec the plan never chose
            if want is not None and get_codec(codec).code != get_codec(want.codec).code:
                raise RequestError(
                    f"tensor {name!r} is encoded with codec {codec}, and {FUNCTION_FILE} of "
                    f"{self.name} declares codec {want.codec} for it; send it encoded with "
                    f"{want.codec}"
                )
        tokens, gates = self._expert_in
        if tokens in shapes and gates in shapes:  # an expert function: one gate row a token
            n = [shapes[tokens][0], shapes[gates][0]]
            if n[0] != n[1]:
                raise RequestError(
                    f"expert function {self.name} got {n[0]} tokens but "
                    f"{n[1]} rows of gates; send one row of gates per token"
                )

    def _dispatch(self, door: Door, spec: DispatchSpec) -> dict[str, np.ndarray]:
        """Route the tokens, pre-warm the next layer's expert functions it predicts, call the
        expert functions that received any while the hot experts run here, add all their
        answers, and run the rest of the layer."""
        own = set(self.handler.inputs)  # its tail's inputs, all decoded before any expert runs
        got = self._decode(door, own | {spec.hidden, spec.index, spec.weights})
        try:
            calls = route(
                spec, got[spec.hidden], got[spec.index], got[spec.weights], next(self._requests)
            )
        except DispatchError as exc:
            raise RequestError(str(exc)) from None
        if door.prewarms and self.predictor is not None:
            predicted = self.predictor.handle({spec.hidden: got[spec.hidden]})
            door.warm(to_warm(spec, predicted[self.predictor.output_names[0]]))
        remote = [c for c in calls if not c.local]
        hot = next((c for c in calls if c.local), None)
        pending = None
        if hot is not None and remote:  # in a thread of its own while the called ones work
            assert self.hot is not None  # a local call: the dispatch keeps hot experts, loaded
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1)
            pending = self._pool.submit(run_local, self.hot, hot)
        answers = dict(zip((c.function for c in remote), door.call(remote))) if remote else {}
        if hot is not None:
            assert self.hot is not None
            answers[hot.function] = pending.result() if pending else run_local(self.hot, hot)
        try:
            hidden = got[spec.hidden]
            combined = combine(
                spec,
                calls,
                [answers[c.function] for c in calls],
                hidden.dtype,
                hidden.size // spec.hidden_size,
            )
        except DispatchError as exc:
            raise RuntimeError(str(exc)) from None
        return self.handler.handle(
            {**{k: v for k, v in got.items() if k in own}, spec.output: combined}
        )

    def _decode(self, door: Door, names: Collection[str]) -> dict[str, np.ndarray]:
        """The received tensors of ``names``, decoded, each within the values ``receives``
        allows it (an embedding's indices: onnxruntime would read a negative one from the end,
        where torch refuses it)."""
        try:
            got = door.decode(names)
        except PayloadError as exc:
            raise RequestError(str(exc)) from None
        for name, array in got.items():
            want = self.receives.get(name) if self.receives is not None else None
            if want is None or want.value_range is None:
                continue  # no range to hold it to
            if (bad := want.outside(array)) is not None:
                low, high = want.value_range
                raise RequestError(
                    f"tensor {name!r} holds {bad}, and it indexes an embedding of "
                    f"{high + 1} rows: send values from {low} to {high}"
                )
        return got
