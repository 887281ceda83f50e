"""Quantised weights (`mopar.compress.quantize`, ``mopar compile --quantize``): the forms
onnxruntime's quantisers make, the choice within a budget, the budget's measures, the options,
and a bundle compiled with them in a fresh process that passes its check."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from mopar.bundle.layout import WEIGHTS_FILE
from mopar.compress.budget import (
    Budget,
    Effect,
    attention_mask,
    effect_of,
    held_out_count,
    interval,
)
from mopar.compress.calibration import Calibration
from mopar.compress.kernels import SCHEMES, Scheme, schemes_for, this_machine
from mopar.compress.quantize import LARGE_MATMUL, Price, choose_forms, weight_bytes, write_form
from mopar.config import CompileConfig
from mopar.errors import OptionError

# --- tiny ONNX functions, written as mopar writes them (weights beside, as external data) ----------


def _model(graph) -> onnx.ModelProto:
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _save(model: onnx.ModelProto, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location=WEIGHTS_FILE)
    return path


def _linear(folder: Path, *, name: str = "x", out: str = "y", width: int = 512, seed: int = 0):
    """x [1, 8, width] -> MatMul (width x width, a large one) -> Relu -> MatMul (width x 16)."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
    w2 = (rng.standard_normal((width, 16)) / np.sqrt(width)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", [name, "w1"], ["h"], name="big"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("MatMul", ["r", "w2"], [out], name="small"),
        ],
        "linear",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 8, width])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, [1, 8, 16])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    return _save(_model(graph), folder)


def _conv(folder: Path) -> Path:
    """img [1, 4, 8, 8] -> Conv (8 x 4 x 3 x 3) -> out [1, 8, 8, 8]."""
    w = np.random.default_rng(1).standard_normal((8, 4, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["img", "w"], ["out"], name="conv", pads=[1, 1, 1, 1])],
        "conv",
        [helper.make_tensor_value_info("img", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 8, 8, 8])],
        [numpy_helper.from_array(w, "w")],
    )
    return _save(_model(graph), folder)


