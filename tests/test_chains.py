"""Chain modes: how a request travels from function to function, and who waits for whom.

Each mode runs for real here: the Lambda handlers of the ``event`` mode hand on by ``Event``
invokes played by a thread (the JSON round trip and the 1 MB limit of Lambda's queue) and leave
the answer in a real redis-server; the function servers of the ``callback`` mode run on
127.0.0.1 ports of their own, hand on through the runner's emulation of the gateway's queue and
POST the answer to a real callback server; `mopar run`'s runner emulates each mode with the
bundle's own functions. Every answer is compared with the unsplit model's reference output.
"""

from __future__ import annotations

import base64
import json
import threading
from dataclasses import replace

import pytest

from mopar.bundle.document import read_document
from mopar.config import RunConfig
from mopar.errors import BundleError
from mopar.runner.bundle import read_manifest, read_reference
from mopar.runner.check import compare_outputs
from mopar.runner.local import run_bundles
from mopar.runtime.aws import EVENT_LIMIT_BYTES, LambdaFunction
from mopar.runtime.chains import HANDLER, MODES, SERVER, counterpart, mode_for, parse_spans
from mopar.runtime.frame import decode_payloads, encode_frame, split_frame
from mopar.runtime.rendezvous import RedisRendezvous
from mopar.runtime.server import app_from_env, create_function_server
from mopar.runtime.transports import HttpClient
from mopar.target import target_or_default
from mopar.targets.openfaas.emulate import Gateway
from tests.conftest import needs_redis
from tests.test_lambda import Context

PATH = ["s0", "s1", "s2"]


def _matches(frame: bytes, expected: dict) -> None:
    got = decode_payloads(split_frame(frame))
    assert compare_outputs(got, expected).max_rel_err <= 1e-5


# --- the modes themselves -------------------------------------------------------------------------


def test_a_mode_of_another_door_is_refused_in_one_line_naming_the_offered_ones():
    with pytest.raises(ValueError) as err:
        mode_for("callback", HANDLER)
    assert "\n" not in str(err.value)
    assert "is a chain mode of the function server" in str(err.value)
    assert "the Lambda handler runs one of ['invoke', 'stepfunctions', 'event']" in str(err.value)
    with pytest.raises(ValueError, match="is not a chain mode"):
        mode_for("carrier-pigeon", SERVER)


def test_each_target_offers_its_own_doors_modes_its_default_first():
    openfaas, lam = target_or_default("openfaas"), target_or_default("lambda")
    assert [m.name for m in openfaas.chain_modes()] == ["http", "callback", "shm"]
    assert [m.name for m in lam.chain_modes()] == ["invoke", "stepfunctions", "event"]
    assert {m.door for m in openfaas.chain_modes()} == {SERVER}
    assert {m.door for m in lam.chain_modes()} == {HANDLER}


def test_each_mode_has_a_counterpart_on_the_other_target():
    openfaas, lam = target_or_default("openfaas"), target_or_default("lambda")
    pairs = {
        n: counterpart(m, (lam if m in openfaas.chain_modes() else openfaas).chain_modes()).name
        for n, m in MODES.items()
    }
    assert pairs == {
        "invoke": "http",
        "stepfunctions": "http",
        "event": "callback",
        "http": "invoke",
        "callback": "event",
        "shm": "invoke",
    }


# --- Lambda: event ------------------------------------------------------------------------------


def _event_chain(bundle, env: dict[str, str], events: list) -> dict[str, LambdaFunction]:
    """The three handlers; an ``Event`` invoke is queued: answered at once, run on a thread
    after a JSON round trip, refused over Lambda's 1 MB."""
    fns: dict[str, LambdaFunction] = {}
    threads: list[threading.Thread] = []

    def invoke_async(name: str, event: dict) -> None:
        payload = json.dumps(event).encode()
        assert len(payload) <= EVENT_LIMIT_BYTES, "Lambda refuses an Event payload over 1 MB"
        events.append(json.loads(payload))
        t = threading.Thread(target=fns[name], args=(json.loads(payload), Context(name)))
        t.start()
        threads.append(t)

    for i in (2, 1, 0):
        fenv = {**env, "MOPAR_CHAIN": "event", "MOPAR_NEXT": f"s{i + 1}" if i < 2 else ""}
        fns[f"s{i}"] = LambdaFunction(
            bundle / "functions" / f"s{i}", fenv, invoke_async=invoke_async
        )
    fns["threads"] = threads  # type: ignore[assignment]
    return fns


