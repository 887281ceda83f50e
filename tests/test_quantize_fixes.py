"""Forms `mopar.compress.quantize.write_form` makes from real exports: a convolution keeps the
range of the activation that follows it; int4 passes values past MatMulNBits on as float."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from mopar.bundle.layout import WEIGHTS_FILE
from mopar.compress.quantize import write_form


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
