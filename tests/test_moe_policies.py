"""MoE placement policies: hot and cold experts, replicas under load, the communication mode.

Planner rules are checked on hand-made loads; the policies end to end on compiled bundles of
the two example families (stacked experts, and a module list with a shared expert), each run
by `mopar run --check` through real worker processes and function servers.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from mopar import api
from mopar.bundle.dispatch import DispatchSpec
from mopar.config import CompileConfig
from mopar.facts import load_facts
from mopar.pipeline import experts_of
from mopar.planner.experts import CV_BOUND, comm_mode, lpt, replicate, variation
from mopar.runtime import wire
from mopar.runtime.aws import event_frame
from mopar.runtime.dispatch import combine, route
from mopar.runtime.frame import decode_payloads, join_frame, split_frame
from mopar.runtime.framed import SliceFunction
from tests.conftest import ROOT, mopar, mopar_in_process
from tests.test_dispatch import Lambdas, _dense

CALIBRATION = ROOT / "examples" / "data" / "moe_calibration.npz"
FLAGS = ("--input", "input_ids=1x16:int64:0..256", "--input", "attention_mask=1x16:int64:1..2")


# --- replicas: the CV bound and the packing ------------------------------------------------------


@pytest.mark.parametrize(
    "loads",
    [
        [10, 5, 3, 2, 1, 1, 1, 1],  # Zipf-like
        [40, 1, 1, 1],  # one expert takes nearly everything
        [3, 3, 3, 3],  # balanced already: no replica
        [7, 0, 2, 0, 5],  # experts no token reaches stay out of the variation
    ],
)
def test_replicas_bring_the_load_per_replica_within_the_cv_bound(loads):
    r = replicate(loads, max_copies=100)
    per = [x / k for x, k in zip(loads, r) if x > 0]
    assert variation(per) <= CV_BOUND
    assert all(k >= 1 for k in r)
    assert all(k == 1 for x, k in zip(loads, r) if x == 0)
    if len(set(x for x in loads if x)) == 1:
        assert r == [1] * len(loads)


def test_replicas_stop_at_the_memory_cap():
    loads = [100, 1, 1, 1]
    r = replicate(loads, max_copies=1.5)
    assert sum(r) == 6  # 1.5 x 4 experts' weights
    assert r[0] == 3 and variation([x / k for x, k in zip(loads, r)]) > CV_BOUND


def test_the_most_loaded_expert_gets_the_first_replica():
    assert replicate([1, 9, 2], max_copies=4 / 3) == [1, 2, 1]


def test_lpt_packs_every_replica_once_per_function_and_balances_the_load():
    loads = {0: 12.0, 1: 6.0, 2: 5.0, 3: 4.0, 4: 3.0, 5: 2.0, 6: 1.0, 7: 1.0}
    r = dict(zip(loads, replicate(list(loads.values()), max_copies=100)))
    bins = lpt({e: (loads[e], r[e]) for e in loads}, 3)
    placed = [e for b in bins for e, _ in b]
    assert sorted(placed) == sorted(e for e in loads for _ in range(r[e]))
    assert all(len(b) <= 3 and len({e for e, _ in b}) == len(b) for b in bins)
    totals = [sum(loads[e] / k for e, k in b) for b in bins]
    assert variation(totals) <= CV_BOUND
    naive = [sum(loads[e] for e in list(loads)[i : i + 3]) for i in range(0, 8, 3)]
    assert max(totals) < max(naive)


def test_lpt_opens_a_function_when_every_one_with_room_holds_the_expert():
    bins = lpt({0: (8.0, 3), 1: (1.0, 1)}, 4)
    assert len(bins) == 3 and all(sum(e == 0 for e, _ in b) == 1 for b in bins)


# --- the communication mode -----------------------------------------------------------------------


def test_the_communication_mode_flips_at_the_platform_payload_limit():
    lam = load_facts(target="lambda").platform
    limit = lam.sync_payload_bytes
    assert limit == (6 * 1024 * 1024 - 1024) * 3 // 4  # the frame a base64 JSON event carries
    assert comm_mode(lam, limit) == "direct"
    assert comm_mode(lam, limit + 1) == "store"
    openfaas = load_facts(target="openfaas").platform
    assert comm_mode(openfaas, 64 * 1024) == "direct"


# --- routing: hot experts, replicas ---------------------------------------------------------------


def _spec(**kw) -> DispatchSpec:
    base = dict(
        hidden="h",
        index="i",
        weights="w",
        output="o",
        output_shape=(6, 2),
        tokens=6,
        hidden_size=2,
        top_k=2,
        num_experts=4,
        groups=((0, 1), (2, 3)),
        callees=("s1.e0", "s1.e1"),
    )
    return DispatchSpec(**{**base, **kw})


def _reference(x, idx, w, scale):
    """Expert e multiplies by scale[e]: the layer's output, computed per token."""
    return np.stack(
        [
            sum(w[t, j] * scale[idx[t, j]] * x[t] for j in range(idx.shape[1]))
            for t in range(x.shape[0])
        ]
    )


