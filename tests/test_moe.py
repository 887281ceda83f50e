"""Mixture-of-experts models: recognition, exactness, expert functions end to end.

The models are the examples' Mixtral-style (stacked experts) and Qwen2-MoE-style (one module per
expert, plus a shared expert), built in plain torch, and transformers' own Mixtral and
Qwen2-MoE saved as .pt2 by another process, as users hand them over. Bundles are compiled by the
real CLI in a subprocess, once per module, and run with every transport.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import fx

from mopar import api
from mopar._files import OWNER_FILE
from mopar.bundle.dispatch import DispatchSpec
from mopar.ir.experts import dense_translation
from mopar.runtime.dispatch import combine, route
from tests.conftest import (
    HAVE_REDIS,
    MOPAR,
    REDIS_MISSING,
    ROOT,
    _worker_children,
    mopar,
    mopar_in_process,
    new_shm_runs,
    shm_runs,
)

TOKENS = ("input_ids={b}x{s}:int64:0..256", "attention_mask={b}x{s}:int64:1..2")
CALIBRATION = ROOT / "examples" / "data" / "moe_calibration.npz"


def _inputs(b: int = 1, s: int = 16) -> list[str]:
    return [t.format(b=b, s=s) for t in TOKENS]


def _flags(b: int = 1, s: int = 16) -> list[str]:
    return [x for spec in _inputs(b, s) for x in ("--input", spec)]


def _run_graph(analysis) -> np.ndarray:
    cm = analysis.captured
    with torch.no_grad():
        out = fx.Interpreter(cm.gm).run(*[torch.from_numpy(v) for v in cm.inputs.values()])
    return next(
        t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
    ).numpy()


# --- recognition ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory, form, shared",
    [
        ("examples.moe:mixtral_tiny", "stacked", False),
        ("examples.moe:qwen2_moe_tiny", "modules", True),
    ],
)
def test_both_expert_forms_are_recognised_and_the_translation_is_exact(factory, form, shared):
    analysis = api.analyze(factory, _inputs())
    assert len(analysis.moe) == 2
    for block in analysis.moe:
        assert (block.form, block.num_experts, block.top_k, block.routing) == (
            form,
            8,
            2,
            "softmax",
        )
        assert bool(block.shared) is shared
        layer = analysis.layers.graph.nodes[block.name]["layer"]
        assert layer.param_bytes == 8 * block.params_per_expert * 4  # exactly its experts
    reference = next(iter(analysis.captured.reference.values()))
    assert np.abs(_run_graph(analysis) - reference).max() <= 1e-5


@pytest.mark.parametrize("b, s", [(1, 1), (1, 128), (3, 16)])
def test_dispatch_equals_the_model_at_every_shape(b, s):
    """Sequences of 1 and 128 tokens and a batch of 3: the dense translation in the graph and
    the runtime's dispatch (only the experts tokens reached, each on its tokens) both equal
    the original model. With one token, 6 of 8 experts get none."""
    analysis = api.analyze("examples.moe:mixtral_tiny", _inputs(b, s))
    reference = next(iter(analysis.captured.reference.values()))
    assert np.abs(_run_graph(analysis) - reference).max() <= 1e-4
    from mopar.ir.moe import probe

    cm, block = analysis.captured, analysis.moe[0]
    args = [torch.from_numpy(v) for v in cm.inputs.values()]
    seen = probe(cm.gm, {block.hidden, block.index, block.weights, block.output})(args)
    experts = analysis.experts[block.name]
    t, h, k = block.tokens, block.hidden_size, block.top_k
    spec = DispatchSpec(
        hidden="x",
        index="i",
        weights="w",
        output="y",
        output_shape=(t, h),
        tokens=t,
        hidden_size=h,
        top_k=k,
        num_experts=8,
        groups=tuple((e,) for e in range(8)),
        callees=tuple(f"e{e}" for e in range(8)),
    )
    calls = route(
        spec, seen[block.hidden].numpy(), seen[block.index].numpy(), seen[block.weights].numpy()
    )
    with torch.no_grad():
        answers = [
            experts[int(c.function[1:])](torch.from_numpy(c.tokens)).numpy() * c.gates
            for c in calls
        ]
    got = combine(spec, calls, answers, np.float32)
    want = seen[block.output].reshape(t, h).numpy()
    assert np.abs(got - want).max() <= 1e-5
    chosen = set(np.unique(seen[block.index].numpy()).tolist())
    assert {int(c.function[1:]) for c in calls} == chosen
    if s == 1:
        assert len(calls) <= k


ZOO_MODELS = ("mixtral", "qwen2_moe")  # saved by conftest's `zoo_files`


@pytest.fixture(scope="module")
def zoo_moe(zoo_files) -> Path:
    """transformers' Mixtral and Qwen2-MoE (tiny configs), saved as .pt2 by another process."""
    pytest.importorskip("transformers")
    from examples import zoo

    errors = {name: zoo.saved_error(zoo.ZOO[name], zoo_files) for name in ZOO_MODELS}
    assert errors == dict.fromkeys(ZOO_MODELS), errors
    return zoo_files


