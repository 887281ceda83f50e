"""Lambda around one function, played on 127.0.0.1 for `mopar run`: the Invoke API. No torch.

Read in this order: `LambdaHost` (one Lambda function as a process: Lambda's synchronous and
``Event`` invocations), then `main` (``python -m mopar.targets.aws_lambda.emulate``, what
`mopar.targets.aws_lambda.entry` names for the runner to start).

`LambdaHost` is not a function's code: the function is the bundle's own Lambda handler
(`mopar.runtime.aws`), unchanged. It is the platform's Invoke API and its queue, so that a chain
of handlers runs here as it does there: an ``Event`` invoke returns as soon as it is queued.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mopar.runtime.chains import ChainMode
from mopar.runtime.transports import HopError, HttpClient

__all__ = ["EVENT_HEADER", "LambdaHost", "emulation", "main"]

log = logging.getLogger(__name__)

EVENT_HEADER = "X-Amz-Invocation-Type"
"""Lambda's Invoke API header: ``Event`` queues the call, answered 202 at once."""

Event = dict[str, Any]
"""A Lambda event or answer: a JSON object."""
StartResponse = Callable[[str, list[tuple[str, str]]], object]
"""WSGI's ``start_response``."""


class _Context:
    """The part of Lambda's context object a handler reads."""

    def __init__(self, name: str, timeout_s: float) -> None:
        self.function_name = name
        self.deadline = time.monotonic() + timeout_s

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self.deadline - time.monotonic()) * 1000))


class LambdaHost:
    """One Lambda function, as the Invoke API reaches it: a synchronous invocation runs the
    handler and answers its JSON; an ``Event`` one is queued (202) and run in order by the
    instance's one worker, as an instance runs one invocation at a time.

    With ``init`` (a cold instance) the handler is made by the first invocation, as Lambda runs
    INIT when the first invocation finds no environment. One that arrives during that INIT
    waits for it here; Lambda would start another environment for it.

    Args:
        handler: the function (`mopar.runtime.aws.LambdaFunction`).
        name: its name.
        timeout_s: its Timeout: the context's remaining time at the start of an invocation.
    """

    def __init__(
        self,
        handler: Callable[[Event, object], Event] | None,
        name: str,
        timeout_s: float,
        *,
        init: Callable[[], Callable[[Event, object], Event]] | None = None,
    ) -> None:
        self.handler = handler
        self.name = name
        self.timeout_s = timeout_s
        self._queue = ThreadPoolExecutor(max_workers=1)
        self._init = init
        self._init_lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> list[bytes]:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        try:
            event = json.loads(environ["wsgi.input"].read(length) or b"{}")
        except ValueError:
            return self._answer(start_response, 400, {"errorMessage": "the payload is not JSON"})
        if environ.get("HTTP_" + EVENT_HEADER.upper().replace("-", "_")) == "Event":
            self._queue.submit(self._run, event)
            return self._answer(start_response, 202, {})
        return self._answer(start_response, 200, self._run(event))

    def _run(self, event: Event) -> Event:
        try:
            if self.handler is None:
                with self._init_lock:
                    if self.handler is None and self._init is not None:
                        self.handler = self._init()
            assert self.handler is not None  # made at start, or by the first invocation
            return self.handler(event, _Context(self.name, self.timeout_s))
        except Exception as exc:  # Lambda reports a raised error as the function's error
            log.warning("function %s failed: %s", self.name, exc)
            return {"errorMessage": f"{type(exc).__name__}: {exc}", "FunctionError": True}

    @staticmethod
    def _answer(start_response: StartResponse, status: int, body: Event) -> list[bytes]:
        data = json.dumps(body).encode()
        start_response(
            f"{status} {'OK' if status == 200 else 'Accepted' if status == 202 else 'Error'}",
            [("Content-Type", "application/json"), ("Content-Length", str(len(data)))],
        )
        return [data]