def _ops(path: Path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


def _run(path: Path, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def _samples(name: str, shape: tuple[int, ...], n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [{name: rng.standard_normal(shape).astype(np.float32)} for _ in range(n)]


# --- the forms -----------------------------------------------------------------------------------


def test_int8_makes_matmuls_dynamic_int8_and_keeps_the_outputs_close(tmp_path):
    src = _linear(tmp_path / "f")
    made = write_form(src, tmp_path / "int8", "int8", [])
    onnx.checker.check_model(str(made))
    ops = _ops(made)
    assert ops["MatMulInteger"] == 2 and ops["MatMul"] == 0 and ops["DynamicQuantizeLinear"] >= 1
    assert weight_bytes(made) < 0.3 * weight_bytes(src)
    assert (made.parent / WEIGHTS_FILE).is_file()
    x = _samples("x", (1, 8, 512), 1)[0]
    (want,), (got,) = _run(src, x), _run(made, x)
    assert 0 < np.abs(got - want).max() / np.abs(want).max() < 0.05


def test_int8_takes_gemms_too(tmp_path):
    # onnxruntime has no integer Gemm: its quantiser makes each a float MatMul first
    w = np.random.default_rng(2).standard_normal((64, 128)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["y"], name="fc", transB=1)],
        "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])],
        [numpy_helper.from_array(w, "w")],
    )
    made = write_form(_save(_model(graph), tmp_path / "f"), tmp_path / "int8", "int8", [])
    ops = _ops(made)
    assert ops["MatMulInteger"] == 1 and ops["Gemm"] + ops["MatMul"] == 0


def test_int4_puts_only_large_matmuls_in_four_bits(tmp_path):
    src = _linear(tmp_path / "f")
    made = write_form(src, tmp_path / "int4", "int4", [])
    ops = _ops(made)
    # "big" (512 x 512 = LARGE_MATMUL elements) is 4-bit; "small" (512 x 16) stays int8
    assert 512 * 512 >= LARGE_MATMUL > 512 * 16
    assert ops["MatMulNBits"] == 1 and ops["MatMulInteger"] == 1
    assert weight_bytes(made) < weight_bytes(write_form(src, tmp_path / "int8", "int8", []))
    x = _samples("x", (1, 8, 512), 1)[0]
    (want,), (got,) = _run(src, x), _run(made, x)
    assert np.abs(got - want).max() / np.abs(want).max() < 0.2


def test_int8_convolutions_are_static_qdq_calibrated_on_the_feeds(tmp_path):
    src = _conv(tmp_path / "f")
    feeds = _samples("img", (1, 4, 8, 8), 8)
    made = write_form(src, tmp_path / "int8", "int8", feeds)
    ops = _ops(made)
    assert ops["Conv"] == 1 and ops["QuantizeLinear"] >= 1 and ops["DequantizeLinear"] >= 2
    (want,), (got,) = _run(src, feeds[0]), _run(made, feeds[0])
    assert 0 < np.abs(got - want).mean() / np.abs(want).mean() < 0.05


def test_a_form_that_applies_to_nothing_is_none(tmp_path):
    src = _conv(tmp_path / "f")
    assert write_form(src, tmp_path / "int4", "int4", []) is None  # no MatMul at all
    assert write_form(src, tmp_path / "none", "none", []) is None


def test_a_convolution_before_relu6_is_quantised_over_the_clip_range(tmp_path):
    # conv outputs span about +-100, ReLU6 keeps [0, 6]: quantised over the conv's own range,
    # the 8-bit step (about 0.8) would leave ReLU6 a handful of levels
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((8, 4, 3, 3)) * 10).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["img", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("Clip", ["c", "lo", "hi"], ["r"], name="relu6"),
            helper.make_node("Conv", ["r", "w2"], ["out"], name="project"),
        ],
        "conv_relu6",
        [helper.make_tensor_value_info("img", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 8, 8, 8])],
        [
            numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(np.full((8, 8, 1, 1), 0.125, np.float32), "w2"),
            numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
            numpy_helper.from_array(np.array(6.0, np.float32), "hi"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    (tmp_path / "f").mkdir()
    src = tmp_path / "f" / "model.onnx"
    onnx.save_model(model, str(src), save_as_external_data=True, location=WEIGHTS_FILE)
    feeds = [{"img": rng.standard_normal((1, 4, 8, 8)).astype(np.float32)} for _ in range(8)]
    made = write_form(src, tmp_path / "int8", "int8", feeds)
    ops = Counter(n.op_type for n in onnx.load(str(made), load_external_data=False).graph.node)
    assert ops["Conv"] == 2 and ops["Clip"] == 0  # ReLU6 is the conv output's quantised range
    # unfused (the QDQ arithmetic in float): a fused u8s8 kernel saturates on AVX2 without VNNI
    unfused = ort.SessionOptions()
    unfused.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    run = [
        ort.InferenceSession(str(p), unfused, providers=["CPUExecutionProvider"]).run(
            None, feeds[0]
        )[0]
        for p in (src, made)
    ]
    assert np.abs(run[1] - run[0]).mean() < 0.05  # steps of 6 / 255, not of 200 / 255


def test_int4_quantises_a_matmul_whose_input_comes_from_matmulnbits(tmp_path):
    # big (4-bit, a contrib op: no inferred types after it) -> LayerNorm -> small (int8) -> Add;
    # onnxruntime's dynamic quantiser needs small's output type (MiniLM's int4 failed on it)
    rng = np.random.default_rng(0)
    inits = {
        "w1": (rng.standard_normal((512, 512)) / 23).astype(np.float32),
        "w2": (rng.standard_normal((512, 16)) / 23).astype(np.float32),
        "b1": np.zeros(512, np.float32),
        "g": np.ones(512, np.float32),
        "beta": np.zeros(512, np.float32),
        "b2": np.zeros(16, np.float32),
    }
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"], name="big"),
            helper.make_node("Add", ["h", "b1"], ["hb"], name="bias"),
            helper.make_node("LayerNormalization", ["hb", "g", "beta"], ["n"], name="ln"),
            helper.make_node("MatMul", ["n", "w2"], ["ys"], name="small"),
            helper.make_node("Add", ["ys", "b2"], ["y"], name="bias2"),
        ],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    (tmp_path / "f").mkdir()
    src = tmp_path / "f" / "model.onnx"
    onnx.save_model(model, str(src), save_as_external_data=True, location=WEIGHTS_FILE)
    made = write_form(src, tmp_path / "int4", "int4", [])
    ops = Counter(n.op_type for n in onnx.load(str(made), load_external_data=False).graph.node)
    assert ops["MatMulNBits"] == 1 and ops["MatMulInteger"] == 1
    x = {"x": rng.standard_normal((1, 8, 512)).astype(np.float32)}
    want, got = (
        ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, x)[0]
        for p in (src, made)
    )
    assert np.abs(got - want).max() / np.abs(want).max() < 0.2