def test_hot_experts_run_locally_and_replicas_share_their_tokens_in_turn():
    spec = _spec(groups=((1, 3), (1, 2)), callees=("s1.e0", "s1.e1"), hot=(0,), local="s1.hot")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 2)).astype(np.float32)
    idx = np.array([[1, 0], [1, 2], [1, 3], [0, 2], [1, 0], [3, 1]], np.int64)
    w = rng.random((6, 2)).astype(np.float32)
    scale = np.array([2.0, 3.0, 5.0, 7.0], np.float32)
    for offset in (0, 1):
        calls = route(spec, x, idx, w, offset)
        by = {c.function: c for c in calls}
        assert by["s1.hot"].local and not by["s1.e0"].local
        assert set(by["s1.hot"].rows) == {0, 3, 4}  # the tokens that chose expert 0
        # expert 1's five tokens (rows 0, 1, 2, 4, 5) alternate between its two holders
        ones = [t for t in range(6) if 1 in idx[t]]
        first = {t for k, t in enumerate(ones) if (k + offset) % 2 == 0}
        got = {
            t
            for t in by["s1.e0"].rows
            if 1 in idx[t] and by["s1.e0"].gates[list(by["s1.e0"].rows).index(t), 0] > 0
        }
        assert got == first
        groups = dict(zip(spec.callees, spec.groups)) | {"s1.hot": spec.hot}
        answers = [c.tokens * (c.gates @ scale[list(groups[c.function])])[:, None] for c in calls]
        np.testing.assert_allclose(
            combine(spec, calls, answers, np.float32),
            _reference(x, idx, w, scale),
            rtol=1e-5,
            atol=1e-6,
        )


def test_a_dispatch_spec_must_place_every_expert():
    with pytest.raises(ValueError, match=r"\[3\] are held nowhere"):
        _spec(groups=((0, 1), (2,)), callees=("a", "b"))
    with pytest.raises(ValueError, match="needs the name"):
        _spec(groups=((0, 1),), callees=("a",), hot=(2, 3))
    with pytest.raises(ValueError, match="mode"):
        _spec(mode="carrier pigeon")
    assert DispatchSpec.from_dict(_spec(hot=(), mode="store").to_dict()).mode == "store"


# --- the planner's choices on the example ---------------------------------------------------------


@pytest.fixture(scope="module")
def zipf():
    """The Mixtral-style example with the Zipf router, analysed once, and its measured trace."""
    import torch

    from examples.moe import mixtral_tiny_zipf

    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    analysis = api.analyze(mixtral_tiny_zipf(), (ids, torch.ones(1, 16, dtype=torch.int64)))
    trace = experts_of(analysis, CompileConfig(calibration=CALIBRATION)).trace
    return analysis, trace


def _plan(analysis, **options):
    config = CompileConfig(calibration=CALIBRATION, **options)
    facts = api.facts_for(config)
    return api.plan_from(
        analysis, config, api.predict(analysis.layers, config, facts=facts), facts=facts
    )


