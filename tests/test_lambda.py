"""The Lambda entry point, invoked with Lambda's event and context contract.

AWS itself is out of reach here, so a function's synchronous invoke of the next one is played by
`_invoke`: it serialises the event to JSON and back (what Lambda's Invoke API does to a payload),
refuses payloads over Lambda's 6 MB limit, and calls the next function's handler. Redis handoffs
go through a real redis-server on loopback.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass

import numpy as np
import pytest

from mopar.runner.bundle import read_reference
from mopar.runner.check import compare_outputs
from mopar.runtime import aws
from mopar.runtime.aws import INVOKE_LIMIT_BYTES, LambdaFunction
from mopar.runtime.frame import decode_payloads, encode_frame, split_frame


@dataclass
class Context:
    """The attributes of Lambda's context object that a handler may read."""

    function_name: str
    aws_request_id: str = "00000000-0000-0000-0000-000000000000"
    memory_limit_in_mb: int = 128

    def get_remaining_time_in_millis(self) -> int:
        return 30_000


def _chain(bundle, env: dict[str, str], events: list | None = None) -> list[LambdaFunction]:
    """Three functions, each invoking the next through `_invoke`; ``events`` records payloads."""
    fns: dict[str, LambdaFunction] = {}

    def invoke(name: str, event: dict) -> dict:
        payload = json.dumps(event).encode()
        assert len(payload) <= INVOKE_LIMIT_BYTES, "Lambda refuses a payload over 6 MB"
        if events is not None:
            events.append(json.loads(payload))
        return json.loads(json.dumps(fns[name](json.loads(payload), Context(name))))

    for i in (2, 1, 0):
        fenv = {**env, "MOPAR_NEXT": f"fn-s{i + 1}" if i < 2 else ""}
        fns[f"fn-s{i}"] = LambdaFunction(bundle / "functions" / f"s{i}", fenv, invoke=invoke)
    return [fns[f"fn-s{i}"] for i in range(3)]


def _http_event(frame: bytes) -> dict:
    """A Function URL / API Gateway HTTP API (payload 2.0) event carrying a binary body."""
    return {
        "version": "2.0",
        "rawPath": "/",
        "headers": {
            "content-type": "application/octet-stream",
            "accept": "application/octet-stream",
        },
        "requestContext": {"http": {"method": "POST"}},
        "body": base64.b64encode(frame).decode(),
        "isBase64Encoded": True,
    }


def _check_http_answer(answer: dict, expected: dict) -> None:
    assert answer["statusCode"] == 200, answer["body"]
    got = decode_payloads(split_frame(base64.b64decode(answer["body"])))
    assert compare_outputs(got, expected).max_rel_err <= 1e-5
    assert [t.split("=")[0] for t in answer["headers"]["X-Mopar-Timing"].split(",")] == [
        "s0",
        "s1",
        "s2",
    ]


def test_function_url_event_runs_the_chain_by_direct_invokes(skipnet_bundle):
    inputs, expected = read_reference(skipnet_bundle / "reference.npz")
    events: list[dict] = []
    first = _chain(skipnet_bundle, {}, events)[0]
    _check_http_answer(first(_http_event(encode_frame(inputs)), Context("fn-s0")), expected)
    assert [sorted(e) for e in events] == [["frame", "mopar"]] * 2  # small: inline
    unasked = _http_event(encode_frame(inputs))
    del unasked["headers"]["accept"]  # a client that asks nothing gets JSON, not a frame
    answer = first(unasked, Context("fn-s0"))
    assert answer["headers"]["Content-Type"] == "application/json" and not answer["isBase64Encoded"]
    got = {k: np.asarray(v, np.float32) for k, v in json.loads(answer["body"])["outputs"].items()}
    assert compare_outputs(got, expected).max_rel_err <= 1e-5


def test_frames_over_the_invoke_limit_go_through_redis_and_leave_no_key(skipnet_bundle, redis_url):
    import redis

    inputs, expected = read_reference(skipnet_bundle / "reference.npz")
    events: list[dict] = []
    env = {"REDIS_URL": redis_url, "MOPAR_INLINE_MAX_BYTES": "1500"}  # a small stand-in for 6 MB
    first = _chain(skipnet_bundle, env, events)[0]
    _check_http_answer(first(_http_event(encode_frame(inputs)), Context("fn-s0")), expected)
    assert [sorted(e) for e in events] == [["mopar", "ref"]] * 2
    assert all(e["ref"].startswith("redis:mopar:") for e in events)
    assert redis.Redis.from_url(redis_url).dbsize() == 0  # every frame taken once, then deleted


def test_a_frame_over_the_limit_without_redis_fails_with_the_fix(skipnet_bundle):
    inputs, _ = read_reference(skipnet_bundle / "reference.npz")
    first = _chain(skipnet_bundle, {"MOPAR_INLINE_MAX_BYTES": "1500"})[0]
    answer = first(
        {"mopar": 1, "frame": base64.b64encode(encode_frame(inputs)).decode()}, Context("fn-s0")
    )
    assert answer["status"] == 502 and "REDIS_URL" in answer["error"]