@pytest.mark.slow  # the examples' Mixtral is stacked too, and its expert functions run by default
def test_transformers_experts_from_a_saved_pt2_compile_as_functions(zoo_moe, tmp_path):
    out = tmp_path / "mixtral"
    proc = mopar(
        "compile",
        zoo_moe / "mixtral.pt2",
        "--expert-group",
        "2",
        "--hot-experts",
        "none",
        "--out",
        out,
        "--json",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["max_abs_err"] <= 1e-4
    kinds = [f["kind"] for f in doc["plan"]["functions"]]
    assert kinds.count("dispatch") == 2 and kinds.count("expert") == 4  # 4 experts, 2 a function
    layers = json.loads((out / "plan.json").read_text())["experts"]["layers"]
    assert {x["form"] for x in layers} == {"stacked"} and not any(x["shared"] for x in layers)
    run = mopar("run", out, "--check", "--requests", "2")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "outputs match the model" in run.stdout


def test_transformers_qwen2_moe_from_a_saved_pt2_is_recognised_with_its_shared_expert(zoo_moe):
    analysis = api.analyze(zoo_moe / "qwen2_moe.pt2")
    assert len(analysis.moe) == 2
    assert all(
        b.form == "stacked"
        and b.top_k == 2
        and b.num_experts == 4
        and b.shared.endswith("shared_expert")
        for b in analysis.moe
    )
    reference = next(iter(analysis.captured.reference.values()))
    assert np.abs(_run_graph(analysis) - reference).max() <= 1e-5


# --- expert functions, end to end -----------------------------------------------------------------


@pytest.fixture
def expert_bundle(moe_bundle) -> Path:
    """mixtral_tiny_zipf with two experts per function (8 expert functions, 2 dispatches)."""
    return moe_bundle


def test_the_plan_is_a_graph_of_dispatch_and_expert_functions(expert_bundle):
    doc = json.loads((expert_bundle / "plan.json").read_text())
    plan = doc["plan"]
    kinds = {f["name"]: f["kind"] for f in plan["functions"]}
    assert [n for n, k in kinds.items() if k == "dispatch"] == ["s1", "s3"]
    assert sorted(n for n, k in kinds.items() if k == "expert") == sorted(
        f"s{d}.e{e}" for d in (1, 3) for e in range(4)
    )
    edges = [e for e in plan["edges"] if kinds.get(e["src"]) == "expert"]
    assert len(edges) == 8 and {e["probability_source"] for e in edges} == {"measured"}
    trace = doc["experts"]["trace"]
    assert trace["requests"] > 0 and "moe_calibration.npz" in trace["source"]
    for layer in trace["layers"]:  # the zipf router: expert 0 most used, every one used
        assert layer["tokens"][0] == max(layer["tokens"]) and min(layer["tokens"]) > 0
    invoked = {e["src"]: e["probability"] for e in edges}
    assert invoked["s1.e0"] >= invoked["s1.e3"]
    for f in plan["functions"]:
        if f["kind"] == "expert":  # holds exactly its two experts: 3 matrices of 64 x 128 each
            assert f["param_bytes"] == 2 * 3 * 64 * 128 * 4 and len(f["experts"]) == 2
        if f["kind"] == "dispatch":
            assert f["param_bytes"] == 0


@pytest.mark.parametrize(
    "transport", ["shm", "http", pytest.param("redis", marks=pytest.mark.slow)]
)  # redis: tests/test_transports.py serves a chain through it by default
def test_expert_functions_equal_the_model_under_every_transport(expert_bundle, transport):
    if transport == "redis" and not HAVE_REDIS:
        pytest.skip(REDIS_MISSING)
    proc = mopar(
        "run", expert_bundle, "--check", "--requests", "3", "--transport", transport, "--json"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["check"]["passed"] and report["max_abs_err"] <= 1e-4 and report["errors"] == 0


def test_experts_no_token_reached_are_never_invoked(expert_bundle, tmp_path):
    """One token repeated routes to 2 of 8 experts per layer: the others never run."""
    ids = np.array([[7]], dtype=np.int64)
    npz = tmp_path / "one.npz"
    np.savez(npz, input_ids=np.repeat(ids, 16, axis=1), attention_mask=np.ones((1, 16), np.int64))
    proc = mopar("run", expert_bundle, "--input", npz, "--requests", "3", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    slices = {s["name"]: s for s in json.loads(proc.stdout)["slices"]}
    assert set(slices) >= {"s1", "s1.e0", "s3.e3"}
    for d in ("s1", "s3"):
        ran = [n for n in slices if n.startswith(f"{d}.e") and slices[n]["p50_ms"] is not None]
        # the same token 16 times: top-2 experts per layer, in at most 2 of the 4 functions
        assert 1 <= len(ran) <= 2, ran


def test_an_expert_function_that_dies_is_restarted(expert_bundle):
    """kill -9 of an expert function's instance: a new one is started and the run goes on (what
    the requests it held get is tests/test_serving.py's kill -9 test, on a plain chain)."""
    before = shm_runs()
    proc = subprocess.Popen(
        [MOPAR, "run", str(expert_bundle), "--requests", "1000000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )

    def expert_pids() -> set[int]:
        return {
            pid
            for pid, cmd in _worker_children(proc.pid).items()
            if any(part.endswith("functions/s1.e0") for part in cmd)
        }

    def serving() -> bool:
        """Requests flow once the run's shm folder holds a slot's buffers (after start-up, where
        a dead slice ends the run instead)."""
        folders = {
            cmd[cmd.index("mopar.runner.worker") + 2] for cmd in _worker_children(proc.pid).values()
        }
        return any(
            Path(f).is_dir() and any(p.name != OWNER_FILE for p in Path(f).iterdir())
            for f in folders
        )

    try:
        victim = None
        deadline = time.monotonic() + 120
        while not (victim and serving()) and time.monotonic() < deadline and proc.poll() is None:
            victim = next(iter(expert_pids()), None)
            time.sleep(0.05)
        assert victim is not None and serving(), "the run never started serving"
        os.kill(victim, signal.SIGKILL)
        successor = None
        while successor is None and time.monotonic() < deadline and proc.poll() is None:
            successor = next(iter(expert_pids() - {victim}), None)
            time.sleep(0.05)
        assert successor is not None, "no new instance of s1.e0 was started"
        assert proc.poll() is None, "the run ended when one expert instance died"
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert not new_shm_runs(before)


# --- deployment files -----------------------------------------------------------------------------


def test_every_expert_function_is_deployed_and_its_dispatch_calls_them(expert_bundle, tmp_path):
    import yaml

    from tests.test_sam import _lints_clean, lambda_template_of

    stack = yaml.safe_load((expert_bundle / "stack.yml").read_text())["functions"]
    experts = sorted(n for n in stack if n.split("-")[-1].startswith("e"))
    assert len(experts) == 8, sorted(stack)
    dispatch = next(v for n, v in stack.items() if n.endswith("-s1"))
    calls = dispatch["environment"]["MOPAR_CALLS"].split(",")
    assert len(calls) == 4 and all("-s1-e" in c for c in calls)
    warm = dispatch["environment"]["MOPAR_WARM"].split(",")  # the next layer's, pre-warmed
    assert len(warm) == 4 and all("-s3-e" in c for c in warm)
    last = next(v for n, v in stack.items() if n.endswith("-s3"))
    assert "MOPAR_WARM" not in last["environment"]
    template = lambda_template_of(expert_bundle, tmp_path / "template.yaml")  # planned for Lambda
    resources = [
        r
        for r, v in template["Resources"].items()
        if v["Type"] in ("AWS::Serverless::Function", "AWS::Lambda::Function")
    ]
    assert len([r for r in resources if re.search(r"S[13]E[0-3]$", r)]) == 8
    s1 = next(v for r, v in template["Resources"].items() if r.endswith("S1"))["Properties"]
    targets = [x["Ref"] for x in s1["Environment"]["Variables"]["MOPAR_WARM"]["Fn::Join"][1]]
    assert len(targets) == 4 and all(re.search(r"S3E[0-3]$", t) for t in targets)
    invokable = {p["LambdaInvokePolicy"]["FunctionName"]["Ref"] for p in s1["Policies"]}
    assert set(targets) <= invokable
    _lints_clean(tmp_path / "template.yaml")


# --- planning, tracing, inspecting ----------------------------------------------------------------


def test_small_experts_stay_inline_by_default_and_the_plan_says_why():
    proc = mopar_in_process("plan", "examples.moe:mixtral_tiny", *_flags(), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(proc.stdout)
    assert {f["kind"] for f in plan["functions"]} == {"slice"}
    assert any(
        "kept inline as their" in n and "cheaper" in n and "runtime baseline" in n
        for n in plan["notes"]
    )


@pytest.mark.slow  # the default zoo's Mixtral compiles with its experts inline, and matches
def test_inline_experts_compile_exactly(tmp_path):
    proc = mopar(
        "compile",
        "examples.moe:qwen2_moe_tiny",
        *_flags(),
        "--experts",
        "inline",
        "--slices",
        "2",
        "--no-check-latency",
        "--out",
        tmp_path / "b",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["max_abs_err"] <= 1e-4
    assert {f["kind"] for f in doc["plan"]["functions"]} == {"slice"}


def test_profile_experts_prints_the_matrix_and_draws_it(tmp_path):
    png = tmp_path / "heat.png"
    proc = mopar_in_process(
        "profile",
        "experts",
        "examples.moe:qwen2_moe_tiny_zipf",
        *_flags(),
        "--calibration",
        CALIBRATION,
        "--plot",
        png,
        "--json",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert len(doc["layers"]) == 2
    for layer in doc["layers"]:  # every routed token counted once per top-k slot
        assert sum(layer["tokens"]) == doc["requests"] * doc["tokens_per_request"] * 2
        assert all(0 < p <= 1 for p in layer["invoked"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "flags",
    [("--codec", "zstd"), pytest.param(("--parallel", "2"), marks=pytest.mark.slow)],
)
def test_options_expert_functions_do_not_support_yet_are_refused_in_one_line(tmp_path, flags):
    proc = mopar_in_process(
        "compile",
        "examples.moe:mixtral_tiny",
        *_flags(),
        "--expert-group",
        "2",
        *flags,
        "--out",
        tmp_path / "b",
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "expert functions is not supported yet" in line and "--experts inline" in line
    assert "Traceback" not in proc.stderr and not (tmp_path / "b").exists()


def test_profile_experts_refuses_a_dense_model_in_one_line():
    proc = mopar_in_process(
        "profile",
        "experts",
        "examples.cnn:resnet50_tiny",
        "--input",
        "x=1x3x64x64:float32",
        "--calibration",
        CALIBRATION,
    )
    assert proc.returncode == 1
    assert "no mixture-of-experts layer" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow  # the qwen2 .pt2 recognition test checks the roles through the API, and the
# transformers mixtral .pt2 inspect (test_frontend_load) the command on an MoE model
def test_inspect_lists_the_experts():
    proc = mopar("inspect", "examples.moe:qwen2_moe_tiny", *_flags(), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    moe = doc["moe"]
    roles = {la["name"]: la.get("role") for la in doc["layers"]}
    assert roles["layers.0.moe.experts"] == "experts" and roles["layers.0.moe.gate"] == "router"
    assert roles["layers.1.moe.shared_expert.up_proj"] == "shared expert"
    assert roles["layers.0.attn.q_proj"] is None
    assert [m["layer"] for m in moe] == ["layers.0.moe.experts", "layers.1.moe.experts"]
    assert all(
        m["experts"] == 8
        and m["top_k"] == 2
        and m["params_per_expert"] == 3 * 64 * 64
        and m["shared"].endswith("shared_expert")
        for m in moe
    )


def test_the_dense_translation_in_torch_matches_per_token_experts():
    """The translation weights each expert by the token's top-k weight where chosen, else 0."""
    torch.manual_seed(0)
    experts = [torch.nn.Linear(4, 4) for _ in range(3)]
    x = torch.randn(5, 4)
    index = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    weights = torch.rand(5, 2)
    with torch.no_grad():
        got = dense_translation(experts, x, index, weights)
        want = torch.stack(
            [
                sum(weights[t, j] * experts[int(index[t, j])](x[t]) for j in range(2))
                for t in range(5)
            ]
        )
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("b, s", [(1, 1), (1, 128), (3, 16)])
def test_compiled_expert_functions_are_exact_at_every_shape(tmp_path, b, s):
    """The bundle, not only the graph: ONNX expert functions with their dynamic token count,
    the dispatch and its tail, chained in onnxruntime and served by `mopar run`."""
    out = tmp_path / "b"
    proc = mopar(
        "compile",
        "examples.moe:qwen2_moe_tiny",
        *_flags(b, s),
        "--expert-group",
        "4",
        "--hot-experts",
        "none",
        "--out",
        out,
        "--json",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["max_abs_err"] <= 1e-4
    run = mopar("run", out, "--check", "--requests", "2", "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["max_abs_err"] <= 1e-4