# --- the choice ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _T:
    name: str


@dataclass(frozen=True)
class _Unit:
    """What `mopar.runner.inprocess` reads of a unit."""

    name: str
    inputs: tuple[_T, ...]
    outputs: tuple[_T, ...]
    rows: bool = False
    dispatch: None = None


def _price(_name: str, saved: int, _ratio: float) -> Price:
    """A price that falls with every byte saved: the smallest form is the cheapest."""
    return Price(memory_mb=128, cost_per_1m_usd=1.0 - saved / 1e9)


def _choose(
    tmp_path, paths, units, *, mode: str, budget: Budget, n: int = 12, kernels=("avx2", "avx2")
):
    return choose_forms(
        paths,
        units,
        [units[-1].outputs[0].name],
        Calibration(samples=tuple(_samples("x", (1, 8, 512), n)), synthetic=True, source="test"),
        mode=mode,
        budget=budget,
        price=_price,
        max_slowdown=None,
        scratch=tmp_path / "scratch",
        kernels=kernels,
    )


def test_a_forced_form_measures_the_schemes_this_machine_judges_for_the_target(tmp_path):
    paths, units = [_linear(tmp_path / "s0")], [_Unit("s0", (_T("x"),), (_T("y"),))]
    here = _choose(tmp_path, paths, units, mode="int8", budget=Budget())
    schemes = [f.scheme for f in here.measured["s0"] if f.form == "int8"]
    assert schemes == list(schemes_for("avx2", "avx2", convs=False))  # no convs: 3 schemes
    # no budget: the most exact scheme (highest cosine, then error) of those no slower
    fast = [f for f in here.measured["s0"][1:] if f.ms <= f.float_ms] or here.measured["s0"][1:]
    exact = min(fast, key=lambda f: (-(f.effect.cosine or 1.0), f.effect.error))
    assert here.forms["s0"].form == "int8" and here.forms["s0"].scheme == exact.scheme
    assert here.forms["s0"].to_dict()["scheme"] == here.forms["s0"].scheme.name
    vnni_here = _choose(
        tmp_path, paths, units, mode="int8", budget=Budget(), kernels=("avx2", "vnni")
    )
    assert Scheme() not in [f.scheme for f in vnni_here.measured["s0"] if f.form == "int8"]


