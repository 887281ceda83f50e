"""A function reached by frames: the door of the function server and of the Lambda handler.

`SliceFunction` is a function folder ready to serve (its `FunctionSpec` and its
`mopar.runtime.core.FunctionCore`); `process` serves one incoming frame (`mopar.runtime.frame`)
through `_FrameDoor` and returns the outgoing one. The server (`mopar.runtime.server`) and the
Lambda handler (`mopar.runtime.aws`) differ only in how the frame arrives and leaves, and in how
they reach the functions it calls (``fork``) and pre-warm (``warm``). The outgoing frame holds
the results the function sends, encoded with their codecs, and the tensors it only carries,
forwarded byte for byte; the last function's under the model's public names.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import numpy as np

from mopar.bundle.function import FunctionSpec
from mopar.codec import PayloadError
from mopar.runtime import wire
from mopar.runtime.core import FunctionCore, RequestError
from mopar.runtime.dispatch import Call, expert_tensors
from mopar.runtime.frame import decode_payloads, join_frame, split_frame

__all__ = ["Fork", "SliceFunction", "call_experts", "named_in_order"]

Fork = Callable[[list[str], list[bytes]], list[bytes]]
"""(called functions' names, their incoming frames) -> their answers, in order."""


def call_experts(calls: Sequence[Call], fork: Fork) -> list[np.ndarray]:
    """Send each expert function of ``calls`` its tokens and gates as a frame, through
    ``fork``, all at once; their answers, in order.

    Raises:
        RuntimeError: an answer is no frame of the expert function's output.
    """
    frames = []
    for c in calls:
        tokens, gates, _ = expert_tensors(c.function)
        frames.append(join_frame({tokens: wire.encode(c.tokens), gates: wire.encode(c.gates)}))
    answers = []
    for c, answer in zip(calls, fork([c.function for c in calls], frames)):
        try:
            out = expert_tensors(c.function)[2]
            answers.append(decode_payloads(split_frame(answer))[out])
        except (PayloadError, KeyError) as exc:
            raise RuntimeError(
                f"expert function {c.function} answered a malformed frame ({exc})"
            ) from None
    return answers


class SliceFunction:
    """A function folder ready to serve frames: its spec and its core.

    Args:
        function_dir: folder with ``model.onnx``, ``handler.py`` and ``function.json``.
        intra_op_threads: onnxruntime's threads per operator (0: its choice).
    """

    def __init__(self, function_dir: Path, *, intra_op_threads: int = 0) -> None:
        from mopar.runtime.handler import handler_class

        handler = handler_class()
        self.dir = Path(function_dir)
        self.spec = FunctionSpec.load(self.dir)
        self.core = FunctionCore(
            self.dir,
            name=self.spec.slice,
            load=lambda d: handler(d, intra_op_threads=intra_op_threads),
            receives=self.spec.receives,
            calls=self.spec.calls,
            dispatch=self.spec.dispatch,
        )

    def process(
        self,
        data: bytes | memoryview,
        fork: Fork | None = None,
        warm: Callable[[list[str]], None] | None = None,
    ) -> tuple[bytes, float]:
        """Serve one incoming frame; return the outgoing frame and the compute ms.

        Args:
            fork: how to run the functions this one calls: given each one's name and incoming
                frame, it returns their answers (frames of their outputs) in the same order.
            warm: a dispatch's way to pre-warm functions: given the next layer's expert
                functions it predicts, it sends those it takes to be cold a warm-up.

        Raises:
            RequestError: the frame is malformed or not what the function receives.
        """
        door = _FrameDoor(self.spec, data, fork, warm)
        ms = self.core.run(door)
        return door.out, ms

    def calls_named(self, given: str) -> list[str]:
        """The functions it calls, as ``MOPAR_CALLS`` (comma-separated) names them: URLs, or
        Lambda names.

        Raises:
            ValueError: not one per called function.
        """
        named = [x.strip() for x in given.split(",") if x.strip()]
        if len(named) != len(self.spec.callee_names):
            raise ValueError(
                f"function {self.spec.slice} calls {len(self.spec.callee_names)} functions, but "
                f"MOPAR_CALLS names {len(named)}; give one per called function, comma-separated, "
                "in order"
            )
        return named

    def warm_named(self, given: str) -> dict[str, str]:
        """A dispatch's pre-warm targets by function name, as ``MOPAR_WARM`` (comma-separated,
        in the order of its ``function.json``) names them: URLs, or Lambda ARNs.

        Raises:
            ValueError: some given, but not one per function.
        """
        names = [f for f, _ in self.spec.dispatch.warm] if self.spec.dispatch else []
        return named_in_order(self.spec.slice, names, given, "MOPAR_WARM")


def named_in_order(function: str, names: Sequence[str], given: str, var: str) -> dict[str, str]:
    """``names`` (the functions ``function`` warms up, in its ``function.json``'s order) paired
    with the addresses ``var`` gives for them (comma-separated URLs or Lambda ARNs, in that
    order); empty where it warms none, or none are given.

    Raises:
        ValueError: some given, but not one per function.
    """
    named = [x.strip() for x in given.split(",") if x.strip()]
    if not names:  # nothing to warm (a dispatch with no router it could run, or not the entry)
        return {}
    if named and len(named) != len(names):
        raise ValueError(
            f"function {function} pre-warms {len(names)} functions, but {var} names "
            f"{len(named)} URLs or ARNs; give one per function, in order"
        )
    return dict(zip(names, named))


class _FrameDoor:
    """One request's frame in, its outgoing frame out (`mopar.runtime.core.Door`)."""

    def __init__(
        self,
        spec: FunctionSpec,
        data: bytes | memoryview,
        fork: Fork | None,
        warm: Callable[[list[str]], None] | None,
    ) -> None:
        self.spec = spec
        self.data = data
        self.fork = fork
        self.warm_up = warm
        self.prewarms = warm is not None
        self.payloads: dict[str, memoryview] | None = None
        self.out = b""

    def received(self) -> dict[str, memoryview]:
        if self.payloads is None:
            try:
                self.payloads = split_frame(self.data)
            except PayloadError as exc:
                raise RequestError(f"malformed frame: {exc}") from None
        return self.payloads

    def describe(self, item: memoryview) -> tuple[np.dtype, tuple[int, ...], str]:
        return wire.describe(item)

    def decode(self, names: Collection[str]) -> dict[str, np.ndarray]:
        return decode_payloads({k: v for k, v in self.received().items() if k in names})

    def _forked(self, names: list[str], frames: list[bytes], what: str) -> list[bytes]:
        if self.fork is None:
            raise RuntimeError(
                f"function {self.spec.slice} calls {what} but was given no way to "
                "reach them; set MOPAR_CALLS"
            )
        return self.fork(names, frames)

    def gather(self, calls: Sequence[FunctionSpec]) -> None:
        """Scatter the received tensors to the called functions and gather their outputs:
        the framing and the names are checked here, each tensor's header when it is decoded,
        its shape by the slice."""
        payloads = self.received()
        frames = [join_frame({t.name: payloads[t.name] for t in c.receives}) for c in calls]
        names = [c.slice for c in calls]
        answers = self._forked(names, frames, str(names))
        for spec, answer in zip(calls, answers):
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
            payloads.update(got)

    def call(self, calls: Sequence[Call]) -> list[np.ndarray]:
        return call_experts(
            calls, lambda names, frames: self._forked(names, frames, "expert functions")
        )

    def warm(self, names: list[str]) -> None:
        assert self.warm_up is not None  # the core warms only through a door that prewarms
        self.warm_up(names)

    def send(self, results: Mapping[str, np.ndarray]) -> None:
        out: dict[str, bytes | memoryview] = {}
        for name in self.spec.sends:
            if name in results:
                out[name] = wire.encode(results[name], self.spec.codecs.get(name, "none"))
            else:
                out[name] = self.received()[name]
        if self.spec.last:
            out = {self.spec.returns.get(k, k): v for k, v in out.items()}
        self.out = join_frame(out)
