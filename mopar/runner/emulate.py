"""What the platforms do around the functions, played on 127.0.0.1 for `mopar run`. No torch.

Read in this order: `LambdaHost` (one Lambda function as a process: Lambda's synchronous and
``Event`` invocations, ``python -m mopar.runner.emulate``), `AsyncQueue` (the OpenFaaS gateway's
``/async-function/<name>`` and its queue-worker), `CallbackReceiver` (a client's callback URL).

None of them is a function's code: the functions are the bundle's own (the Lambda handler,
`mopar.runtime.aws`, and the function server, `mopar.runtime.server`), unchanged. These are the
platform's queues and the client's end, so that an asynchronous chain runs here as it does
there: each function returns as soon as its hand-on is queued, and the answer reaches its
reader through a real rendezvous.
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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from mopar.runtime.rendezvous import Answer, Waiters, answer_of
from mopar.runtime.transports import HopError, HttpClient

__all__ = ["AsyncQueue", "CallbackReceiver", "EVENT_HEADER", "LambdaHost", "main"]

log = logging.getLogger(__name__)

EVENT_HEADER = "X-Amz-Invocation-Type"
"""Lambda's Invoke API header: ``Event`` queues the call, answered 202 at once."""


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

    Args:
        handler: the function (`mopar.runtime.aws.LambdaFunction`).
        name: its name.
        timeout_s: its Timeout: the context's remaining time at the start of an invocation.
    """

    def __init__(self, handler: Callable[[dict, object], dict], name: str, timeout_s: float):
        self.handler = handler
        self.name = name
        self.timeout_s = timeout_s
        self._queue = ThreadPoolExecutor(max_workers=1)

    def __call__(self, environ: dict, start_response: Callable) -> list[bytes]:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        try:
            event = json.loads(environ["wsgi.input"].read(length) or b"{}")
        except ValueError:
            return self._answer(start_response, 400, {"errorMessage": "the payload is not JSON"})
        if environ.get("HTTP_" + EVENT_HEADER.upper().replace("-", "_")) == "Event":
            self._queue.submit(self._run, event)
            return self._answer(start_response, 202, {})
        return self._answer(start_response, 200, self._run(event))

    def _run(self, event: dict) -> dict:
        try:
            return self.handler(event, _Context(self.name, self.timeout_s))
        except Exception as exc:  # Lambda reports a raised error as the function's error
            log.warning("function %s failed: %s", self.name, exc)
            return {"errorMessage": f"{type(exc).__name__}: {exc}", "FunctionError": True}

    @staticmethod
    def _answer(start_response: Callable, status: int, body: dict) -> list[bytes]:
        data = json.dumps(body).encode()
        start_response(
            f"{status} {'OK' if status == 200 else 'Accepted' if status == 202 else 'Error'}",
            [("Content-Type", "application/json"), ("Content-Length", str(len(data)))],
        )
        return [data]


def _invokers(functions: dict[str, str], timeout_s: float):
    """Lambda's Invoke API over the local hosts ``functions`` (name -> URL): a synchronous
    invoke and an ``Event`` one."""
    clients = {n: HttpClient(u, timeout_s=timeout_s) for n, u in functions.items()}

    def client(name: str) -> HttpClient:
        if name not in clients:
            raise HopError(f"function {name} is not one of {sorted(clients)}")
        return clients[name]

    def invoke(name: str, event: dict) -> dict:
        got = client(name).post(json.dumps(event).encode(), {"Content-Type": "application/json"})
        answer = got.json()
        if answer.get("FunctionError"):
            raise HopError(f"next function {name} failed: {answer.get('errorMessage')}")
        return answer

    def invoke_async(name: str, event: dict) -> None:
        got = client(name).post(
            json.dumps(event).encode(), {"Content-Type": "application/json", EVENT_HEADER: "Event"}
        )
        if got.status != 202:
            raise HopError(f"the Event invoke of {name} was refused ({got.status})")

    return invoke, invoke_async


def main() -> int:
    """``python -m mopar.runner.emulate``: serve one Lambda function on 127.0.0.1.

    The environment is the function's (``MOPAR_FUNCTION_DIR``, ``MOPAR_NEXT`` and
    ``MOPAR_CALLS`` as function names, ``MOPAR_CHAIN``, ``REDIS_URL``, ...), plus
    ``MOPAR_LOCAL_FUNCTIONS``: the JSON of every other function's name and URL, ``PORT`` (0:
    a free one) and ``MOPAR_TIMEOUT_S``. Prints one ``ready`` JSON line, as the function server
    does.
    """
    from mopar.runtime.aws import LambdaFunction
    from mopar.runtime.httpd import inherited_socket
    from mopar.runtime.server import create_function_server

    t0 = time.perf_counter()
    env = dict(os.environ)
    timeout_s = float(env.get("MOPAR_TIMEOUT_S", "60"))
    invoke, invoke_async = _invokers(json.loads(env.get("MOPAR_LOCAL_FUNCTIONS", "{}")), timeout_s)
    try:
        fn = LambdaFunction(
            Path(env["MOPAR_FUNCTION_DIR"]), env, invoke=invoke, invoke_async=invoke_async
        )
    except Exception as exc:  # a broken function says why in one line, then exits
        print(f"error: {exc}", file=sys.stderr)
        return 1
    name = fn.function.spec.slice
    host = LambdaHost(fn, name, timeout_s)
    server = create_function_server(
        host,
        host="127.0.0.1",
        port=int(env.get("PORT", "0")),
        threads=int(env.get("MOPAR_THREADS", "4")),
        max_body=fn.function.spec.max_body_bytes() * 2,
        sock=inherited_socket(env),
    )
    ready = {"event": "ready", "slice": name, "port": server.effective_port}
    print(json.dumps({**ready, "load_ms": round((time.perf_counter() - t0) * 1e3, 1)}), flush=True)
    import signal

    def stop(*_) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


JSON = {"Content-Type": "application/json"}


class LoopbackServer:
    """A threaded HTTP server on a free 127.0.0.1 port, in a thread of this process: each POST
    is answered with what ``handle(path, headers, body)`` returns, (status, body, headers)."""

    def __init__(
        self, handle: Callable[[str, dict[str, str], bytes], tuple[int, bytes, dict[str, str]]]
    ):
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                status, data, extra = handle(self.path, headers, body)
                self.send_response(status)
                for name, value in extra.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:  # quiet
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class AsyncQueue:
    """The gateway's ``POST /async-function/<name>``: answered 202 at once, and the call made
    later, synchronously, by a queue-worker (``workers`` of them), with the request's headers.

    As OpenFaaS's queue-worker does, it POSTs the function's answer to the call's
    ``X-Callback-Url`` when it has one (mopar's functions hand on with ``X-Mopar-Callback``
    instead, and deliver the answer themselves).

    Args:
        workers: calls in progress at once.
        timeout_s: how long a call may take, s.
    """

    def __init__(self, *, workers: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.clients: dict[str, HttpClient] = {}
        self.failures: list[str] = []
        self._pool = ThreadPoolExecutor(max_workers=workers)
        self._server = LoopbackServer(self._queue)
        self.url = self._server.url

    def url_of(self, name: str) -> str:
        """The queue's URL for function ``name``."""
        return f"{self.url}/async-function/{name}"

    def add(self, name: str, url: str) -> None:
        """Function ``name`` is served at ``url`` from now on."""
        self.clients[name] = HttpClient(url, timeout_s=self.timeout_s)

    def _queue(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes, dict]:
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if not path.startswith("/async-function/") or name not in self.clients:
            return 404, json.dumps({"error": f"no function at {path}"}).encode(), JSON
        self._pool.submit(self._call, name, headers, body)
        return 202, b"{}", JSON

    def _call(self, name: str, headers: dict[str, str], body: bytes) -> None:
        keep = {k: v for k, v in headers.items() if k.startswith("x-")}
        try:
            got = self.clients[name].post(body, keep)
        except HopError as exc:
            self.failures.append(f"{name}: {exc}")
            return
        callback = headers.get("x-callback-url")
        if callback:
            try:
                HttpClient(callback).post(got.body, {"X-Function-Status": str(got.status)})
            except (HopError, ValueError) as exc:
                self.failures.append(f"callback of {name}: {exc}")

    def close(self) -> None:
        self._server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class CallbackReceiver:
    """A client's callback URL: answers POSTed to ``<url>/<request id>``, handed to whoever
    waits for them (`mopar.runtime.rendezvous.Waiters`)."""

    def __init__(self) -> None:
        self.waiters = Waiters()
        self._server = LoopbackServer(self._receive)
        self.url = self._server.url

    def url_of(self, request: str) -> str:
        return f"{self.url}/{request}"

    def _receive(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes, dict]:
        if not self.waiters.deliver(path.strip("/"), answer_of(headers, body)):
            return 404, json.dumps({"error": f"no request waits at {path}"}).encode(), JSON
        return 200, b"{}", JSON

    def expect(self, request: str) -> None:
        self.waiters.open(request)

    def wait(self, request: str, timeout_s: float) -> Answer | None:
        return self.waiters.wait(request, timeout_s)

    def forget(self, request: str) -> None:
        self.waiters.close(request)

    def close(self) -> None:
        self._server.close()


if __name__ == "__main__":
    sys.exit(main())