def test_auto_takes_the_cheapest_form_within_the_budget(tmp_path):
    paths, units = _linear(tmp_path / "s0"), [_Unit("s0", (_T("x"),), (_T("y"),))]
    loose = _choose(tmp_path, [paths], units, mode="auto", budget=Budget(max_output_error=1.0))
    assert loose.forms["s0"].form == "int4"  # the fewest bytes, and within a loose budget
    assert {f.form for f in loose.measured["s0"]} == {"none", "int8", "int4"}
    tight = _choose(tmp_path, [paths], units, mode="auto", budget=Budget(max_output_error=1e-9))
    assert tight.forms["s0"].form == "none" and tight.together.error == 0.0
    int8 = next(f for f in loose.measured["s0"] if f.form == "int8")
    between = Budget(max_output_error=int8.effect.error * 1.0001)
    assert (
        next(f for f in loose.measured["s0"] if f.form == "int4").effect.error > int8.effect.error
    )
    assert _choose(tmp_path, [paths], units, mode="auto", budget=between).forms["s0"].form == "int8"


def test_a_forced_form_applies_without_a_budget_and_stays_within_one(tmp_path):
    paths, units = [_linear(tmp_path / "s0")], [_Unit("s0", (_T("x"),), (_T("y"),))]
    forced = _choose(tmp_path, paths, units, mode="int8", budget=Budget())
    assert forced.forms["s0"].form == "int8" and forced.together.error > 0
    refused = _choose(tmp_path, paths, units, mode="int8", budget=Budget(max_output_error=1e-9))
    assert refused.forms["s0"].form == "none"


def test_forms_that_fit_alone_but_not_together_step_back(tmp_path):
    names = ["x", "t", "y"]
    paths, units = [], []
    for i in range(2):
        paths.append(_linear(tmp_path / f"s{i}", name=names[i], out=f"m{i}", seed=i))
        units.append(_Unit(f"s{i}", (_T(names[i]),), (_T(f"m{i}"),)))
    # s1 reads s0's [1, 8, 16] output: put a 16 -> 512 projection in front of it
    rng = np.random.default_rng(3)
    proj = rng.standard_normal((16, 512)).astype(np.float32)
    w1 = (rng.standard_normal((512, 512)) / np.sqrt(512)).astype(np.float32)
    w2 = (rng.standard_normal((512, 16)) / np.sqrt(512)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["m0", "proj"], ["p"], name="proj"),
            helper.make_node("MatMul", ["p", "w1"], ["h"], name="big"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("MatMul", ["r", "w2"], ["y"], name="small"),
        ],
        "second",
        [helper.make_tensor_value_info("m0", TensorProto.FLOAT, [1, 8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16])],
        [numpy_helper.from_array(a, n) for a, n in ((proj, "proj"), (w1, "w1"), (w2, "w2"))],
    )
    paths[1] = _save(_model(graph), tmp_path / "s1b")
    units[1] = _Unit("s1", (_T("m0"),), (_T("y"),))
    loose = _choose(tmp_path, paths, units, mode="int8", budget=Budget(max_output_error=1.0))
    alone = max(f.effect.error for f in loose.forms.values())
    assert loose.together.error > alone  # the errors add up: the case this test is about
    fitted = _choose(
        tmp_path, paths, units, mode="int8", budget=Budget(max_output_error=alone * 1.0001)
    )
    # one stepped back to a more exact form: float, or a more exact int8 scheme
    assert any(f.effect.error < loose.forms[k].effect.error for k, f in fitted.forms.items())
    assert fitted.together.error <= alone * 1.0001


# --- the budget's measures -------------------------------------------------------------------------


def test_effect_counts_error_top1_and_cosine_per_row():
    ref = {"logits": np.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]], np.float32)}
    got = {"logits": np.array([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]], np.float32)}
    e = effect_of([ref], [got])
    assert e.error == pytest.approx(2 / 3)
    assert e.top1_change == pytest.approx(0.5)
    assert e.cosine == pytest.approx(10 / 14)
    tokens = {"logits": np.zeros((1, 4, 5), np.float32)}
    tokens["logits"][0, :, 1] = 1
    moved = {"logits": tokens["logits"].copy()}
    moved["logits"][0, 3] = np.eye(5)[2]
    assert effect_of([tokens], [moved]).top1_change == pytest.approx(0.25)  # next tokens too
    ids = {"ids": np.arange(4)}
    assert effect_of([ids], [ids]).cosine is None  # integers have no cosine


