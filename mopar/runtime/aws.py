"""The AWS Lambda entry point: ``mopar.runtime.aws.lambda_handler`` (the image's CMD).

Events a function accepts (all JSON, as Lambda requires; frames travel base64-encoded):

- from the previous slice, a direct synchronous invoke: ``{"mopar": 1, "frame": "<base64>"}``,
  or ``{"mopar": 1, "ref": "redis:<key>"}`` when the frame was too large to send inline;
- from a client, through a Function URL or API Gateway (HTTP API, payload 2.0): the body is the
  frame (``isBase64Encoded: true``), or JSON, an .npy or an .npz by its ``content-type``
  (`mopar.runtime.bodies`); the answer is then an HTTP response in Lambda's proxy form, in the
  format its ``accept`` header asks for (default: JSON);
- from a client invoking the function directly: ``{"inputs": {name: nested lists}}``, answered
  ``{"outputs": {name: nested lists}, "timing": ..., "invocations": ...}``.

A function runs its slice, then invokes the next one (``MOPAR_NEXT``: its name or ARN) with the
outgoing frame: inline when the event stays within Lambda's 6 MB synchronous payload limit,
otherwise through Redis (``REDIS_URL``, e.g. ElastiCache). It answers with what the next one
answered, so the first function's answer is the model output. With ``MOPAR_CHAIN=stepfunctions``
a function does not invoke the next: it answers with its frame, stored in Redis and named by
key when over 256 KB (what a Step Functions state may carry), and the bundle's state machine
passes that answer from state to state.

A dispatch function with ``MOPAR_WARM`` (the ARNs of the next MoE layer's expert functions, in
the order of its ``function.json``) invokes the ones it predicts and takes to be cold
asynchronously (``InvocationType=Event``) with ``{"mopar": 1, "warm": true}``, which a function
answers at once: its environment is then initialised, and warm.

The chain's entry warms up the chain's other functions the same way at the start of its INIT,
and again when a request comes after an idle spell of ``MOPAR_WARM_KEEP_S``, so that at a
cold request their INITs overlap its own rather than follow one another: ``MOPAR_PREWARM``, their
ARNs in the order of its ``function.json``'s ``prewarms`` (template parameter ``PreWarm``).

With ``MOPAR_CHAIN=event`` no function waits for the next: each hands its frame on with an
``Event`` invoke (queued by Lambda; inline up to 1 MB, the asynchronous payload limit, else
stored in Redis and named by ``ref``) carrying the request's id, and returns. The last delivers
the answer (or the first failure) to a Redis rendezvous, ``mopar:answer:<request id>``
(`mopar.runtime.rendezvous`). The entry offers a client two ways to read it: an event with
``"async": true`` (an HTTP event: header ``X-Mopar-Async: 1``) is answered at once with the
request id, and the client BLPOPs the key; any other client event is answered synchronously:
the entry waits on the rendezvous (billed for that wait) and answers with what it holds.

This module owns that envelope, for the runner too (`mopar.runner.chain`,
`mopar.runner.stepwise`): `frame_event` wraps a frame, inline or stored, `event_frame` takes it
back out, and `post_event` invokes a handler behind the local runner's emulated Invoke API.

Every answer and hand-on carries ``invocations``: each function's own, wait and INIT ms
(`mopar.runtime.chains.Span`), in the order they ran.

Answers: ``{"mopar": 1, "frame" | "ref": ..., "timing": "s0=1.2,s1=3.4"}``, or
``{"mopar": 1, "status": 4xx/5xx, "error": "..."}`` for a request at fault, a failed hop or a
failed slice. Under Step Functions an error is raised instead, so the execution fails at the
slice that failed.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mopar.bundle.function import FunctionSpec, TensorSpec
from mopar.runtime import bodies, oip
from mopar.runtime.chains import HANDLER, REQUEST_ID_RE, SpanClock, mode_for
from mopar.runtime.core import RequestError
from mopar.runtime.dispatch import WARM_KEEP_S, Warmer
from mopar.runtime.frame import decode_payloads, split_frame
from mopar.runtime.framed import SliceFunction, named_in_order
from mopar.runtime.generate import MainFunction
from mopar.runtime.httpd import PEEK_BYTES
from mopar.runtime.rendezvous import Answer, RedisRendezvous
from mopar.runtime.transports import HopError, HttpClient, RedisStore, handing_on
from mopar.runtime.transports import store as store_transport

__all__ = [
    "LambdaFunction",
    "lambda_handler",
    "EVENT_LIMIT_BYTES",
    "INVOKE_LIMIT_BYTES",
    "STATE_LIMIT_BYTES",
    "event_frame",
    "frame_event",
    "post_event",
]

log = logging.getLogger("mopar.function")


INVOKE_LIMIT_BYTES = 6 * 1024 * 1024
"""Lambda's limit on a synchronous invoke's request and response payloads."""
STATE_LIMIT_BYTES = 256 * 1024
"""Step Functions' limit on the data a state passes on."""
EVENT_LIMIT_BYTES = 1024 * 1024
"""Lambda's limit on an asynchronous (``Event``) invoke's payload (1 MB since October 2025)."""
_ENVELOPE = 1024  # the JSON around the base64 text
_NO_FRAME = "the event has no frame: expected 'frame' (base64), 'ref' or an HTTP 'body'"