def _invokers(
    functions: dict[str, str], timeout_s: float
) -> tuple[Callable[[str, Event], Event], Callable[[str, Event], None]]:
    """Lambda's Invoke API over the local hosts ``functions`` (name -> URL): a synchronous
    invoke and an ``Event`` one."""
    clients = {n: HttpClient(u, timeout_s=timeout_s) for n, u in functions.items()}

    def client(name: str) -> HttpClient:
        if name not in clients:
            raise HopError(f"function {name} is not one of {sorted(clients)}")
        return clients[name]

    def invoke(name: str, event: Event) -> Event:
        got = client(name).post(json.dumps(event).encode(), {"Content-Type": "application/json"})
        answer: Event = got.json()
        if answer.get("FunctionError"):
            raise HopError(f"next function {name} failed: {answer.get('errorMessage')}")
        return answer

    def invoke_async(name: str, event: Event) -> None:
        got = client(name).post(
            json.dumps(event).encode(), {"Content-Type": "application/json", EVENT_HEADER: "Event"}
        )
        if got.status != 202:
            raise HopError(f"the Event invoke of {name} was refused ({got.status})")

    return invoke, invoke_async


def emulation(mode: ChainMode, *, workers: int, timeout_s: float) -> None:
    """Nothing in front of Lambda's functions: each is a `LambdaHost` process of its own (the
    runner reads an ``event`` chain's answers from its Redis rendezvous, as a client would)."""
    return None


def main() -> int:
    """``python -m mopar.targets.aws_lambda.emulate``: serve one Lambda function on 127.0.0.1.

    The environment is the function's (``MOPAR_FUNCTION_DIR``, ``MOPAR_NEXT`` and
    ``MOPAR_CALLS`` as function names, ``MOPAR_CHAIN``, ``REDIS_URL``, ...), plus
    ``MOPAR_LOCAL_FUNCTIONS``: the JSON of every other function's name and URL, ``PORT`` (0:
    a free one) and ``MOPAR_TIMEOUT_S``; ``MOPAR_LAZY_INIT=1`` leaves INIT to the first
    invocation. Prints one ``ready`` JSON line, as the function server does.
    """
    from mopar.bundle.function import FunctionSpec
    from mopar.runtime import bodies
    from mopar.runtime.aws import LambdaFunction
    from mopar.runtime.httpd import inherited_socket
    from mopar.runtime.server import create_function_server, serve_ready

    t0 = time.perf_counter()
    env = dict(os.environ)
    timeout_s = float(env.get("MOPAR_TIMEOUT_S", "60"))
    invoke, invoke_async = _invokers(json.loads(env.get("MOPAR_LOCAL_FUNCTIONS", "{}")), timeout_s)
    function_dir = Path(env["MOPAR_FUNCTION_DIR"])

    def make() -> LambdaFunction:
        return LambdaFunction(function_dir, env, invoke=invoke, invoke_async=invoke_async)

    try:
        spec = FunctionSpec.load(function_dir)
        cold = env.get("MOPAR_LAZY_INIT") == "1"  # INIT at the first invocation, as Lambda's
        host = LambdaHost(None if cold else make(), spec.slice, timeout_s, init=make)
    except Exception as exc:  # a broken function says why in one line, then exits
        print(f"error: {exc}", file=sys.stderr)
        return 1
    name = spec.slice
    # an event holds a frame in base64, or the inputs as JSON (a client's direct invoke)
    json_limit = bodies.Limits.of(spec.receives, frame_bytes=spec.max_body_bytes()).json
    server = create_function_server(
        host,
        host="127.0.0.1",
        port=int(env.get("PORT", "0")),
        threads=int(env.get("MOPAR_THREADS", "4")),
        max_body=max(spec.max_body_bytes() * 2, json_limit),
        sock=inherited_socket(env),
    )
    return serve_ready(server, name, t0)


if __name__ == "__main__":
    sys.exit(main())