def test_the_rows_padding_fills_are_not_judged_and_the_pooled_embedding_is():
    ref = np.zeros((1, 4, 3), np.float32)
    ref[0, :, 0] = 1.0
    got = ref.copy()
    got[0, 3] = [0.0, 1.0, 0.0]  # the padding position: orthogonal, its top-1 moved
    mask = np.array([[1, 1, 1, 0]])
    plain = effect_of([{"h": ref}], [{"h": got}])
    assert plain.cosine == pytest.approx(0.0) and plain.top1_change == pytest.approx(0.25)
    masked = effect_of([{"h": ref}], [{"h": got}], masks=[mask])
    assert masked.cosine == pytest.approx(1.0) and masked.top1_change == 0.0
    assert masked.rows == 3 and masked.pooled_cosine == pytest.approx(1.0)
    assert Budget(min_cosine=0.99).admits(masked) and not Budget(min_cosine=0.99).admits(plain)
    sample = {"input_ids": np.ones((1, 4), np.int64), "attention_mask": mask}
    assert attention_mask(sample) is mask and attention_mask({"x": ref}) is None


def test_a_top1_budget_holds_out_samples_enough_to_resolve_it():
    one = Budget(max_top1_change=0.01)
    assert held_out_count(1000, one) == 299  # the rule of three: 3 / 1%
    assert held_out_count(256, one) == 256 - 32  # what there is, less what calibrates
    assert held_out_count(40, one) == 20
    assert held_out_count(100, Budget(min_cosine=0.99)) == 25  # a quarter where nothing binds
    low, high = interval(0, 299)
    assert low == 0.0 and 0.009 < high < 0.0135
    low, high = interval(2, 20)
    assert low < 0.1 < high
    e = Effect(error=0.1, top1_change=0.1, rows=20)
    assert e.top1_interval() == pytest.approx(interval(2, 20))


def test_int8_schemes_follow_the_kernels_they_are_judged_for(tmp_path):
    signed = Scheme()
    assert signed.judged_here("avx2", "avx2") and signed.judged_here("vnni", "avx2")
    assert not signed.judged_here("avx2", "vnni")  # VNNI here would hide AVX2's saturation
    assert Scheme(reduce_range=True).judged_here("avx2", "vnni")
    assert Scheme() not in schemes_for("avx2", "vnni", convs=True)
    assert all(not s.float_convs for s in schemes_for("avx2", "avx2", convs=False))
    assert schemes_for("arm64-dot", "avx2", convs=True) == SCHEMES
    flags = tmp_path / "cpuinfo"
    flags.write_text("processor : 0\nflags : fpu sse avx2 avx512_vnni\n")
    assert this_machine(flags) in ("vnni", "arm64", "arm64-dot")
    flags.write_text("processor : 0\nflags : fpu sse avx2\n")
    assert this_machine(flags) in ("avx2", "arm64", "arm64-dot")


def test_a_scheme_sets_the_weights_sign_range_and_the_convolutions_kept_float(tmp_path):
    src = _conv(tmp_path / "f")
    feeds = _samples("img", (1, 4, 8, 8), 8)
    unsigned = write_form(src, tmp_path / "u8", "int8", feeds, Scheme(weights="u8"))
    inits = onnx.load(str(unsigned)).graph.initializer
    assert any(i.data_type == TensorProto.UINT8 and len(i.dims) == 4 for i in inits)
    kept = write_form(src, tmp_path / "k", "int8", feeds, Scheme(float_convs=1))
    weights = [i for i in onnx.load(str(kept)).graph.initializer if len(i.dims) == 4]
    assert [w.data_type for w in weights] == [TensorProto.FLOAT]
    assert Scheme(reduce_range=True, float_convs=3).name == "u8s8 7-bit, first 3 convs float"