def test_event_chain_answers_a_waiting_client_through_the_rendezvous(skipnet_bundle, redis_url):
    import redis

    inputs, expected = read_reference(skipnet_bundle / "reference.npz")
    events: list[dict] = []
    fns = _event_chain(skipnet_bundle, {"REDIS_URL": redis_url}, events)
    frame = base64.b64encode(encode_frame(inputs)).decode()
    answer = fns["s0"]({"mopar": 1, "frame": frame}, Context("s0"))
    assert "error" not in answer, answer
    _matches(base64.b64decode(answer["frame"]), expected)
    assert [e["from"] for e in events] == ["s0", "s1"]  # each handed on by an Event invoke
    assert len({e["request"] for e in events}) == 1
    spans = parse_spans(answer["invocations"])
    assert [s.function for s in spans] == PATH
    assert spans[0].wait_ms > 0  # the entry waited on the rendezvous: its facade's cost
    assert spans[1].wait_ms == spans[2].wait_ms == 0  # the others returned once handed on
    assert [s.init_ms > 0 for s in spans] == [True] * 3  # each instance's first request
    for t in fns["threads"]:
        t.join(10)
    assert redis.Redis.from_url(redis_url).dbsize() == 0  # the answer was read, then deleted


def test_event_chain_returns_the_request_id_and_the_client_reads_the_answer(
    skipnet_bundle, redis_url
):
    inputs, expected = read_reference(skipnet_bundle / "reference.npz")
    fns = _event_chain(skipnet_bundle, {"REDIS_URL": redis_url}, [])
    frame = base64.b64encode(encode_frame(inputs)).decode()
    answer = fns["s0"]({"mopar": 1, "frame": frame, "async": True, "request": "r-1"}, Context("s0"))
    assert answer == {"mopar": 1, "request": "r-1", "handed_on": "s1"}
    got = RedisRendezvous(redis_url).wait("r-1", 30)
    assert got is not None and got.status == 200 and got.slice == "s2"
    _matches(got.frame, expected)
    assert [s.function for s in parse_spans(got.spans)] == PATH


def test_event_chain_delivers_a_failure_so_the_reader_does_not_wait_it_out(
    skipnet_bundle, redis_url
):
    fns = _event_chain(skipnet_bundle, {"REDIS_URL": redis_url}, [])
    bad = base64.b64encode(b"not a frame").decode()
    answer = fns["s0"]({"mopar": 1, "frame": bad, "async": True, "request": "r-2"}, Context("s0"))
    assert answer["status"] == 400
    got = RedisRendezvous(redis_url).wait("r-2", 5)
    assert got is not None and got.status == 400 and "malformed frame" in got.error


def test_event_mode_without_redis_is_refused_in_one_line(skipnet_bundle):
    with pytest.raises(ValueError) as err:
        LambdaFunction(skipnet_bundle / "functions" / "s0", {"MOPAR_CHAIN": "event"})
    assert "\n" not in str(err.value) and "REDIS_URL" in str(err.value)
    assert "RedisUrl" in str(err.value)


def test_a_lambda_function_refuses_an_openfaas_mode(skipnet_bundle):
    with pytest.raises(
        ValueError, match="MOPAR_CHAIN=callback is a chain mode of the function server"
    ):
        LambdaFunction(skipnet_bundle / "functions" / "s0", {"MOPAR_CHAIN": "callback"})


# --- OpenFaaS: callback -------------------------------------------------------------------------


class _Listening:
    """A function server on a free 127.0.0.1 port, in a thread of this process."""

    def __init__(self, app) -> None:
        self.server = create_function_server(
            app, host="127.0.0.1", port=0, threads=8, max_body=app.max_body
        )
        self.url = f"http://127.0.0.1:{self.server.effective_port}"
        app.callback_base = self.url
        threading.Thread(target=self.server.run, daemon=True).start()

    def close(self) -> None:
        self.server.close()
        self.server.task_dispatcher.shutdown()


