"""Horizontal sub-slices end to end: planned with --parallel, compiled into sub-slice and join
functions, run as concurrent processes (shm) and as forking function servers (http), equal to
the model; a failing sub-slice fails the request cleanly."""

from __future__ import annotations

import base64
import json
import shutil

import pytest

from mopar.bundle.function import FunctionSpec
from mopar.config import RunConfig
from mopar.errors import RuntimeFailure
from mopar.runner.bundle import read_manifest, read_reference
from mopar.runner.chain import ChainSession
from mopar.runner.check import compare_outputs
from mopar.runner.local import run_bundles
from mopar.runtime.frame import decode_payloads, encode_frame, split_frame
from mopar.runtime.transports import HttpClient
from tests.conftest import SKIPNET_INPUT, faulty, mopar, mopar_in_process, new_shm_runs, shm_runs

UNITS = ["s0.p0", "s0.p1", "s0", "s1.0.p0", "s1.0.p1", "s1.0", "s1.1.p0", "s1.1.p1", "s1"]


def _compile(out, *more: str) -> dict:
    proc = mopar_in_process(
        "compile",
        "tests.models:skipnet",
        "--input",
        SKIPNET_INPUT,
        "--slices",
        "2",
        "--strategy",
        "uniform",
        "--out",
        out,
        *more,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads((out / "plan.json").read_text())


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """SkipNet in 2 slices, each run as 2 parameter-sharded sub-slices and a join."""
    out = tmp_path_factory.mktemp("sharded") / "bundle"
    return out, _compile(out, "--parallel", "2", "--force-parallel")


def test_plan_lists_sub_slices_then_their_join_with_half_the_weights(sharded):
    _, doc = sharded
    slices = doc["plan"]["functions"]
    # s1 (mid1, mid2, head) takes two fork-join stages: mid1 -> tanh ends the first region
    assert [(s["name"], s["kind"], s["parallel"]) for s in slices] == [
        ("s0.p0", "shard", 2),
        ("s0.p1", "shard", 2),
        ("s0", "join", 2),
        ("s1.0.p0", "shard", 2),
        ("s1.0.p1", "shard", 2),
        ("s1.0", "join", 2),
        ("s1.1.p0", "shard", 2),
        ("s1.1.p1", "shard", 2),
        ("s1", "join", 2),
    ]
    assert all(s["layers"] == [] for s in slices if s["kind"] == "shard")
    # the edges fan out to the sub-slices and back in to their join, exactly as the units run
    edges = {(e["src"], e["dst"]) for e in doc["plan"]["edges"]}
    assert {("s0.p0", "s0"), ("s0.p1", "s0"), ("s1.1.p0", "s1"), ("s1.1.p1", "s1")} <= edges
    assert ("<request>", "s0.p0") in edges and ("s1", "<response>") in edges
    assert [la for s in slices for la in s["layers"]] == ["stem", "act", "mid1", "mid2", "head"]
    # stem (3->8 conv) is sharded by output channels: each sub-slice holds half its weights
    stem_bytes = (8 * 3 * 3 * 3 + 8) * 4
    assert [s["param_bytes"] for s in slices[:2]] == [stem_bytes // 2] * 2
    assert doc["verification"]["max_rel_err"] <= 1e-5


@pytest.mark.parametrize("transport", ["shm", "http"])
def test_sharded_bundle_reproduces_the_model(sharded, transport):
    out, _ = sharded
    inputs, expected = read_reference(out / "reference.npz")
    report = run_bundles(
        [read_manifest(out)],
        inputs,
        config=RunConfig(requests=3, concurrency=2),
        expected=expected,
        transport=transport,
    )[0]
    assert report.errors == 0, report.error_messages
    assert report.max_rel_err <= 1e-5
    assert [s.name for s in report.slices] == UNITS
    assert all(s.p50_ms is not None for s in report.slices)  # every sub-slice served


def test_join_spec_carries_its_sub_slices_and_forks_them(sharded):
    out, _ = sharded
    join = FunctionSpec.load(out / "functions" / "s1")
    assert [x.slice for x in join.calls] == ["s1.1.p0", "s1.1.p1"]
    assert all(x.answers and not x.last for x in join.calls)
    parts = {v for x in join.calls for v in x.sends}
    assert parts and all(":p" in v for v in parts)
    assert not parts & {t.name for t in join.receives}  # parts come from the fork, not upstream


def _plan(analysis, parallel: int, force: bool):
    from mopar import api
    from mopar.config import CompileConfig

    config = CompileConfig(slices=2, strategy="uniform", parallel=parallel, force_parallel=force)
    return api.plan_from(analysis, config, api.predict(analysis.layers, config))


@pytest.mark.parametrize(
    "parallel, etas",
    [
        (1, {1}),  # 1: off
        (4, {4}),  # 8 channels split 4 ways
        (3, {2}),  # 3 does not divide 8: the largest below
    ],
)
def test_parallel_caps_eta(skipnet_analysis, parallel, etas):
    assert {s.parallel for s in _plan(skipnet_analysis, parallel, True).functions} == etas


def test_without_force_eta_above_1_needs_a_predicted_gain(skipnet_analysis):
    plan = _plan(skipnet_analysis, 2, False)
    assert {s.parallel for s in plan.functions} == {
        1
    }  # tiny convs: a fork costs more than it saves
    assert sum("η = 1" in n for n in map(str, plan.notes)) == 2


def test_a_failing_sub_slice_fails_the_request_cleanly(sharded, tmp_path):
    out, _ = sharded
    bundle = tmp_path / "bundle"
    shutil.copytree(out, bundle)
    env = faulty(
        tmp_path / "faults",
        {
            "s1.0.p1": """
            class SliceHandler:
                inputs: dict = {}  # the slice's input names (the handler's contract)

                def __init__(self, function_dir, *, intra_op_threads=0):
                    pass
                def handle(self, inputs):
                    raise RuntimeError("sub-slice exploded")
            """
        },
    )
    before = shm_runs()
    proc = mopar("run", bundle, "--requests", "2", "--timeout", "60", env=env)
    assert proc.returncode == 1
    assert "s1.0.p1" in proc.stderr and "sub-slice exploded" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert new_shm_runs(before) == set()


def test_an_unreachable_sub_slice_server_is_a_502_naming_it(sharded):
    out, _ = sharded
    inputs, _ = read_reference(out / "reference.npz")
    session = ChainSession(read_manifest(out), RunConfig(), transport="http")
    try:
        session.start()
        victim = next(s for s in session.servers if s.name == "s0.p1")
        victim.stop()
        answer = HttpClient(session.servers[2].url, timeout_s=60).post(encode_frame(inputs), {})
    finally:
        session.stop()
    assert answer.status == 502
    assert "function s0.p1" in answer.error() and "unreachable" in answer.error()


def test_no_sub_slice_process_outlives_a_failed_start(sharded, tmp_path):
    out, _ = sharded
    bundle = tmp_path / "bundle"
    shutil.copytree(out, bundle)
    (bundle / "functions" / "s1.1.p0" / "model.onnx").write_bytes(b"not onnx")
    session = ChainSession(read_manifest(bundle), RunConfig(timeout_s=60), transport="http")
    with pytest.raises(RuntimeFailure, match="s1.1.p0"):
        session.start()
    session.stop()
    assert session.servers, "the servers started before the failure are known"
    assert all(s.proc.poll() is not None for s in session.servers)


def test_deployment_files_give_one_function_per_sub_slice_and_fork_from_the_join(sharded, tmp_path):
    import yaml

    from tests.test_sam import _lints_clean, lambda_template_of

    out, _ = sharded
    stack = yaml.safe_load((out / "stack.yml").read_text())["functions"]
    assert list(stack) == ["skipnet-" + u.replace(".", "-") for u in UNITS]
    env = {name: fn["environment"] for name, fn in stack.items()}
    assert env["skipnet-s0-p0"]["MOPAR_NEXT"] == "" and "MOPAR_CALLS" not in env["skipnet-s0-p0"]
    assert "skipnet-s1-0" in env["skipnet-s0"]["MOPAR_NEXT"]  # the next stage's join
    urls = env["skipnet-s1"]["MOPAR_CALLS"].split(",")
    assert len(urls) == 2 and all(f"skipnet-s1-1-p{k}" in u for k, u in enumerate(urls))
    template = lambda_template_of(out, tmp_path / "template.yaml")  # the same plan for Lambda
    join = template["Resources"]["SkipnetS0"]["Properties"]
    assert join["Environment"]["Variables"]["MOPAR_CALLS"] == {
        "Fn::Join": [",", [{"Ref": "SkipnetS0P0"}, {"Ref": "SkipnetS0P1"}]]
    }
    assert join["Environment"]["Variables"]["MOPAR_NEXT"] == {"Ref": "SkipnetS10"}
    # both sub-slices and the next stage; planned for OpenFaaS, whose replicas are kept, the
    # entry warms up nothing
    entry = json.loads((out / "functions" / "s0" / "function.json").read_text())
    assert "prewarms" not in entry and "MOPAR_PREWARM" not in join["Environment"]["Variables"]
    assert len(join["Policies"]) == 3
    later = template["Resources"]["SkipnetS10"]["Properties"]  # a later join: its own calls
    assert len(later["Policies"]) == 3 and "MOPAR_PREWARM" not in later["Environment"]["Variables"]
    states = template["Resources"]["Pipeline"]["Properties"]["Definition"]["States"]
    assert list(states) == ["s0", "s1.0", "s1"]  # the joins fork their sub-slices themselves
    _lints_clean(tmp_path / "template.yaml")


def test_lambda_join_invokes_its_sub_slices_side_by_side(sharded):
    from mopar.runtime.aws import LambdaFunction
    from tests.test_lambda import Context, _http_event

    out, _ = sharded
    inputs, expected = read_reference(out / "reference.npz")
    fns: dict[str, LambdaFunction] = {}
    invoked: list[str] = []

    def invoke(name: str, event: dict) -> dict:
        invoked.append(name)
        return json.loads(json.dumps(fns[name](json.loads(json.dumps(event)), Context(name))))

    stages = [
        (entry, [x.slice for x in FunctionSpec.load(out / "functions" / entry).calls])
        for entry in ("s0", "s1.0", "s1")
    ]
    for k, (entry, shards) in enumerate(stages):
        for name in shards:
            fns[name] = LambdaFunction(out / "functions" / name, {}, invoke=invoke)
        env = {"MOPAR_CALLS": ",".join(shards)}
        if k + 1 < len(stages):
            env["MOPAR_NEXT"] = stages[k + 1][0]
        fns[entry] = LambdaFunction(out / "functions" / entry, env, invoke=invoke)
    answer = fns["s0"](_http_event(encode_frame(inputs)), Context("s0"))
    assert answer["statusCode"] == 200
    assert sorted(invoked) == sorted(u for u in UNITS if u != "s0")
    got = decode_payloads(split_frame(base64.b64decode(answer["body"])))
    assert compare_outputs(got, expected).max_rel_err <= 1e-5
