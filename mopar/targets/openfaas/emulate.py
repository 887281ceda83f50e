"""OpenFaaS around its functions, played on 127.0.0.1 for `mopar run`. No torch.

Read in this order: `Gateway` (the gateway's ``/async-function/<name>`` and its queue-worker,
and a client's callback URL: the runner's `mopar.target.Emulation` of the ``callback`` mode),
then `emulation`.

None of them is a function's code: the functions are the bundle's own function servers
(`mopar.runtime.server`), unchanged. These are the platform's queue and the client's end, so
that an asynchronous chain runs here as it does there: each function returns as soon as its
hand-on is queued, and the answer reaches its reader through a real rendezvous.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from mopar.runner.emulate import JSON, LoopbackServer
from mopar.runtime.chains import ChainMode
from mopar.runtime.rendezvous import Answer, Waiters, answer_of
from mopar.runtime.transports import HopError, HttpClient

__all__ = ["Gateway", "emulation"]

_CALLBACK = "/callback/"


class Gateway:
    """The ``callback`` mode's platform (`mopar.target.Emulation`) on one loopback server: the
    gateway's ``POST /async-function/<name>``, answered 202 at once and the call made later,
    synchronously, by a queue-worker (``workers`` of them), with the request's headers; and a
    client's callback URL, ``/callback/<request id>``, whose answers are handed to whoever
    waits for them (`mopar.runtime.rendezvous.Waiters`).

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
        self.waiters = Waiters()
        self._pool = ThreadPoolExecutor(max_workers=workers)
        self._server = LoopbackServer(self._handle)
        self.url = self._server.url

    def url_of(self, name: str) -> str:
        """The queue's URL for function ``name``."""
        return f"{self.url}/async-function/{name}"

    def add(self, name: str, url: str) -> None:
        """Function ``name`` is served at ``url`` from now on."""
        self.clients[name] = HttpClient(url, timeout_s=self.timeout_s)

    def _handle(
        self, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, bytes, dict[str, str]]:
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if path.startswith(_CALLBACK):  # an answer for a client
            if not self.waiters.deliver(name, answer_of(headers, body)):
                return 404, json.dumps({"error": f"no request waits at {path}"}).encode(), JSON
            return 200, b"{}", JSON
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

    def expect(self, request: str) -> str:
        """Open ``request``'s rendezvous; the callback URL its answer is POSTed to."""
        self.waiters.open(request)
        return f"{self.url}{_CALLBACK}{request}"

    def wait(self, request: str, timeout_s: float) -> Answer | None:
        return self.waiters.wait(request, timeout_s)

    def forget(self, request: str) -> None:
        self.waiters.close(request)

    def close(self) -> None:
        self._server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def emulation(mode: ChainMode, *, workers: int, timeout_s: float) -> Gateway | None:
    """The gateway's queue and the client's callback URL where ``mode`` answers by a callback;
    nothing in front of the functions otherwise (they POST to each other)."""
    if mode.rendezvous != "callback":
        return None
    return Gateway(workers=workers, timeout_s=timeout_s)