Invoke = Callable[[str, dict], dict]
"""(function name, event) -> the invoked function's answer, both JSON-able dicts."""


def frame_event(
    frame: bytes, store: RedisStore | None, *, limit: int | None = None, force_ref: bool = False
) -> dict[str, str]:
    """``{"frame": base64}`` when it fits an invoke of ``limit`` bytes (None: any size, as the
    local runner sends it), else (or with ``force_ref``) ``{"ref": "redis:<key>"}``, the frame
    put in ``store``.

    Raises:
        HopError: it needs the store, and there is none.
    """
    size = 4 * ((len(frame) + 2) // 3) + _ENVELOPE
    if not force_ref and (limit is None or size <= limit):
        return {"frame": base64.b64encode(frame).decode()}
    if store is None:
        raise HopError(
            f"the outgoing frame is {len(frame)} bytes, over Lambda's "
            f"{limit}-byte invoke payload once base64-encoded; set "
            "REDIS_URL (template.yaml parameter RedisUrl) for large handoffs"
        )
    return {"ref": f"redis:{store.put(frame)}"}


def event_frame(event: Mapping[str, Any], store: RedisStore | None) -> bytes:
    """The frame an event or answer carries: its ``frame``, or its ``ref`` taken out of
    ``store``.

    Raises:
        RequestError: (400) a ref to an unknown store, or to Redis with none here; (410) a key
            already taken or expired.
    """
    if "ref" not in event:
        return base64.b64decode(event["frame"])
    ref = str(event["ref"])
    scheme, _, key = ref.partition(":")
    if scheme != store_transport().name:
        raise RequestError(f"ref {ref!r} names the unknown store {scheme!r}; expected redis:<key>")
    if store is None:
        raise RequestError(
            "the event names a redis handoff, but this function has no "
            "REDIS_URL; set it in template.yaml's RedisUrl parameter"
        )
    try:
        return store.take(key)
    except ValueError as exc:
        raise RequestError(str(exc), 410 if "consumed" in str(exc) else 400) from None


def post_event(client: HttpClient, event: dict) -> tuple[int, dict]:
    """POST ``event`` to a Lambda handler behind an emulated Invoke API; its status and answer
    (a failure's: ``{"error": message}``, with the status it gave, else 500)."""
    got = client.post(json.dumps(event).encode(), {"Content-Type": "application/json"})
    answer = got.json()
    message = answer.get("error") or answer.get("errorMessage")
    if got.status != 200 or message:
        status = int(answer.get("status") or (500 if got.status == 200 else got.status))
        return status, {"error": str(message or got.error())}
    return 200, answer


def boto3_invoke_async(name: str, event: dict) -> None:
    """``lambda:InvokeFunction`` with ``InvocationType=Event``: queued, not waited for."""
    import boto3

    boto3.client("lambda").invoke(
        FunctionName=name, InvocationType="Event", Payload=json.dumps(event).encode()
    )


def boto3_invoke(timeout_s: float) -> Invoke:
    """Synchronous ``lambda:InvokeFunction`` through boto3 (present in the function image)."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "lambda", config=Config(read_timeout=timeout_s, retries={"mode": "standard"})
    )

    def invoke(name: str, event: dict) -> dict:
        answer = client.invoke(
            FunctionName=name, InvocationType="RequestResponse", Payload=json.dumps(event).encode()
        )
        payload = json.loads(answer["Payload"].read() or b"{}")
        if answer.get("FunctionError"):
            raise HopError(f"next function {name} failed: {payload.get('errorMessage', payload)}")
        return payload

    return invoke


class LambdaFunction:
    """One slice as a Lambda function.

    Args:
        function_dir: folder with ``model.onnx``, ``handler.py`` and ``function.json``.
        env: the environment (``MOPAR_NEXT``, ``REDIS_URL``, ``MOPAR_CHAIN``,
            ``MOPAR_INLINE_MAX_BYTES``, ``MOPAR_INTRA_OP``; ``MOPAR_PAYLOAD_LIMITS=off``: no
            payload limit, for a local measurement with no store at hand).
        invoke: how to invoke the next function; default: boto3.
        invoke_async: how to send a warm-up (name, event), not waiting; default: boto3's
            ``Event`` invocation.
    """

    def __init__(
        self,
        function_dir: Path,
        env: Mapping[str, str],
        *,
        invoke: Invoke | None = None,
        invoke_async: Callable[[str, dict], None] | None = None,
    ) -> None:
        started = time.perf_counter()
        # the chain mode first: a mode Lambda does not run is refused before anything loads
        self.mode = mode_for(env.get("MOPAR_CHAIN", ""), HANDLER)
        self.warmer = Warmer(float(env.get("MOPAR_WARM_KEEP_S", WARM_KEEP_S)))
        self._invoke_async = invoke_async or boto3_invoke_async
        # the entry warms up the rest of the chain before it loads, so their INITs overlap its own
        spec = FunctionSpec.load(function_dir)
        self.chain_warm = named_in_order(
            spec.slice, spec.prewarms, env.get("MOPAR_PREWARM", ""), "MOPAR_PREWARM"
        )
        if self.chain_warm:
            self._warm_chain()
        threads = int(env.get("MOPAR_INTRA_OP", "0"))  # the template's: one per whole vCPU
        self.function = SliceFunction(function_dir, intra_op_threads=threads)
        self.warm = self.function.warm_named(env.get("MOPAR_WARM", ""))
        self.next = env.get("MOPAR_NEXT", "").strip()
        self.calls = self.function.calls_named(env.get("MOPAR_CALLS", ""))
        self.chain = self.mode.name
        # the plan's choice: redis always stores; http (a direct invoke) stores only when too big
        self.always_store = handing_on(env.get("MOPAR_TRANSPORT", "")).stores
        self.inline_max = int(env.get("MOPAR_INLINE_MAX_BYTES", INVOKE_LIMIT_BYTES))
        if not self.mode.hands_on:  # Step Functions passes each answer on as a state
            self.inline_max = min(self.inline_max, STATE_LIMIT_BYTES)
        elif self.mode.rendezvous and self.next:  # an Event invoke carries it
            self.inline_max = min(self.inline_max, EVENT_LIMIT_BYTES)
        if env.get("MOPAR_PAYLOAD_LIMITS") == "off":  # measured locally, with no store at hand
            self.inline_max = sys.maxsize
        redis_url = env.get("REDIS_URL", "")
        self.store = RedisStore(redis_url) if redis_url else None
        self._invoke = invoke
        if self.always_store and self.store is None:
            raise ValueError(
                "this function hands over through Redis (MOPAR_TRANSPORT=redis); set REDIS_URL"
            )
        self.rendezvous = None
        if self.mode.rendezvous:
            if not redis_url:
                raise ValueError(
                    f"MOPAR_CHAIN={self.chain} delivers each answer through a Redis "
                    "rendezvous, and REDIS_URL is empty; set it (template.yaml parameter "
                    "RedisUrl) or deploy with Chain=invoke"
                )
            self.rendezvous = RedisRendezvous(redis_url)
        spec = self.function.spec
        self.limits = bodies.Limits.of(spec.receives, frame_bytes=spec.max_body_bytes())
        self.main = None
        if spec.generation is not None:  # a main function warms the experts it calls
            self.warm = dict(zip(spec.callee_names, self.calls))
            self.main = MainFunction.of(self.function, warm=self._prewarm if self.warm else None)
        self._init_ms = (time.perf_counter() - started) * 1e3  # billed INIT, reported once
        self._init_lock = threading.Lock()

    def _prewarm(self, names: list[str]) -> None:
        """Invoke the predicted functions taken to be cold with a warm-up, not waiting."""
        for name in self.warmer.cold(names):
            if name in self.warm:
                try:
                    self._invoke_async(self.warm[name], {"mopar": 1, "warm": True})
                except Exception as exc:  # noqa: BLE001 - a warm-up is a hint, never a failure
                    log.info("warm-up of %s failed: %s", name, exc)

    def _warm_chain(self) -> None:
        """The entry's warm-ups: the chain's other functions not warmed within the keep time
        (all of them at its INIT), each an ``Event`` invoke from a thread of its own (boto3's
        client takes a while to make), not waited for."""
        due = self.warmer.cold(list(self.chain_warm))
        if due:
            threading.Thread(target=self._send_warm_ups, args=(due,), daemon=True).start()

    def _send_warm_ups(self, names: list[str]) -> None:
        for name in names:
            try:
                self._invoke_async(self.chain_warm[name], {"mopar": 1, "warm": True})
            except Exception as exc:  # noqa: BLE001 - a warm-up is a hint, never a failure
                log.info("warm-up of %s failed: %s", name, exc)

    def _take_init(self) -> float:
        """The INIT ms to report with this request: the instance's start, on its first only."""
        with self._init_lock:
            init, self._init_ms = self._init_ms, 0.0
        return init

    def __call__(self, event: dict, context: Any) -> dict:
        if isinstance(event, dict) and event.get("mopar") == 1 and event.get("warm"):
            return {"mopar": 1, "warm": True, "slice": self.function.spec.slice}  # warm: done
        if self.chain_warm:  # after an idle spell the rest of the chain may be cold again
            self._warm_chain()
        if isinstance(event, dict) and "body" in event and "mopar" not in event:
            route = oip.route(str(event.get("rawPath") or event.get("path") or ""))
            if route is not None:
                return self._protocol(route, event, context)
        if self.main is not None and (asked := _generation_request(event)) is not None:
            return self._generate(*asked, context)
        http = isinstance(event, dict) and "body" in event and "mopar" not in event
        direct = isinstance(event, dict) and "inputs" in event and not http and "mopar" not in event
        req = _Request(self, event, http)
        answer_as = bodies.Format.JSON if direct else bodies.Format.FRAME
        try:
            if http:  # a bad Accept is refused before any work
                answer_as = bodies.answer_format(req.headers.get("accept"))
            answer = self._serve(event, context, req)
        except (RequestError, HopError) as exc:
            answer = self._error(exc.status, str(exc))
        except Exception as exc:  # the slice or the invoke failed: an answer, not a crash
            answer = self._error(
                500, f"slice {self.function.spec.slice} failed: {type(exc).__name__}: {exc}"
            )
        if "error" in answer and self.rendezvous is not None and req.delivers_errors:
            self._deliver_error(req, answer)
        if not self.mode.hands_on and "error" in answer:
            # fail this state, so the execution names the slice that failed
            raise RuntimeError(f"{answer['status']}: {answer['error']}")
        if direct and "error" not in answer and ("frame" in answer or "ref" in answer):
            outputs = decode_payloads(split_frame(event_frame(answer, self.store)))
            extra = {k: answer[k] for k in ("timing", "invocations", "request") if k in answer}
            return {**bodies.json_outputs(outputs), **extra}
        if not http:
            return answer
        if "error" in answer:
            return _json_answer(answer["status"], {"error": answer["error"]})
        headers = {"X-Mopar-Invocations": answer.get("invocations", "")}
        if "frame" not in answer and "ref" not in answer:  # accepted: the answer comes later
            return _json_answer(202, {"request": answer.get("request")}, headers)
        try:
            body, kind = bodies.answer_body(event_frame(answer, self.store), answer_as)
        except RequestError as exc:
            return _json_answer(exc.status, {"error": str(exc)})
        text = kind == bodies.Format.JSON.media_type  # a text body; the others in base64
        return {
            "statusCode": 200,
            "isBase64Encoded": not text,
            "headers": {
                "Content-Type": kind,
                "X-Mopar-Timing": answer.get("timing", ""),
                **headers,
            },
            "body": body.decode() if text else base64.b64encode(body).decode(),
        }

    def _protocol(self, route: oip.Route, event: dict, context: Any) -> dict:
        """An HTTP event of the Open Inference Protocol (`mopar.runtime.oip`), as the function
        server serves it: this function's tensors are its inputs, and it lists no outputs."""
        spec = self.function.spec
        http = event.get("requestContext", {}).get("http", {})
        method = str(http.get("method") or event.get("httpMethod") or "GET").upper()
        try:
            inputs = [oip.Tensor.received(t) for t in spec.receives]
            doc = oip.described(route, method, spec.model, inputs, ())
            if doc is not None:
                return _json_answer(200, doc)
            body = _event_body(event, self.limits.largest, spec.receives)
            length = _headers(event).get(oip.HEADER_LENGTH.lower())
            infer = oip.read_infer(body, length, spec.receives)
            req = _Request(self, event, True)
            frame = bodies.to_frame(infer.arrays, spec.receives)
            answer = self._process(self.limits.within(frame), context, req)
            if "error" in answer:
                return _json_answer(int(answer.get("status", 502)), {"error": answer["error"]})
            if "frame" not in answer and "ref" not in answer:  # accepted: the answer comes later
                return _json_answer(202, {"request": answer.get("request")})
            outputs = decode_payloads(split_frame(event_frame(answer, self.store)))
            out, headers = oip.write_infer(spec.model, outputs, infer)
        except RequestError as exc:
            return _json_answer(exc.status, {"error": str(exc)})
        text_body = dict(headers)["Content-Type"] == "application/json"
        return {
            "statusCode": 200,
            "isBase64Encoded": not text_body,
            "headers": {**dict(headers), "X-Mopar-Timing": answer.get("timing", "")},
            "body": out.decode() if text_body else base64.b64encode(out).decode(),
        }

    def _generate(self, body: object, http: bool, context: Any) -> dict:
        """A main function's generation request: its tokens and times (an HTTP event's: as
        the JSON body of a 200), or the refusal. Its expert functions are invoked by name."""
        assert self.main is not None  # a generation request: a main function's
        if self.calls:
            req = _Request(self, body, http)
            self.main.fork = lambda names, frames: self._fork(names, frames, context, req)
        try:
            answer, status = self.main.answer(body).to_dict(), 200
        except RequestError as exc:
            answer, status = {"error": str(exc)}, exc.status
        if not http:
            return answer if status == 200 else self._error(status, answer["error"])
        return _json_answer(status, answer)

    def _error(self, status: int, message: str) -> dict:
        return {"mopar": 1, "status": status, "error": message, "slice": self.function.spec.slice}

    def _serve(self, event: dict, context: Any, req: _Request) -> dict:
        return self._process(self._frame_of(event), context, req)

    def _process(self, frame: bytes | memoryview, context: Any, req: _Request) -> dict:
        out, ms = self.function.process(
            frame,
            (lambda names, frames: self._fork(names, frames, context, req)) if self.calls else None,
            self._prewarm if self.warm else None,
        )
        timing = ",".join(x for x in (req.timing, f"{self.function.spec.slice}={ms:.3f}") if x)
        if self.mode.rendezvous and not self.function.spec.answers:  # a called one answers
            return self._hand_on_async(out, timing, context, req)
        if not self.next or not self.mode.hands_on:
            return {
                "mopar": 1,
                "from": self.function.spec.slice,  # the next state carries its spans on
                **self._envelope(out, force_ref=self.always_store and not self.function.spec.last),
                "timing": timing,
                "invocations": req.spans(),
            }
        event = {"mopar": 1, **self._envelope(out, force_ref=self.always_store)}
        answer = req.waiting(lambda: self._invoker(context)(self.next, event))
        if "error" in answer:
            status = int(answer.get("status", 502))
            raise HopError.answered(f"next function {self.next}", status, answer["error"])
        return {
            **answer,
            "timing": ",".join(x for x in (timing, answer.get("timing")) if x),
            "invocations": ",".join(x for x in (req.spans(), answer.get("invocations")) if x),
        }

    def _hand_on_async(self, out: bytes, timing: str, context: Any, req: _Request) -> dict:
        """``event`` mode: hand on with an ``Event`` invoke, or, the last, deliver the answer;
        an entry whose client waits then waits on the rendezvous and answers with it."""
        name = self.function.spec.slice
        rendezvous = self.rendezvous
        assert rendezvous is not None  # event mode: set up with its rendezvous
        if not self.next:
            spans = req.spans()
            rendezvous.deliver(
                req.id, Answer(status=200, frame=out, slice=name, timing=timing, spans=spans)
            )
            return {"mopar": 1, "request": req.id, "delivered": True, "invocations": spans}
        event = {
            "mopar": 1,
            **self._envelope(out, force_ref=self.always_store),
            "request": req.id,
            "from": name,
            "timing": timing,
            "invocations": req.spans(),
        }
        self._invoke_async(self.next, event)
        if not req.facade:
            return {"mopar": 1, "request": req.id, "handed_on": self.next}
        remaining = getattr(context, "get_remaining_time_in_millis", lambda: 900_000)()
        answer = req.waiting(lambda: rendezvous.wait(req.id, remaining / 1000.0 - 0.5))
        if answer is None:
            raise HopError(
                f"no answer reached the rendezvous for request {req.id} in time; raise the "
                "entry function's Timeout or look for the failed function in the logs",
                status=504,
            )
        spans = req.waited_in(answer.spans)
        if answer.status != 200:
            raise HopError(f"{answer.slice} failed: {answer.error}", status=answer.status)
        return {
            "mopar": 1,
            **self._envelope(answer.frame, force_ref=False, limit=INVOKE_LIMIT_BYTES),
            "request": req.id,
            "timing": answer.timing,
            "invocations": spans,
        }

    def _deliver_error(self, req: _Request, answer: dict) -> None:
        """Deliver a failure to the rendezvous, so its reader does not wait out its timeout."""
        assert self.rendezvous is not None  # called only where there is one
        try:
            self.rendezvous.deliver(
                req.id,
                Answer(
                    status=int(answer["status"]),
                    error=answer["error"],
                    slice=self.function.spec.slice,
                    timing=req.timing,
                    spans=req.spans(),
                ),
            )
        except HopError as exc:
            log.warning("could not deliver the failure of request %s: %s", req.id, exc)

    def _fork(
        self, names: list[str], frames: list[bytes], context: Any, req: _Request
    ) -> list[bytes]:
        """Invoke the named called functions side by side, each with its frame; their frames,
        in order. (A dispatch function names only the experts its tokens reached.)"""
        from concurrent.futures import ThreadPoolExecutor

        by_name = dict(zip(self.function.spec.callee_names, self.calls))
        targets = [by_name[n] for n in names]
        invoke = self._invoker(context)
        dispatch = self.function.spec.dispatch  # its layer's mode: tokens through the store?
        store = dispatch is not None and dispatch.mode == "store"
        events = [{"mopar": 1, **self._envelope(f, force_ref=store)} for f in frames]
        with ThreadPoolExecutor(max_workers=len(events)) as pool:
            answers = list(pool.map(invoke, targets, events))
        for name, answer in zip(targets, answers):
            if "error" in answer:
                raise HopError(
                    f"function {name} answered {answer.get('status')}: {answer['error']}"
                )
        req.called += [str(a.get("invocations", "")) for a in answers]
        return [event_frame(a, self.store) for a in answers]

    def _invoker(self, context: Any) -> Invoke:
        if self._invoke is None:
            remaining = getattr(context, "get_remaining_time_in_millis", lambda: 900_000)()
            self._invoke = boto3_invoke(max(1.0, remaining / 1000.0))
        return self._invoke

    def _frame_of(self, event: dict) -> bytes | memoryview:
        if not isinstance(event, dict):
            raise RequestError(
                f"the event {json.dumps(event, default=str)[:60]} is not a JSON "
                'object; send {"mopar": 1, "frame": "<base64>"}, {"inputs": {...}} or an HTTP '
                "event"
            )
        receives = self.function.spec.receives
        if "mopar" not in event and "body" not in event and "inputs" in event:
            return bodies.to_frame(bodies.decode_json(event, receives), receives)
        if "mopar" not in event:
            return self._http_frame(event)
        if event.get("mopar") != 1:
            raise RequestError(
                f"event format {event.get('mopar')!r} is not supported "
                "(expected 1); both ends must run the same mopar"
            )
        if "ref" in event:
            return event_frame(event, self.store)
        text = event.get("frame")
        if not isinstance(text, str):
            raise RequestError(_NO_FRAME)
        if len(text) > 4 * (self.function.spec.max_body_bytes() // 3 + 1):
            raise RequestError(
                f"frame of about {len(text) * 3 // 4} bytes exceeds the "
                f"{self.function.spec.max_body_bytes()} this slice can receive",
                413,
            )
        try:
            return base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError("the frame is not valid base64") from None

    def _http_frame(self, event: dict) -> bytes | memoryview:
        """The frame an HTTP event's body stands for: a frame, or JSON, .npy or .npz by its
        content type, within that format's limit (`mopar.runtime.bodies`)."""
        text = event.get("body")
        if not isinstance(text, str):
            raise RequestError(_NO_FRAME)
        headers = _headers(event)
        content_type = str(headers.get("content-type", ""))
        fmt = bodies.request_format(content_type)
        binary = bool(event.get("isBase64Encoded", False))
        if not binary and fmt is not bodies.Format.JSON:
            raise RequestError(
                "the HTTP body is text but not declared JSON; send JSON as application/json, "
                "or a binary frame, .npy or .npz (isBase64Encoded)"
            )
        body = _event_body(event, self.limits.of_format(fmt), self.function.spec.receives)
        return self.limits.within(
            bodies.request_frame(body, content_type, self.function.spec.receives)
        )

    def _envelope(self, frame: bytes, *, force_ref: bool = False, limit: int = 0) -> dict:
        """The frame as it travels in an event (`mopar.runtime.events.frame_event`): inline
        within ``limit`` (default: the hand-on's), else stored."""
        return frame_event(frame, self.store, limit=limit or self.inline_max, force_ref=force_ref)


def _event_body(event: dict, limit: int, receives: Sequence[TensorSpec]) -> bytes:
    """An HTTP event's body, its base64 decoded where it says so. Over ``limit`` bytes, it is
    refused before it is decoded whole: with the 400 of a tensor of another dtype or size
    than ``receives`` where its first `PEEK_BYTES` show one, else a 413."""
    text = event.get("body")
    if not isinstance(text, str):
        raise RequestError(_NO_FRAME)
    binary = bool(event.get("isBase64Encoded", False))
    size = len(text) * 3 // 4 if binary else len(text)
    if size > limit:
        start = text[: 4 * (PEEK_BYTES // 3)]
        try:
            head = base64.b64decode(start, validate=True) if binary else start.encode()
        except (binascii.Error, ValueError):
            head = b""
        path = event.get("rawPath") or event.get("path") or ""
        where = {"PATH_INFO": path, "CONTENT_TYPE": _headers(event).get("content-type", "")}
        raise oip.refusal(where, head, receives, size=size, limit=limit)
    try:
        return base64.b64decode(text, validate=True) if binary else text.encode()
    except (binascii.Error, ValueError):
        raise RequestError("the body is not valid base64") from None


def _json_answer(status: int, doc: object, headers: Mapping[str, str] | None = None) -> dict:
    """An HTTP event's answer, in Lambda's proxy form, whose body is ``doc`` as JSON."""
    return {
        "statusCode": status,
        "headers": {"Content-Type": "application/json", **(headers or {})},
        "body": json.dumps(doc),
    }


def _generation_request(event: Any) -> tuple[object, bool] | None:
    """A generation request's JSON and whether it came as an HTTP event: a direct invoke
    holding ``input_ids``, or an HTTP event whose JSON body holds them (a step's tensors come
    as frames or as ``{"inputs": ...}``); None for any other event."""
    if not isinstance(event, dict) or "mopar" in event:
        return None
    if ("input_ids" in event or "text" in event) and "body" not in event:
        return event, False
    text = event.get("body")
    if not isinstance(text, str) or event.get("isBase64Encoded"):
        return None
    if not str(_headers(event).get("content-type", "")).startswith("application/json"):
        return None
    try:
        body = json.loads(text)
    except ValueError:
        return None, True  # refused by the request's own check: no JSON object
    return (
        (body, True) if isinstance(body, dict) and ("input_ids" in body or "text" in body) else None
    )


def _headers(event: dict) -> dict[str, str]:
    """An HTTP event's headers, names lower-cased: a map of names to strings (anything else in
    their place counts as no headers, and a value that is no string as no value)."""
    given = event.get("headers")
    if not isinstance(given, dict):
        return {}
    return {str(k).lower(): v for k, v in given.items() if isinstance(v, str)}


class _Request(SpanClock):
    """One invocation's bookkeeping: its request id, where its client reads the answer, and
    the spans of the functions before it and its own (`mopar.runtime.chains.Span`)."""

    def __init__(self, fn: LambdaFunction, event: Any, http: bool) -> None:
        super().__init__(fn.function.spec.slice, init_ms=fn._take_init())
        self.fn = fn
        given = event.get("mopar") == 1 if isinstance(event, dict) else False
        carried = event if given else {}
        self.client = not carried.get("from")  # not handed on by another function
        headers = _headers(event) if http else {}
        self.headers = headers
        wants_async = bool(carried.get("async")) or headers.get("x-mopar-async") == "1"
        self.facade = self.client and not wants_async
        # who hears of a failure: a client that waits is answered; any other reads the key
        self.delivers_errors = not self.facade
        rid = carried.get("request")
        self.id = rid if isinstance(rid, str) and REQUEST_ID_RE.match(rid) else uuid.uuid4().hex
        self.timing = str(carried.get("timing", "")) if not self.client else ""
        self.before = str(carried.get("invocations", "")) if not self.client else ""


_FUNCTION: LambdaFunction | None = None


def lambda_handler(event: dict, context: Any) -> dict:
    """The Lambda handler: the function is built once per execution environment."""
    global _FUNCTION
    if _FUNCTION is None:
        root = Path(os.environ.get("MOPAR_FUNCTION_DIR") or os.environ.get("LAMBDA_TASK_ROOT", "."))
        _FUNCTION = LambdaFunction(root, os.environ)
    return _FUNCTION(event, context)
