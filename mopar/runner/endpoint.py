"""A bundle as one local HTTP endpoint: ``mopar serve``, and ``mopar invoke BUNDLE``.

`Endpoint` starts the bundle's function servers as ``mopar run --transport T`` does
(`mopar.runner.chain.ChainSession` on 127.0.0.1; ``shm`` hands frames on through a tmpfs folder
of its own), and sends each request through them in the bundle's chain mode. As a WSGI app it
takes a body of any format `mopar.runtime.bodies` reads (a frame, JSON, .npy, .npz), checked
against the model inputs the chain's entry receives, and answers in the format ``Accept`` asks
for; `run` serves one request from Python. Everything it started is stopped by `close`, also
on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from mopar.bundle.function import FunctionSpec
from mopar.config import RunConfig
from mopar.errors import RuntimeFailure
from mopar.runner.bundle import BundleManifest
from mopar.runner.chain import ChainSession, chain_mode_of
from mopar.runner.local import shm_root
from mopar.runner.processes import local_redis
from mopar.runtime import bodies, oip
from mopar.runtime.core import RequestError
from mopar.runtime.frame import decode_payloads, split_frame
from mopar.runtime.httpd import REASONS
from mopar.runtime.server import create_function_server, read_body
from mopar.runtime.transports import inline, transport_named

__all__ = ["Endpoint"]


class Endpoint:
    """The bundle of ``manifest`` served through its function servers.

    Args:
        manifest: the bundle.
        transport: how the functions hand frames to each other: ``shm``, ``http`` or ``redis``.
        redis_url: the Redis for ``redis`` (empty: a private redis-server, started here).
        threads: requests served at once.
        timeout_s: seconds a function may take to answer.
        intra_op_threads: onnxruntime intra-op threads per function (0: its default).
    """

    def __init__(
        self,
        manifest: BundleManifest,
        *,
        transport: str = "shm",
        redis_url: str = "",
        threads: int = 4,
        timeout_s: float = 60.0,
        intra_op_threads: int = 0,
    ) -> None:
        self.manifest = manifest
        self.transport = transport
        self.redis_url = redis_url
        self.threads = threads
        self.config = RunConfig(
            concurrency=threads, timeout_s=timeout_s, intra_op_threads=intra_op_threads
        )
        entry = next(
            spec
            for spec in (FunctionSpec.load(manifest.function_dir(s)) for s in manifest.slices)
            if not spec.answers
        )
        self.receives = entry.receives  # the model inputs the chain's entry takes
        self.limits = bodies.Limits.of(self.receives, frame_bytes=entry.max_body_bytes())
        self.session: ChainSession | None = None
        self._stack = contextlib.ExitStack()

    def start(self) -> None:
        """Start the function servers (and a private Redis where one is needed)."""
        mode = chain_mode_of(self.manifest)
        kind = transport_named(self.transport)
        redis_url = self.redis_url
        if (kind.needs_redis or mode.rendezvous == "redis") and not redis_url:
            redis_url = self._stack.enter_context(local_redis())
        shm = Path(tempfile.mkdtemp(prefix="mopar-serve-", dir=shm_root()))
        self._stack.callback(shutil.rmtree, shm, ignore_errors=True)
        self.session = ChainSession(
            self.manifest,
            self.config,
            # as `mopar run` does: an asynchronous chain of co-located functions hands on inline
            transport=inline().name if kind.colocated and mode.rendezvous else self.transport,
            redis_url=redis_url,
            shm_dir=str(shm),
            mode=mode,
        )
        self._stack.callback(self.session.stop)
        self.session.start()

    def close(self) -> None:
        """Stop every process it started and remove its folder."""
        self._stack.close()

    def __enter__(self) -> Endpoint:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Serve one request; the model outputs by public name.

        Raises:
            InputSpecError: an input is missing, or not of the compiled shape and dtype.
            RuntimeFailure: a function failed or did not answer.
        """
        self.manifest.check_inputs(inputs)
        frame = bodies.to_frame({t.name: inputs[t.name] for t in self.receives}, self.receives)
        answer = self._session().request(frame)
        if answer.status != 200:
            raise RuntimeFailure(f"the bundle answered {answer.status}: {answer.error()}")
        return decode_payloads(split_frame(answer.body))

    def answer(
        self, body: bytes | memoryview, content_type: str | None, accept: str | None
    ) -> tuple[int, str, bytes]:
        """One request's status, content type and body.

        Raises:
            RequestError: the request is at fault (a 4xx).
            RuntimeFailure: a function failed or did not answer.
        """
        answer_as = bodies.answer_format(accept)
        frame = bodies.request_frame(body, content_type, self.receives)
        answer = self._session().request(frame)
        if answer.status != 200:
            kind = answer.headers.get("content-type", bodies.Format.JSON.media_type)
            return answer.status, kind, answer.body
        out, kind = bodies.answer_body(answer.body, answer_as)
        return 200, kind, out

    def _session(self) -> ChainSession:
        if self.session is None:
            raise RuntimeError("the endpoint is not started; use it as a context manager")
        return self.session

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        """The WSGI app: POST a body to any path; GET ``/_/health`` says whether it is up; the
        Open Inference Protocol under ``/v2``."""
        try:
            status, headers, body = self._serve(environ)
        except RequestError as exc:
            status, headers, body = _error(exc.status, str(exc))
        except RuntimeFailure as exc:
            status, headers, body = _error(502, str(exc))
        start_response(
            f"{status} {REASONS.get(status, 'Error')}",
            [*headers, ("Content-Length", str(len(body)))],
        )
        return [body]

    def _serve(self, environ: dict) -> tuple[int, Headers, bytes]:
        method = environ["REQUEST_METHOD"]
        protocol = oip.route(environ.get("PATH_INFO", ""))
        if protocol is not None:
            return self._protocol(protocol, method, environ)
        if method == "GET" and environ.get("PATH_INFO", "").rstrip("/").endswith("/_/health"):
            return _json(200, {"model": self.manifest.model, "ready": self.session is not None})
        if method != "POST":
            raise RequestError(
                f"{method} is not served; POST the model inputs as JSON, .npy, .npz or a frame, "
                f"or use the Open Inference Protocol at /v2/models/{self.manifest.model}",
                405,
            )
        body = read_body(environ, self.body_limit(environ))
        status, kind, out = self.answer(
            body, environ.get("CONTENT_TYPE", ""), environ.get("HTTP_ACCEPT")
        )
        return status, [("Content-Type", kind)], out

    def _protocol(self, route: oip.Route, method: str, environ: dict) -> tuple[int, Headers, bytes]:
        """A request of the Open Inference Protocol (`mopar.runtime.oip`)."""
        inputs = [oip.Tensor.received(t) for t in self.receives]
        doc = oip.described(route, method, self.manifest.model, inputs, self._outputs())
        if doc is not None:
            return _json(200, doc)
        body = read_body(environ, self.limits.largest)
        length = environ.get("HTTP_INFERENCE_HEADER_CONTENT_LENGTH")
        infer = oip.read_infer(body, length, self.receives)
        answer = self._session().request(bodies.to_frame(infer.arrays, self.receives))
        if answer.status != 200:
            kind = answer.headers.get("content-type", bodies.Format.JSON.media_type)
            return answer.status, [("Content-Type", kind)], answer.body
        outputs = decode_payloads(split_frame(answer.body))
        out, headers = oip.write_infer(self.manifest.model, outputs, infer)
        return 200, headers, out

    def _outputs(self) -> list[oip.Tensor]:
        """The model outputs as compiled (``plan.json``'s io), -1 on each axis whose example
        size is that of an input's dynamic axis (the size that moves with it)."""
        io = self.manifest.document.io
        if io is None:
            return []
        moving = {
            size
            for t in io.inputs
            for size, lo, hi in zip(t.shape, t.min_shape or t.shape, t.max_shape or t.shape)
            if lo != hi
        }
        return [
            oip.Tensor(o.name, o.dtype, tuple(-1 if d in moving else d for d in o.shape))
            for o in io.outputs
        ]

    def refusal(self, environ: dict, head: bytes, size: int, limit: int) -> RequestError:
        """Why a body over its limit is refused (`mopar.runtime.httpd.Refusal`): the 400 of a
        tensor of another dtype or size, where its head shows one; else the 413."""
        return oip.refusal(environ, head, self.receives, size=size, limit=limit)

    def body_limit(self, environ: dict) -> int:
        """The largest body of the request ``environ`` describes, bytes: the server refuses a
        larger one from its Content-Length, before reading it.

        Raises:
            RequestError: (415) a type not served.
        """
        if environ.get("REQUEST_METHOD") != "POST":
            return self.limits.frame  # nothing is read
        if environ.get("PATH_INFO", "").startswith("/v2/"):  # JSON, or JSON and binary data
            return self.limits.largest
        return self.limits.of_format(bodies.request_format(environ.get("CONTENT_TYPE", "")))

    def server(self, *, host: str, port: int):
        """A waitress server of this endpoint, listening on ``host:port`` (0: a free port;
        ``effective_port`` says which), held to the limits of a function server (bodies refused
        from their Content-Length, slow requests cut off, connections sized to memory:
        `mopar.runtime.httpd`); `run` it, and `close` it after."""
        return create_function_server(
            self, host=host, port=port, threads=self.threads, max_body=self.limits.largest
        )


Headers = list[tuple[str, str]]


def _json(status: int, doc: object) -> tuple[int, Headers, bytes]:
    return status, [("Content-Type", bodies.Format.JSON.media_type)], json.dumps(doc).encode()


def _error(status: int, message: str) -> tuple[int, Headers, bytes]:
    return _json(status, {"error": message})