def test_step_functions_mode_answers_instead_of_invoking(skipnet_bundle, redis_url):
    """The state machine's Task states pass each answer ($.Payload) to the next function."""
    inputs, expected = read_reference(skipnet_bundle / "reference.npz")
    env = {"MOPAR_CHAIN": "stepfunctions", "REDIS_URL": redis_url}
    state = {"mopar": 1, "frame": base64.b64encode(encode_frame(inputs)).decode()}
    for fn in _chain(skipnet_bundle, env):
        state = json.loads(json.dumps(fn(state, Context(fn.function.spec.slice))))
        assert "error" not in state, state
    got = decode_payloads(split_frame(base64.b64decode(state["frame"])))
    assert compare_outputs(got, expected).max_rel_err <= 1e-5


@pytest.mark.parametrize(
    "event, status, words",
    [
        ({"mopar": 1, "frame": "%%% not base64 %%%"}, 400, "not valid base64"),
        ({"mopar": 7, "frame": ""}, 400, "format 7 is not supported"),
        ({"mopar": 1}, 400, "has no frame"),
        ({"mopar": 1, "frame": base64.b64encode(b"garbage").decode()}, 400, "malformed frame"),
        ({"mopar": 1, "ref": "redis:mopar:" + "0" * 32}, 400, "no REDIS_URL"),
        ({"mopar": 1, "frame": "A" * 10_000_000}, 413, "exceeds"),
    ],
)
def test_bad_events_get_a_4xx_answer_not_a_crash(skipnet_bundle, event, status, words):
    last = _chain(skipnet_bundle, {})[2]
    answer = last(event, Context("fn-s2"))
    assert answer["status"] == status and words in answer["error"], answer


def test_http_event_with_a_text_body_is_refused_as_json_400(skipnet_bundle):
    first = _chain(skipnet_bundle, {})[0]
    answer = first({"version": "2.0", "body": "hello", "isBase64Encoded": False}, Context("fn-s0"))
    assert answer["statusCode"] == 400
    assert "binary frame" in json.loads(answer["body"])["error"]


def test_module_handler_reads_its_folder_from_the_environment(skipnet_bundle, monkeypatch):
    """``mopar.runtime.aws.lambda_handler`` is the image's CMD; the last slice answers alone."""
    monkeypatch.setenv("MOPAR_FUNCTION_DIR", str(skipnet_bundle / "functions" / "s2"))
    monkeypatch.delenv("MOPAR_NEXT", raising=False)
    monkeypatch.setattr(aws, "_FUNCTION", None)
    spec = aws.LambdaFunction(skipnet_bundle / "functions" / "s2", {}).function.spec
    frame = encode_frame({t.name: np.ones(t.shape, t.dtype) for t in spec.receives})
    answer = aws.lambda_handler(
        {"mopar": 1, "frame": base64.b64encode(frame).decode()}, Context("fn-s2")
    )
    out = decode_payloads(split_frame(base64.b64decode(answer["frame"])))
    assert list(out) == ["output_0"] and answer["timing"].startswith("s2=")
    assert aws._FUNCTION is not None  # built once, reused by the next invocation


def test_the_entry_warms_up_the_rest_at_its_init_and_again_after_an_idle_spell(bundle_copy):
    import threading

    from mopar.bundle.function import FunctionSpec

    entry_dir = bundle_copy / "functions" / "s0"  # as a Lambda plan's entry names them
    spec = FunctionSpec.load(entry_dir)
    dataclasses.replace(spec, prewarms=("s1", "s2")).write(entry_dir)
    skipnet_bundle = bundle_copy
    inputs, _ = read_reference(skipnet_bundle / "reference.npz")
    sent: list[tuple[str, dict]] = []
    two = threading.Semaphore(0)

    def record(name: str, event: dict) -> None:
        sent.append((name, event))
        two.release()

    fns = _chain(skipnet_bundle, {})  # the rest of the chain, warm
    entry = LambdaFunction(
        skipnet_bundle / "functions" / "s0",
        {"MOPAR_NEXT": "fn-s1", "MOPAR_PREWARM": "fn-s1,fn-s2"},
        invoke=lambda name, event: {"fn-s1": fns[1]}[name](event, Context(name)),
        invoke_async=record,
    )
    assert two.acquire(timeout=30) and two.acquire(timeout=30)  # sent as its INIT began
    warm_up = {"mopar": 1, "warm": True}
    assert sent == [("fn-s1", warm_up), ("fn-s2", warm_up)]
    assert fns[1](warm_up, Context("fn-s1"))["warm"] is True  # answered at once
    frame = encode_frame({k: inputs[k] for k in inputs})
    event = {"mopar": 1, "frame": base64.b64encode(frame).decode()}
    now = [entry.warmer.clock()]
    entry.warmer.clock = lambda: now[0]
    assert "error" not in entry(event, Context("fn-s0")) and len(sent) == 2  # warm still
    now[0] += entry.warmer.keep_s + 1  # an idle spell: the rest may have been reclaimed
    assert "error" not in entry(event, Context("fn-s0"))
    assert two.acquire(timeout=30) and two.acquire(timeout=30) and len(sent) == 4
    with pytest.raises(ValueError, match="pre-warms 2 functions, but MOPAR_PREWARM names 1"):
        LambdaFunction(skipnet_bundle / "functions" / "s0", {"MOPAR_PREWARM": "fn-s1"})