@pytest.fixture
def callback_chain(skipnet_bundle):
    """The three servers in ``callback`` mode, handing on through the gateway's queue."""
    queue = Gateway(workers=4, timeout_s=30)
    servers = {}
    try:
        for i in (2, 1, 0):
            env = {
                "MOPAR_FUNCTION_DIR": str(skipnet_bundle / "functions" / f"s{i}"),
                "MOPAR_CHAIN": "callback",
                "MOPAR_TRANSPORT": "http",
                "MOPAR_NEXT": queue.url_of(f"s{i + 1}") if i < 2 else "",
                "MOPAR_TIMEOUT_S": "30",
            }
            servers[f"s{i}"] = _Listening(app_from_env(env))
            queue.add(f"s{i}", servers[f"s{i}"].url)
        yield servers, queue
    finally:
        for s in servers.values():
            s.close()
        queue.close()


def test_callback_chain_posts_the_answer_to_the_clients_callback_url(
    skipnet_bundle, callback_chain
):
    servers, queue = callback_chain
    inputs, expected = read_reference(skipnet_bundle / "reference.npz")
    receiver = Gateway(workers=1, timeout_s=30)
    try:
        answer = HttpClient(servers["s0"].url).post(
            encode_frame(inputs),
            {"X-Callback-Url": receiver.expect("q-1"), "X-Mopar-Request": "q-1"},
        )
        assert answer.status == 202 and answer.json()["request"] == "q-1"
        got = receiver.wait("q-1", 30)
    finally:
        receiver.close()
    assert got is not None and got.status == 200, got
    _matches(got.frame, expected)
    spans = parse_spans(got.spans)
    assert [s.function for s in spans] == PATH
    assert all(s.wait_ms == 0 for s in spans)  # nobody waited for the rest of the chain
    assert [t.split("=")[0] for t in got.timing.split(",")] == PATH
    assert queue.failures == []


def test_callback_chain_offers_a_synchronous_facade_without_a_callback_url(
    skipnet_bundle, callback_chain
):
    servers, _ = callback_chain
    inputs, expected = read_reference(skipnet_bundle / "reference.npz")
    answer = HttpClient(servers["s0"].url).post(encode_frame(inputs), {})
    assert answer.status == 200, answer.error()
    _matches(answer.body, expected)
    spans = parse_spans(answer.headers["x-mopar-invocations"])
    assert [s.function for s in spans] == PATH
    assert spans[0].wait_ms > 0 and spans[1].wait_ms == 0  # the facade waited, the rest not


def test_callback_chain_posts_a_failure_to_the_callback_url(callback_chain):
    servers, _ = callback_chain
    receiver = Gateway(workers=1, timeout_s=30)
    try:
        answer = HttpClient(servers["s0"].url).post(
            b"garbage", {"X-Callback-Url": receiver.expect("q-2"), "X-Mopar-Request": "q-2"}
        )
        got = receiver.wait("q-2", 10)
    finally:
        receiver.close()
    assert answer.status == 400
    assert got is not None and got.status == 400 and "malformed frame" in got.error


def test_a_function_server_refuses_a_lambda_mode(skipnet_bundle):
    env = {"MOPAR_FUNCTION_DIR": str(skipnet_bundle / "functions" / "s0"), "MOPAR_CHAIN": "event"}
    with pytest.raises(ValueError, match="MOPAR_CHAIN=event is a chain mode of the Lambda handler"):
        app_from_env(env)


# --- mopar run: the runner emulates the bundle's mode ---------------------------------------------


def _with_chain(bundle, chain: str, target: str):
    """The bundle at ``bundle`` recompiled, as far as the runner sees, for ``chain``."""
    doc = read_document(bundle)
    replace(doc, plan={**doc.plan, "chain": chain, "target": target}).write(bundle)
    return read_manifest(bundle)


@pytest.mark.parametrize(
    "chain, target, transport",
    [
        pytest.param("event", "lambda", "http", marks=needs_redis),
        ("callback", "openfaas", "shm"),
        ("stepfunctions", "lambda", "http"),
    ],
)
def test_run_serves_each_mode_with_outputs_equal_to_the_model(
    bundle_copy, chain, target, transport
):
    manifest = _with_chain(bundle_copy, chain, target)
    inputs, expected = read_reference(bundle_copy / "reference.npz")
    report = run_bundles(
        [manifest],
        inputs,
        config=RunConfig(requests=3, concurrency=2, timeout_s=60),
        expected=expected,
        transport=transport,
    )[0]
    assert report.errors == 0, report.error_messages
    assert report.comparison.passed and report.chain == chain
    assert len(report.served) == 3
    for served in report.served:
        assert [s.function for s in served.invocations] == PATH
        assert all(s.wait_ms == 0 for s in served.invocations)  # in these modes nobody waits