def test_the_budget_binds_only_what_it_names():
    assert Budget().allows(0.0) and not Budget().allows(1e-9)
    cos = Budget(min_cosine=0.99)
    assert cos.allows(0.5, 0.5, 0.995) and not cos.allows(0.0, 0.0, 0.98)
    assert cos.allows(0.1, None, None)  # no float rows: the floor does not bind
    top1 = Budget(max_top1_change=0.01)
    assert top1.allows(0.3, 0.0) and not top1.allows(0.0, 0.02)


# --- options ----------------------------------------------------------------------------------------


def test_options_refuse_what_cannot_work_in_one_line():
    from mopar.arguments import check_choices

    with pytest.raises(OptionError, match="quantize.*int3.*none, auto, int8, int4"):
        CompileConfig(quantize="int3")
    with pytest.raises(OptionError, match="budget.*max-top1-change 1"):
        check_choices(CompileConfig(quantize="auto"))
    check_choices(CompileConfig(quantize="auto", min_cosine=0.99))
    with pytest.raises(OptionError, match="dynamic.*quantize"):
        check_choices(CompileConfig(quantize="int8", dynamic=("x:0=1..4",)))


def test_plan_says_what_quantising_would_save(tmp_path):
    from click.testing import CliRunner

    from mopar.cli import cli

    args = ["plan", "tests.models:mlp", "--input", "x=4x16:float32", "--json"]
    result = CliRunner().invoke(cli, [*args, "--max-top1-change", "1"])
    est = json.loads(result.stdout)["quantize_estimate"]
    assert est["form"] == "int8"
    assert est["quantized_weights_mb"] == pytest.approx(est["weights_mb"] / 4, rel=0.01)
    assert est["quantized_cost_per_1m_usd"] <= est["cost_per_1m_usd"]
    assert "--quantize auto" in est["says"]
    targets = {r["target"]: r for r in est["targets"]}
    assert set(targets) == {"openfaas", "lambda"} and est["targets"][0]["target"] == "openfaas"
    assert targets["lambda"]["int8_kernels"] == "avx2"  # x86_64 promises no VNNI
    assert "--target lambda --quantize auto --max-top1-change 1" in targets["lambda"]["compile"]
    shown = CliRunner().invoke(cli, [*args[:-1], "--max-top1-change", "1"], env={"COLUMNS": "80"})
    assert "int8 weights on each target" in shown.stdout and "lambda" in shown.stdout
    assert max(len(line) for line in shown.stdout.splitlines()) <= 80


# --- a bundle, as users make it ---------------------------------------------------------------------


@pytest.mark.slow  # the forms and the choice are covered above; this is the whole compile
def test_a_quantised_bundle_from_a_saved_program_passes_its_check(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT, mopar

    pt2 = tmp_path / "bert.pt2"
    code = (
        "import torch; from examples.transformer import bert_mini_tiny; "
        "m = bert_mini_tiny(); x = torch.randint(0, 1000, (1, 32)); "
        f"torch.export.save(torch.export.export(m, (x,)), {str(pt2)!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)
    out = tmp_path / "b"
    proc = mopar(
        "compile", pt2, "--quantize", "int8", "--slices", "2", "--out", out, "--no-check-latency"
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((out / "plan.json").read_text())
    forms = {f["name"]: f["quantized"] for f in doc["plan"]["functions"]}
    assert forms and all(
        q["form"] == "int8" and q["bytes"] < q["float_bytes"] for q in forms.values()
    )
    ops = Counter()
    for name in forms:
        ops += _ops(out / "functions" / name / "model.onnx")
        onnx.checker.check_model(str(out / "functions" / name / "model.onnx"))
    assert ops["MatMulInteger"] > 0 and ops["DynamicQuantizeLinear"] > 0
    assert doc["verification"]["atol"] > 1e-4  # widened to what quantising changed
    assert mopar("run", out, "--check", "--requests", "2").returncode == 0