def test_hot_experts_are_the_most_loaded_by_the_trace(zipf):
    analysis, trace = zipf
    plan = _plan(analysis, hot_experts=2, expert_group=2)
    for d in plan.dispatches():
        load = trace.expected_tokens(d.layers[0])
        assert len(d.experts) == 2
        assert min(load[list(d.experts)]) >= max(np.delete(load, list(d.experts)))
        held = sorted(e for c in plan.callees(d.name) for e in c.experts)
        assert held == sorted(set(range(8)) - set(d.experts))
        assert d.param_bytes > 0 and all(
            c.param_bytes == d.param_bytes for c in plan.callees(d.name) if len(c.experts) == 2
        )
    none = _plan(analysis, hot_experts="none", expert_group=2)
    assert all(not d.experts for d in none.dispatches())


@pytest.mark.slow  # the hot-experts tests here cover the placement; this compares counts
def test_auto_hot_experts_is_never_dearer_than_a_forced_count(zipf):
    analysis, _ = zipf
    auto = _plan(analysis, expert_group=2)
    for forced in ("none", 2, 8):
        assert (
            auto.cost_per_1m_usd
            <= _plan(analysis, expert_group=2, hot_experts=forced).cost_per_1m_usd * 1.0001
        )


def test_a_rate_gives_the_most_loaded_experts_replicas(zipf):
    analysis, trace = zipf
    plan = _plan(analysis, hot_experts="none", expert_group=2, rate=200.0)
    for d in plan.dispatches():
        held = [e for c in plan.callees(d.name) for e in c.experts]
        copies = np.bincount(held, minlength=8)
        load = trace.expected_tokens(d.layers[0])
        assert copies.sum() > 8 and copies[int(np.argmax(load))] == copies.max()
        assert all(len(set(c.experts)) == len(c.experts) for c in plan.callees(d.name))
    assert any("coefficient of variation" in n for n in map(str, plan.notes))


def test_bad_hot_experts_value_is_one_line(tmp_path):
    proc = mopar_in_process("plan", "examples.moe:mixtral_tiny", *FLAGS, "--hot-experts", "most")
    assert proc.returncode == 1
    assert (
        proc.stderr.strip().count("\n") == 0 and "--hot-experts must be auto, none" in proc.stderr
    )


# --- bundles: each policy equal to the model, run for real ----------------------------------------


