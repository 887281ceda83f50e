"""Mixture-of-experts dispatch: `mopar.runtime.dispatch` (route, combine), a dispatch function
(`SliceFunction._dispatch`) that calls only the expert functions its tokens reached, the expert
functions' checks, and the Lambda handler invoking experts.

One real bundle is compiled per module (``examples.moe:mixtral_tiny``, 2 experts per expert
function): s0, s1 (dispatch) with s1.e0..s1.e3, s2, s3 (dispatch) with s3.e0..s3.e3, s4.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from mopar.bundle.dispatch import DispatchSpec
from mopar.runtime import wire
from mopar.runtime.aws import LambdaFunction
from mopar.runtime.core import RequestError
from mopar.runtime.dispatch import (
    Call,
    DispatchError,
    combine,
    expert_tensors,
    route,
)
from mopar.runtime.frame import decode_payloads, encode_frame, join_frame, split_frame
from mopar.runtime.framed import SliceFunction
from tests.test_lambda import Context

# --- route / combine on hand-made arrays ----------------------------------------------------------


def _spec(
    tokens: int = 3, hidden: int = 4, top_k: int = 2, num_experts: int = 4, groups=((0, 1), (2, 3))
) -> DispatchSpec:
    return DispatchSpec(
        hidden="h",
        index="i",
        weights="w",
        output="o",
        output_shape=(tokens, hidden),
        tokens=tokens,
        hidden_size=hidden,
        top_k=top_k,
        num_experts=num_experts,
        groups=tuple(groups),
        callees=tuple(f"f.e{g}" for g in range(len(groups))),
    )


def _hidden(t: int = 3, h: int = 4) -> np.ndarray:
    return np.arange(t * h, dtype=np.float32).reshape(t, h) + 1.0


def test_route_sends_each_token_to_the_groups_of_its_experts_with_their_gates():
    spec = _spec()
    x = _hidden()
    index = np.array([[1, 3], [0, 1], [1, 0]], dtype=np.int64)
    weights = np.array([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]], dtype=np.float32)
    calls = route(spec, x, index, weights)
    assert [c.function for c in calls] == ["f.e0", "f.e1"]
    e0, e1 = calls
    # token 0 chose experts 1 and 3 with .6/.4: in both calls, gated [0, .6] and [0, .4]
    np.testing.assert_array_equal(e0.rows, [0, 1, 2])
    np.testing.assert_allclose(e0.gates, [[0, 0.6], [0.7, 0.3], [0.5, 0.5]])
    np.testing.assert_array_equal(e0.tokens, x[[0, 1, 2]])
    np.testing.assert_array_equal(e1.rows, [0])
    np.testing.assert_allclose(e1.gates, [[0, 0.4]])
    np.testing.assert_array_equal(e1.tokens, x[[0]])
    assert e0.gates.dtype == np.float32 and e0.tokens.dtype == np.float32


def test_groups_no_token_chose_produce_no_call():
    spec = _spec(num_experts=6, groups=((0, 1), (2, 3), (4, 5)))
    index = np.array([[5, 0], [4, 1], [0, 5]], dtype=np.int64)
    weights = np.full((3, 2), 0.5, dtype=np.float32)
    calls = route(spec, _hidden(), index, weights)
    assert [c.function for c in calls] == ["f.e0", "f.e2"]  # nobody chose 2 or 3
    only_first = route(spec, _hidden(), np.array([[0, 1]] * 3), weights)
    assert [c.function for c in only_first] == ["f.e0"]
    np.testing.assert_array_equal(only_first[0].rows, [0, 1, 2])


def test_combine_of_identity_experts_gives_back_the_weighted_sum():
    """Each expert the identity: a group answers tokens * (its gates' sum); the layer's output is
    then hidden * (each token's weights' sum)."""
    spec = _spec(num_experts=6, groups=((0, 1), (2, 3), (4, 5)))
    x = _hidden()
    index = np.array([[1, 3], [4, 5], [2, 0]], dtype=np.int64)
    weights = np.array([[0.6, 0.4], [0.25, 0.5], [0.1, 0.2]], dtype=np.float32)
    calls = route(spec, x, index, weights)
    answers = [c.tokens * c.gates.sum(axis=1, keepdims=True) for c in calls]
    out = combine(spec, calls, answers, np.dtype(np.float32))
    assert out.shape == (3, 4) and out.dtype == np.float32
    np.testing.assert_allclose(out, x * weights.sum(axis=1, keepdims=True), rtol=1e-6)
    # no call at all: zeros, in the layer's output shape
    assert not combine(spec, [], [], np.dtype(np.float32)).any()


def test_combine_adds_answers_only_into_their_own_rows():
    spec = _spec()
    calls = [
        Call(
            function="f.e0",
            rows=np.array([0, 2]),
            tokens=np.zeros((2, 4), np.float32),
            gates=np.zeros((2, 2), np.float32),
        ),
        Call(
            function="f.e1",
            rows=np.array([2]),
            tokens=np.zeros((1, 4), np.float32),
            gates=np.zeros((1, 2), np.float32),
        ),
    ]
    out = combine(
        spec,
        calls,
        [np.ones((2, 4), np.float32), np.full((1, 4), 2, np.float32)],
        np.dtype(np.float32),
    )
    np.testing.assert_array_equal(out, [[1] * 4, [0] * 4, [3] * 4])


@pytest.mark.parametrize("bad", [4, 7, -1])
def test_an_index_outside_the_layer_is_refused_naming_it(bad):
    spec = _spec()
    index = np.array([[0, 1], [2, bad], [1, 0]], dtype=np.int64)
    with pytest.raises(DispatchError, match=rf"index {bad} .*4 experts"):
        route(spec, _hidden(), index, np.full((3, 2), 0.5, np.float32))


@pytest.mark.parametrize(
    "shapes",
    [
        ((2, 4), (3, 2), (3, 2)),  # too few tokens of hidden states
        ((3, 5), (3, 2), (3, 2)),  # wrong hidden size
        ((3, 4), (3, 3), (3, 2)),  # top-3 indices for a top-2 layer
        ((3, 4), (3, 2), (3, 1)),  # too few weights
    ],
)
def test_tensors_of_the_wrong_size_are_refused(shapes):
    hs, xs, ws = shapes
    with pytest.raises(DispatchError, match="expects 3 tokens"):
        route(_spec(), np.ones(hs, np.float32), np.zeros(xs, np.int64), np.ones(ws, np.float32))


def test_float_indices_are_refused():
    with pytest.raises(DispatchError, match="integers"):
        route(_spec(), _hidden(), np.array([[0.0, 1.0]] * 3), np.full((3, 2), 0.5, np.float32))


def test_an_answer_of_the_wrong_shape_is_refused_naming_its_function():
    spec = _spec()
    calls = route(
        spec, _hidden(), np.array([[1, 3], [0, 1], [1, 0]]), np.full((3, 2), 0.5, np.float32)
    )
    good = np.zeros((3, 4), np.float32)
    for wrong in (np.zeros((2, 4), np.float32), np.zeros((1, 5), np.float32)):
        with pytest.raises(DispatchError, match=r"f\.e1 answered"):
            combine(spec, calls, [good, wrong], np.dtype(np.float32))


def test_dispatch_spec_survives_function_json():
    spec = _spec(num_experts=6, groups=((0, 1), (2, 3), (4, 5)))
    assert DispatchSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


# --- a compiled MoE bundle ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fns(moe_bundle) -> dict[str, SliceFunction]:
    return {
        d.name: SliceFunction(d)
        for d in sorted((moe_bundle / "functions").iterdir())
        if (d / "function.json").is_file()
    }


@pytest.fixture(scope="module")
def path(moe_bundle, fns) -> list[str]:
    """The request path: the plan's functions that are not called ones, in plan order."""
    plan = json.loads((moe_bundle / "plan.json").read_text())["plan"]
    return [f["name"] for f in plan["functions"] if not fns[f["name"]].spec.answers]


@pytest.fixture(scope="module")
def reference(moe_bundle) -> dict[str, np.ndarray]:
    with np.load(moe_bundle / "reference.npz") as z:
        return {k: z[k] for k in z.files}


def _first_frame(fns, path, reference) -> bytes:
    first = fns[path[0]].spec
    return encode_frame({t.name: reference[f"input.{t.name}"] for t in first.receives})


class Recorder:
    """A fork running the called SliceFunctions in-process, recording who got what."""

    def __init__(self, fns: dict[str, SliceFunction]) -> None:
        self.fns = fns
        self.forks: list[list[str]] = []
        self.frames: dict[str, bytes] = {}

    def __call__(self, names: list[str], frames: list[bytes]) -> list[bytes]:
        self.forks.append(list(names))
        out = []
        for name, frame in zip(names, frames):
            self.frames[name] = frame
            out.append(self.fns[name].process(frame)[0])
        return out


@dataclass
class Trace:
    outputs: dict[str, np.ndarray]
    incoming: dict[str, bytes]  # the frame each path function received
    recorders: dict[str, Recorder]  # per dispatch function


@pytest.fixture(scope="module")
def trace(fns, path, reference) -> Trace:
    frame = _first_frame(fns, path, reference)
    incoming: dict[str, bytes] = {}
    recorders: dict[str, Recorder] = {}
    for name in path:
        incoming[name] = frame
        fork = None
        if fns[name].spec.calls:
            fork = recorders[name] = Recorder(fns)
        frame, _ = fns[name].process(frame, fork)
    return Trace(
        outputs=decode_payloads(split_frame(frame)), incoming=incoming, recorders=recorders
    )


def _chosen(fn: SliceFunction, frame: bytes) -> set[int]:
    """The experts some token of this dispatch request chose."""
    spec = fn.spec.dispatch
    index = decode_payloads(split_frame(frame))[spec.index]
    return {int(e) for e in index.ravel()}


def test_bundle_has_the_documented_dispatch_layout(fns, path):
    assert path == ["s0", "s1", "s2", "s3", "s4"]
    for d in ("s1", "s3"):
        spec = fns[d].spec.dispatch
        assert spec is not None and spec.num_experts == 8 and spec.top_k == 2
        assert spec.groups == ((0, 1), (2, 3), (4, 5), (6, 7))
        assert spec.callees == tuple(f"{d}.e{i}" for i in range(4))
        assert [c.slice for c in fns[d].spec.calls] == list(spec.callees)
        for callee in spec.callees:
            assert fns[callee].spec.answers and not fns[callee].spec.last


def test_in_process_chain_matches_the_reference(trace, reference):
    assert list(trace.outputs) == ["output_0"]
    got, want = trace.outputs["output_0"], reference["output.output_0"]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dispatch", ["s1", "s3"])
def test_chain_calls_exactly_the_expert_functions_its_tokens_chose(trace, fns, dispatch):
    fn, rec = fns[dispatch], trace.recorders[dispatch]
    spec = fn.spec.dispatch
    assert len(rec.forks) == 1  # one fork per request
    called = rec.forks[0]
    chosen = _chosen(fn, trace.incoming[dispatch])
    for name in called:  # each call carried at least one token, one gate row per token
        tokens, gates, _ = expert_tensors(name)
        got = decode_payloads(split_frame(rec.frames[name]))
        assert set(got) == {tokens, gates}
        assert got[tokens].shape[0] >= 1 and got[tokens].shape[0] == got[gates].shape[0]
        assert (got[gates] > 0).any(axis=1).all()
    for name, group in zip(spec.callees, spec.groups):
        if name not in called:
            assert not chosen & set(group), f"{name} holds chosen experts but was not called"
    assert called == [n for n, g in zip(spec.callees, spec.groups) if chosen & set(g)]


# --- a hand-made dispatch request -----------------------------------------------------------------


def _dispatch_frame(
    fns, trace, name: str, index: np.ndarray, *, hidden=None, weights=None, drop: str | None = None
) -> bytes:
    """A request for dispatch ``name``: its real incoming tensors, with hidden/index/weights
    replaced."""
    spec = fns[name].spec.dispatch
    payloads = dict(split_frame(trace.incoming[name]))
    rng = np.random.default_rng(0)
    if hidden is None:
        hidden = rng.standard_normal((spec.tokens, spec.hidden_size)).astype(np.float32)
    if weights is None:
        weights = np.full((spec.tokens, spec.top_k), 1.0 / spec.top_k, np.float32)
    payloads[spec.hidden] = wire.encode(hidden)
    payloads[spec.index] = wire.encode(index)
    payloads[spec.weights] = wire.encode(weights)
    if drop:
        del payloads[drop]
    return join_frame(payloads)


@pytest.mark.parametrize(
    "choices, expected",
    [
        ([[0, 1]] * 16, ["s1.e0"]),
        ([[7, 6]] * 16, ["s1.e3"]),
        ([[0, 1]] * 8 + [[6, 2]] * 8, ["s1.e0", "s1.e1", "s1.e3"]),
    ],
)
def test_experts_no_token_reached_are_never_invoked(fns, trace, choices, expected):
    index = np.array(choices, dtype=np.int64)
    rec = Recorder(fns)
    out, _ = fns["s1"].process(_dispatch_frame(fns, trace, "s1", index), rec)
    assert rec.forks == [expected]
    got = decode_payloads(split_frame(out))
    assert list(got) == list(fns["s1"].spec.sends)
    assert all(np.isfinite(v).all() for v in got.values())
    first = decode_payloads(split_frame(rec.frames[expected[0]]))
    tokens, gates, _ = expert_tensors(expected[0])
    n = sum(
        1
        for row in choices
        if set(row)
        & set(fns["s1"].spec.dispatch.groups[fns["s1"].spec.dispatch.callees.index(expected[0])])
    )
    assert first[tokens].shape == (n, 64) and first[gates].shape == (n, 2)


# --- requests at fault: 4xx -----------------------------------------------------------------------


def _fork_all(fns):
    return lambda names, frames: [fns[n].process(f)[0] for n, f in zip(names, frames)]


def _raises_4xx(fn: SliceFunction, frame: bytes, fork=None) -> RequestError:
    with pytest.raises(RequestError) as info:
        fn.process(frame, fork)
    assert 400 <= info.value.status < 500
    return info.value


def test_dispatch_index_out_of_range_is_a_400_naming_it(fns, trace):
    index = np.array([[0, 1]] * 15 + [[99, 1]], dtype=np.int64)
    err = _raises_4xx(fns["s1"], _dispatch_frame(fns, trace, "s1", index), _fork_all(fns))
    assert err.status == 400 and "99" in str(err) and "8 experts" in str(err)


def test_dispatch_negative_index_is_a_400(fns, trace):
    index = np.array([[0, -3]] * 16, dtype=np.int64)
    err = _raises_4xx(fns["s1"], _dispatch_frame(fns, trace, "s1", index), _fork_all(fns))
    assert "-3" in str(err)


def test_dispatch_hidden_states_of_the_wrong_token_count_is_a_400(fns, trace):
    spec = fns["s1"].spec.dispatch
    hidden = np.zeros((spec.tokens - 1, spec.hidden_size), np.float32)
    frame = _dispatch_frame(fns, trace, "s1", np.array([[0, 1]] * 16), hidden=hidden)
    err = _raises_4xx(fns["s1"], frame, _fork_all(fns))
    assert err.status == 400 and spec.hidden in str(err) and "[15, 64]" in str(err)


def test_dispatch_float_indices_are_a_400(fns, trace):
    frame = _dispatch_frame(fns, trace, "s1", np.array([[0.0, 1.0]] * 16, np.float32))
    err = _raises_4xx(fns["s1"], frame, _fork_all(fns))
    assert err.status == 400 and fns["s1"].spec.dispatch.index in str(err)


def test_dispatch_missing_tensor_is_a_400(fns, trace):
    spec = fns["s1"].spec.dispatch
    frame = _dispatch_frame(fns, trace, "s1", np.array([[0, 1]] * 16), drop=spec.weights)
    err = _raises_4xx(fns["s1"], frame, _fork_all(fns))
    assert err.status == 400 and spec.weights in str(err)


@pytest.mark.parametrize("cut", [1, 10, 100])
def test_dispatch_truncated_frame_is_a_400(fns, trace, cut):
    frame = trace.incoming["s1"][:-cut]
    err = _raises_4xx(fns["s1"], frame, _fork_all(fns))
    assert err.status == 400 and "malformed frame" in str(err)


def _expert_frame(name: str, rows: int, gate_rows: int) -> bytes:
    tokens, gates, _ = expert_tensors(name)
    return encode_frame(
        {tokens: np.ones((rows, 64), np.float32), gates: np.full((gate_rows, 2), 0.5, np.float32)}
    )


def test_expert_function_answers_its_tokens(fns):
    out, _ = fns["s1.e2"].process(_expert_frame("s1.e2", 5, 5))
    got = decode_payloads(split_frame(out))
    assert list(got) == [expert_tensors("s1.e2")[2]] and got["s1.e2:out"].shape == (5, 64)


def test_expert_tokens_and_gates_disagreeing_is_a_400_naming_both(fns):
    err = _raises_4xx(fns["s1.e2"], _expert_frame("s1.e2", 5, 4))
    assert err.status == 400 and "5 tokens" in str(err) and "4 rows" in str(err)


@pytest.mark.parametrize("rows", [17, 0])
def test_expert_token_count_outside_one_to_the_request_tokens_is_a_400(fns, rows):
    err = _raises_4xx(fns["s3.e1"], _expert_frame("s3.e1", rows, rows))
    assert err.status == 400 and "expected float32[1..16, 64]" in str(err)


# --- the Lambda handler ---------------------------------------------------------------------------


def _arn(slice_name: str) -> str:
    return f"arn:aws:lambda:eu-west-1:000000000000:function:moe-{slice_name.replace('.', '-')}"


class Lambdas:
    """Dispatch s1 and its experts as Lambda functions, invoking each other in-process with
    Lambda's JSON round trip; ``fail`` names experts whose invoke answers an error."""

    def __init__(
        self, bundle: Path, fail: dict[str, dict] | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.invoked: list[str] = []
        self.events: list[dict] = []
        self.fail = fail or {}
        callees = [f"s1.e{i}" for i in range(4)]
        self.experts = {
            _arn(c): LambdaFunction(bundle / "functions" / c, dict(env or {}), invoke=self.invoke)
            for c in callees
        }
        env = {**(env or {}), "MOPAR_CALLS": ",".join(_arn(c) for c in callees), "MOPAR_NEXT": ""}
        self.dispatch = LambdaFunction(bundle / "functions" / "s1", env, invoke=self.invoke)

    def invoke(self, name: str, event: dict) -> dict:
        self.invoked.append(name)
        self.events.append(event)
        if name in self.fail:
            return self.fail[name]
        answer = self.experts[name](json.loads(json.dumps(event)), Context(name))
        return json.loads(json.dumps(answer))

    def __call__(self, frame: bytes) -> dict:
        event = {"mopar": 1, "frame": base64.b64encode(frame).decode()}
        return json.loads(json.dumps(self.dispatch(event, Context(_arn("s1")))))


def _dense(fns, frame: bytes) -> np.ndarray:
    """What dispatch s1 hands on, computed densely: every expert function on every token, with
    gate 0 for the experts a token did not choose."""
    fn = fns["s1"]
    spec = fn.spec.dispatch
    got = decode_payloads(split_frame(frame))
    x, idx, w = got[spec.hidden], got[spec.index], got[spec.weights]
    experts = np.zeros((spec.tokens, spec.hidden_size), np.float32)
    for name, group in zip(spec.callees, spec.groups):
        gates = np.stack([(w * (idx == e)).sum(axis=1) for e in group], axis=1).astype(np.float32)
        tokens, gate_name, out = expert_tensors(name)
        answer = fns[name].process(encode_frame({tokens: x, gate_name: gates}))[0]
        experts += decode_payloads(split_frame(answer))[out]
    tail = {k: v for k, v in got.items() if k in fn.core.handler.inputs}
    results = fn.core.handler.handle({**tail, spec.output: experts.reshape(spec.output_shape)})
    (sent,) = fn.spec.sends
    return results[sent]


@pytest.mark.parametrize("kind", ["real", "experts 0,1,6,7", "expert 3 only"])
def test_lambda_dispatch_invokes_only_the_needed_experts_and_matches_dense(
    moe_bundle, fns, trace, kind
):
    if kind == "real":
        frame = trace.incoming["s1"]
    elif kind == "experts 0,1,6,7":
        frame = _dispatch_frame(
            fns,
            trace,
            "s1",
            np.array([[0, 7], [6, 1]] * 8, np.int64),
            weights=np.array([[0.8, 0.2], [0.3, 0.7]] * 8, np.float32),
        )
    else:
        frame = _dispatch_frame(fns, trace, "s1", np.array([[3, 2]] * 16, np.int64))
    chosen = _chosen(fns["s1"], frame)
    spec = fns["s1"].spec.dispatch
    needed = [_arn(n) for n, g in zip(spec.callees, spec.groups) if chosen & set(g)]
    lambdas = Lambdas(moe_bundle)
    answer = lambdas(frame)
    assert "error" not in answer, answer
    assert sorted(lambdas.invoked) == sorted(needed)  # invoked side by side: any order
    if kind != "real":
        assert len(needed) < 4
    got = decode_payloads(split_frame(base64.b64decode(answer["frame"])))
    (sent,) = fns["s1"].spec.sends
    assert list(got) == [sent]
    np.testing.assert_allclose(got[sent], _dense(fns, frame), atol=1e-5, rtol=0)
    assert answer["timing"].startswith("s1=")


def test_lambda_expert_error_makes_the_dispatch_answer_an_error_naming_it(moe_bundle, fns, trace):
    bad = _arn("s1.e1")
    lambdas = Lambdas(
        moe_bundle,
        fail={
            bad: {
                "mopar": 1,
                "status": 500,
                "slice": "s1.e1",
                "error": "slice s1.e1 failed: MemoryError",
            }
        },
    )
    frame = _dispatch_frame(fns, trace, "s1", np.array([[0, 2]] * 16, np.int64))
    answer = lambdas(frame)
    assert bad in lambdas.invoked
    assert "frame" not in answer and answer["status"] >= 500, answer
    assert bad in answer["error"] and "MemoryError" in answer["error"]
    assert answer["slice"] == "s1"


def test_lambda_dispatch_request_at_fault_is_a_400(moe_bundle, fns, trace):
    lambdas = Lambdas(moe_bundle)
    answer = lambdas(_dispatch_frame(fns, trace, "s1", np.array([[0, 99]] * 16, np.int64)))
    assert answer["status"] == 400 and "99" in answer["error"]
    assert lambdas.invoked == []


def test_lambda_dispatch_needs_one_mopar_calls_entry_per_expert_function(moe_bundle):
    with pytest.raises(ValueError, match="MOPAR_CALLS names 3"):
        LambdaFunction(
            moe_bundle / "functions" / "s1",
            {"MOPAR_CALLS": ",".join(_arn(f"s1.e{i}") for i in range(3))},
            invoke=lambda name, event: {},
        )