def test_shm_runner_bills_the_waits_of_a_synchronous_chain_and_not_of_stepfunctions(bundle_copy):
    inputs, expected = read_reference(bundle_copy / "reference.npz")
    waits = {}
    for chain in ("invoke", "stepfunctions"):
        manifest = _with_chain(bundle_copy, chain, "lambda")
        report = run_bundles(
            [manifest], inputs, config=RunConfig(requests=2), expected=expected, transport="shm"
        )[0]
        assert report.errors == 0 and report.comparison.passed and report.chain == chain
        waits[chain] = [[s.wait_ms for s in r.invocations] for r in report.served]
    for s0, s1, s2 in waits["invoke"]:  # each waits for the rest of the path
        assert s0 > s1 > 0 and s2 < s1
    assert all(w == 0 for r in waits["stepfunctions"] for w in r)


def test_a_bundle_naming_an_unknown_mode_is_refused_in_one_line(bundle_copy):
    manifest = _with_chain(bundle_copy, "smoke-signals", "lambda")
    inputs, _ = read_reference(bundle_copy / "reference.npz")
    with pytest.raises(BundleError) as err:
        run_bundles([manifest], inputs, config=RunConfig(requests=1))[0]
    assert "\n" not in str(err.value) and "recompile" in str(err.value)


def test_event_chain_answers_an_async_http_client_202_with_the_request_id(
    skipnet_bundle, redis_url
):
    inputs, expected = read_reference(skipnet_bundle / "reference.npz")
    fns = _event_chain(skipnet_bundle, {"REDIS_URL": redis_url}, [])
    event = {
        "version": "2.0",
        "headers": {"content-type": "application/octet-stream", "X-Mopar-Async": "1"},
        "body": base64.b64encode(encode_frame(inputs)).decode(),
        "isBase64Encoded": True,
    }
    answer = fns["s0"](event, Context("s0"))
    assert answer["statusCode"] == 202, answer
    got = RedisRendezvous(redis_url).wait(json.loads(answer["body"])["request"], 30)
    assert got is not None and got.status == 200
    _matches(got.frame, expected)


@pytest.mark.slow
@pytest.mark.parametrize("chain, target", [("event", "lambda"), ("callback", "openfaas")])
def test_run_serves_a_mixture_of_experts_bundle_asynchronously(moe_bundle, tmp_path, chain, target):
    """Expert functions are called synchronously by their dispatch in every mode: they answer
    it, and only the path's functions hand on asynchronously."""
    import shutil

    bundle = tmp_path / "moe"
    shutil.copytree(moe_bundle, bundle)
    manifest = _with_chain(bundle, chain, target)
    inputs, expected = read_reference(bundle / "reference.npz")
    report = run_bundles(
        [manifest],
        inputs,
        config=RunConfig(requests=2, timeout_s=60),
        expected=expected,
        transport="http",
    )[0]
    assert report.errors == 0, report.error_messages
    assert report.comparison.passed and len(report.served) == 2
    called = {s.name for s in manifest.slices if s.called}
    for served in report.served:
        names = [s.function for s in served.invocations]
        assert [n for n in names if n not in called] == [
            s.name for s in manifest.slices if not s.called
        ]
        assert called & set(names)  # the experts' own spans ride with their dispatch's


def test_shm_runner_bills_each_instances_start_with_its_first_request(skipnet_bundle):
    inputs, expected = read_reference(skipnet_bundle / "reference.npz")
    report = run_bundles(
        [read_manifest(skipnet_bundle)],
        inputs,
        config=RunConfig(requests=2, start_cold=True),
        expected=expected,
    )[0]
    assert report.errors == 0
    first, second = report.served
    assert first.cold_starts == 3 and second.cold_starts == 0
    assert all(s.init_ms > 0 for s in first.invocations)