@pytest.fixture(scope="module")
def hot_replicas_bundle(tmp_path_factory) -> Path:
    """qwen2_moe_tiny (an nn.ModuleList of experts, a shared expert) with 2 hot experts per
    layer and the cold ones replicated for 200 requests/s, two to a function."""
    out = tmp_path_factory.mktemp("moe-policies") / "bundle"
    proc = mopar(
        "compile",
        "examples.moe:qwen2_moe_tiny_zipf",
        *FLAGS,
        "--hot-experts",
        "2",
        "--expert-group",
        "2",
        "--rate",
        "200",
        "--calibration",
        CALIBRATION,
        "--out",
        out,
        "--json",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["max_abs_err"] <= 1e-4
    return out


@pytest.mark.slow  # a second MoE bundle (60 s); the shared one runs the dispatch by default
def test_hot_and_replicated_bundle_layout(hot_replicas_bundle):
    doc = json.loads((hot_replicas_bundle / "plan.json").read_text())
    dispatches = [f for f in doc["plan"]["functions"] if f["kind"] == "dispatch"]
    assert dispatches and all(len(f["experts"]) == 2 for f in dispatches)
    for f in dispatches:
        folder = hot_replicas_bundle / "functions" / f["name"]
        assert (folder / "hot" / "model.onnx").is_file()
        spec = json.loads((folder / "function.json").read_text())["dispatch"]
        assert spec["hot"] == f["experts"] and spec["local"] == f"{f['name']}.hot"
        assert spec["mode"] == "direct"
        held = [e for g in spec["groups"] for e in g]
        assert len(held) > len(set(held))  # some expert replicated
        assert set(held) | set(spec["hot"]) == set(range(spec["num_experts"]))


@pytest.mark.slow  # a second MoE bundle (60 s); the shared one runs the dispatch by default
@pytest.mark.parametrize("transport", ["shm", "http"])
def test_hot_and_replicated_bundle_runs_equal_to_the_model(hot_replicas_bundle, transport):
    run = mopar(
        "run", hot_replicas_bundle, "--check", "--requests", "3", "--transport", transport, "--json"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout)["max_abs_err"] <= 1e-4


def _all_hot(out: Path, *until: str) -> dict:
    proc = mopar_in_process(
        "compile",
        "examples.moe:mixtral_tiny_zipf",
        *FLAGS,
        "--hot-experts",
        "8",
        "--expert-group",
        "2",
        *until,
        "--out",
        out,
        "--json",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)["plan"]


def test_a_dispatch_holding_every_expert_plans_no_expert_function(tmp_path):
    plan = _all_hot(tmp_path / "b", "--until", "plan")
    assert [f["kind"] for f in plan["functions"]].count("expert") == 0
    assert all(len(f["experts"]) == 8 for f in plan["functions"] if f["kind"] == "dispatch")


@pytest.mark.slow  # the hot experts of a dispatch run by default in the hot-and-replicated bundle
def test_a_dispatch_holding_every_expert_calls_no_function(tmp_path):
    plan = _all_hot(tmp_path / "b")
    assert [f["kind"] for f in plan["functions"]].count("expert") == 0
    run = mopar("run", tmp_path / "b", "--check", "--requests", "2")
    assert run.returncode == 0, run.stderr[-3000:]


# --- the store mode, honoured by the Lambda handler and the function server -----------------------


@pytest.fixture
def store_bundle(moe_bundle, tmp_path) -> Path:
    """The shared MoE bundle with dispatch s1's layer switched to the store mode, as the planner
    writes it for tokens over the payload limit."""
    out = tmp_path / "bundle"
    shutil.copytree(moe_bundle, out)
    path = out / "functions" / "s1" / "function.json"
    doc = json.loads(path.read_text())
    doc["dispatch"]["mode"] = "store"
    path.write_text(json.dumps(doc))
    return out


def test_lambda_dispatch_in_store_mode_sends_tokens_through_redis(store_bundle, redis_url):
    fns = {
        d.name: SliceFunction(d)
        for d in (store_bundle / "functions").iterdir()
        if (d / "function.json").is_file()
    }
    frame = _store_frame(fns)
    lambdas = Lambdas(store_bundle, env={"REDIS_URL": redis_url, "MOPAR_TRANSPORT": "redis"})
    answer = lambdas(frame)
    assert "error" not in answer, answer
    assert lambdas.events and all("ref" in e and "frame" not in e for e in lambdas.events)
    got = decode_payloads(split_frame(event_frame(answer, lambdas.dispatch.store)))  # stored too
    (sent,) = fns["s1"].spec.sends
    np.testing.assert_allclose(got[sent], _dense(fns, frame), atol=1e-5, rtol=0)


def _store_frame(fns) -> bytes:
    """A request for dispatch s1 whose tokens reach every expert function."""
    spec = fns["s1"].spec.dispatch
    rng = np.random.default_rng(3)
    tensors = {}
    for t in fns["s1"].spec.receives:
        shape = tuple(t.shape)
        if t.name == spec.index:
            value = np.array(
                [[0, 2], [4, 6], [1, 3], [5, 7]] * (spec.tokens // 4), np.int64
            ).reshape(shape)
        elif t.dtype.startswith("int"):
            value = np.ones(shape, dtype=t.dtype)
        else:
            value = rng.random(shape).astype(t.dtype)
        tensors[t.name] = wire.encode(value)
    return join_frame(tensors)


def test_function_server_in_store_mode_needs_redis(store_bundle):
    from mopar.runtime.server import app_from_env

    env = {
        "MOPAR_FUNCTION_DIR": str(store_bundle / "functions" / "s1"),
        "MOPAR_CALLS": ",".join(f"http://127.0.0.1:1/{i}" for i in range(4)),
    }
    with pytest.raises(ValueError, match="REDIS_URL is not set"):
        app_from_env(env)


# --- pre-warming --------------------------------------------------------------------------------


def test_to_warm_names_the_functions_holding_a_predicted_expert():
    from mopar.runtime.dispatch import to_warm

    spec = _spec(warm=(("s3.e0", (0, 1)), ("s3.e1", (2, 3)), ("s3.e2", (4, 5))))
    assert to_warm(spec, np.array([[1, 4], [4, 1]])) == ["s3.e0", "s3.e2"]
    assert to_warm(spec, np.array([[6, 7]])) == []


def _session(bundle: Path, **config):
    from mopar.config import RunConfig
    from mopar.runner.bundle import read_manifest
    from mopar.runner.shm_session import ShmSession

    shm = Path(tempfile.mkdtemp(prefix="mopar-test-", dir="/dev/shm"))
    return ShmSession(read_manifest(bundle), shm, RunConfig(**config), tag=0), shm


def _predicted(bundle: Path, inputs: dict) -> list[str]:
    """The next layer's expert functions dispatch s1 should pre-warm on ``inputs``, computed
    here apart from the runtime: s0 in onnxruntime, then s1's copy of s3's router."""
    import onnxruntime as ort

    from mopar.bundle.dispatch import DispatchSpec
    from mopar.runtime.dispatch import to_warm

    s0 = ort.InferenceSession(str(bundle / "functions" / "s0" / "model.onnx"))
    values = dict(
        zip(
            [o.name for o in s0.get_outputs()],
            s0.run(None, {i.name: inputs[i.name] for i in s0.get_inputs()}),
        )
    )
    spec = DispatchSpec.from_dict(
        json.loads((bundle / "functions" / "s1" / "function.json").read_text())["dispatch"]
    )
    router = ort.InferenceSession(str(bundle / "functions" / "s1" / "warm" / "model.onnx"))
    (predicted,) = router.run(None, {spec.hidden: values[spec.hidden]})
    return to_warm(spec, predicted)


def test_prewarm_reaches_only_predicted_cold_functions(moe_bundle):
    from mopar.runner.bundle import read_reference

    inputs, _ = read_reference(moe_bundle / "reference.npz")
    want = _predicted(moe_bundle, inputs)
    assert want and all(name.startswith("s3.") for name in want)
    session, shm = _session(moe_bundle, cold_experts=True, requests=2)
    try:
        session.start()
        assert all(
            not pool for pool, s in zip(session.pools, session.manifest.slices) if s.called
        )  # scaled to zero before the first request
        session.serve(inputs, requests=2, concurrency=1, expected=None, measure=True)
        per_request = {}
        for rid, name in session.warm_log:
            per_request.setdefault(rid, []).append(name)
        assert sorted(per_request) == [0, 1]
        assert all(sorted(names) == sorted(want) for names in per_request.values())
        # a function already running gets no warm-up
        i = session.index[want[0]]
        session.pools[i].append(object())
        session._warm(7, want[:1])
        assert (7, want[0]) not in session.warm_log
        session.pools[i].clear()
    finally:
        session.stop()
        shutil.rmtree(shm, ignore_errors=True)


def test_warm_functions_get_no_warm_up(moe_bundle):
    from mopar.runner.bundle import read_reference

    inputs, _ = read_reference(moe_bundle / "reference.npz")
    session, shm = _session(moe_bundle, requests=1)
    try:
        session.start()
        session.serve(inputs, requests=1, concurrency=1, expected=None, measure=True)
        assert session.warm_log == []
    finally:
        session.stop()
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.parametrize(
    "flag", ["--prewarm", pytest.param("--no-prewarm", marks=pytest.mark.slow)]
)
def test_cold_runs_match_the_model_and_prewarm_as_asked(moe_bundle, flag):
    run = mopar("run", moe_bundle, "--check", "--requests", "2", "--cold-experts", flag, "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    cold = json.loads(run.stdout)["cold"]
    assert cold["cold_starts"] > 0
    assert (cold["prewarmed"] > 0) == (flag == "--prewarm")
    assert cold["prewarm_used"] <= cold["prewarmed"]


def test_cold_experts_over_http_is_one_line():
    proc = mopar("run", ROOT / "no-such-bundle", "--cold-experts", "--transport", "http")
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0
    assert "--cold-experts runs with --transport shm only" in proc.stderr


# --- mopar bench --moe ----------------------------------------------------------------------------


def test_moe_bench_refuses_an_unknown_family_in_one_line(tmp_path):
    proc = mopar("bench", "--moe", "--models", "gpt5", "--out", tmp_path / "b")
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0
    assert "unknown MoE family 'gpt5'" in proc.stderr and "mixtral" in proc.stderr


def test_moe_bench_table_gives_each_policy_as_ratios_to_the_sparse_unsplit():
    from benchmarks.moe import MoeRow, moe_markdown

    def row(policy, mc, p50, p95, rss, warm):
        return MoeRow(
            family="mixtral",
            router="zipf",
            tokens=16,
            policy=policy,
            functions=3,
            invoked_per_request=2.5,
            mc_gb_s=mc,
            openfaas_per_1m_usd=1.0,
            lambda_per_1m_usd=2.0,
            p50_ms=p50,
            p95_ms=p95,
            peak_rss_mb=rss,
            prewarm_precision=warm,
            prewarm_recall=warm,
            max_abs_err=1e-6,
        )

    table = moe_markdown(
        [
            row("unsplit", 0.3, 10.0, 12.0, 200.0, None),
            row("unsplit-dense", 0.6, 20.0, 24.0, 220.0, None),
            row("hot-cold", 0.1, 11.0, 15.0, 100.0, 0.9),
        ]
    )
    assert "MC vs unsplit" in table.splitlines()[0]
    unsplit, dense, hot = table.splitlines()[2:5]
    assert "| 1.00x | 1.00x | 1.00x | 1.00x |" in unsplit and unsplit.endswith("| - |")
    assert "| 2.00x | 2.00x | 2.00x | 1.10x |" in dense and dense.endswith("| - |")
    assert "| 0.33x | 1.10x | 1.25x | 0.50x |" in hot and hot.endswith("| 0.90 / 0.90 |")


# --- pre-warming by deployed functions (function servers, Lambda) ---------------------------------


def test_warmer_takes_functions_predicted_within_the_keep_time_to_be_warm():
    from mopar.runtime.dispatch import Warmer

    now = [100.0]
    w = Warmer(keep_s=10.0, clock=lambda: now[0])
    assert w.cold(["a", "b"]) == ["a", "b"]
    now[0] = 105.0
    assert w.cold(["b", "c"]) == ["c"]
    now[0] = 114.0
    assert w.cold(["a", "b", "c"]) == ["a"]  # a last predicted at 100, b and c at 105


def _s1_frame(bundle: Path, fns: dict) -> tuple[bytes, dict]:
    """Dispatch s1's incoming frame for the bundle's reference request (s0's outgoing one)."""
    from mopar.runner.bundle import read_reference

    inputs, _ = read_reference(bundle / "reference.npz")
    first = join_frame({t.name: wire.encode(inputs[t.name]) for t in fns["s0"].spec.receives})
    return fns["s0"].process(first)[0], inputs


@pytest.fixture(scope="module")
def functions(moe_bundle) -> dict[str, SliceFunction]:
    return {
        d.name: SliceFunction(d)
        for d in (moe_bundle / "functions").iterdir()
        if (d / "function.json").is_file()
    }


def test_a_deployed_dispatch_names_the_predicted_functions_to_warm(moe_bundle, functions):
    frame, inputs = _s1_frame(moe_bundle, functions)
    asked: list[list[str]] = []

    def fork(names, frames):
        return [functions[n].process(f)[0] for n, f in zip(names, frames)]

    functions["s1"].process(frame, fork, asked.append)
    assert asked == [_predicted(moe_bundle, inputs)]
    assert functions["s3"].core.predictor is None  # the last MoE layer predicts nothing


class _Recorder:
    """An HTTP server on 127.0.0.1 that records the warm-ups it is sent."""

    def __init__(self) -> None:
        import http.server
        import threading

        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                seen.append(self.headers.get("X-Mopar-Warm"))
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_function_server_warms_only_predicted_cold_functions_and_answers_warm_ups(moe_bundle):
    import time

    from mopar.runtime.server import app_from_env

    recorders = [_Recorder() for _ in range(4)]
    try:
        env = {
            "MOPAR_FUNCTION_DIR": str(moe_bundle / "functions" / "s1"),
            "MOPAR_CALLS": ",".join(f"http://127.0.0.1:1/{i}" for i in range(4)),
            "MOPAR_WARM": ",".join(r.url for r in recorders),
        }
        app = app_from_env(env)
        names = [f for f, _ in app.function.spec.dispatch.warm]
        app._prewarm([names[0], names[2]])
        app._prewarm([names[0], names[2]])  # warm now: no second warm-up
        deadline = time.monotonic() + 10
        while sum(len(r.seen) for r in recorders) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        assert [len(r.seen) for r in recorders] == [1, 0, 1, 0]
        assert recorders[0].seen == ["1"]
        status = []
        body = app(
            {
                "REQUEST_METHOD": "POST",
                "HTTP_X_MOPAR_WARM": "1",
                "CONTENT_LENGTH": "0",
                "wsgi.input": __import__("io").BytesIO(b""),
            },
            lambda s, h: status.append(s),
        )
        assert status == ["200 OK"] and json.loads(b"".join(body))["warm"] is True
        with pytest.raises(ValueError, match="MOPAR_WARM names 2 URLs"):
            app_from_env({**env, "MOPAR_WARM": ",".join(r.url for r in recorders[:2])})
    finally:
        for r in recorders:
            r.server.shutdown()


def test_lambda_dispatch_warms_predicted_cold_functions_asynchronously(moe_bundle, functions):
    from mopar.runtime.aws import LambdaFunction
    from tests.test_dispatch import _arn
    from tests.test_lambda import Context

    frame, inputs = _s1_frame(moe_bundle, functions)
    sent: list[tuple[str, dict]] = []
    lambdas = Lambdas(moe_bundle)
    targets = [_arn(f"s3.e{i}") for i in range(4)]
    lambdas.dispatch = LambdaFunction(
        moe_bundle / "functions" / "s1",
        {
            "MOPAR_CALLS": ",".join(_arn(f"s1.e{i}") for i in range(4)),
            "MOPAR_NEXT": "",
            "MOPAR_WARM": ",".join(targets),
        },
        invoke=lambdas.invoke,
        invoke_async=lambda name, event: sent.append((name, event)),
    )
    assert "error" not in lambdas(frame)
    want = [_arn(n) for n in _predicted(moe_bundle, inputs)]
    assert [n for n, _ in sent] == want and all(e == {"mopar": 1, "warm": True} for _, e in sent)
    assert "error" not in lambdas(frame) and len(sent) == len(want)  # still warm
    expert = lambdas.experts[_arn("s1.e0")]
    assert expert({"mopar": 1, "warm": True}, Context("x"))["warm"] is True


# --- recognition: routing after the top-k (GraniteMoE) --------------------------------------------


def test_a_router_that_softmaxes_the_top_k_logits_is_recognised():
    import torch
    from torch import nn

    class Block(nn.Module):
        """GraniteMoE's order: linear -> top-k of the logits -> softmax of the k values."""

        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(8, 4, bias=False)
            self.experts = nn.ModuleList(
                nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 8)) for _ in range(4)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = x.reshape(-1, 8)
            values, index = torch.topk(self.gate(t), 2, dim=-1)
            weights = torch.softmax(values, dim=-1)
            out = torch.zeros_like(t)
            for e, expert in enumerate(self.experts):
                out = out + expert(t) * (weights * (index == e)).sum(-1, keepdim=True)
            return (x + out.reshape(x.shape)).relu()

    torch.manual_seed(0)
    analysis = api.analyze(Block().eval(), (torch.randn(1, 6, 8),))
    assert len(analysis.moe) == 1
    block = analysis.moe[0]
    assert (block.routing, block.top_k, block.num_experts) == ("softmax", 2, 4)
