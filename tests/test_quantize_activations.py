"""Static int8 convolutions keep the range of the activation that follows them
(`mopar.compress.quantize.write_form`)."""

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
