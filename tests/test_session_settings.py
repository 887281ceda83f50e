"""The session settings the compiler writes beside a function's graph, and the handler reads."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mopar.emit import session
from mopar.runtime.handler import SESSION_FILE, SliceHandler, saved_settings


def _model(op: str, rows: int | str, size: int = 8) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    if op == "Conv":
        w = rng.standard_normal((size, size, 3, 3)).astype(np.float32)
        shape: list = [1, size, 5, 5]
        node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    else:
        w = rng.standard_normal((size, size)).astype(np.float32)
        shape = [rows, size]
        node = helper.make_node(op, ["x", "w"], ["y"])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize(
    ("op", "rows", "expected"),
    [
        ("MatMul", 1, {"prepacking": False}),  # a vector: pre-packing buys nothing
        ("Gemm", 1, {"prepacking": False}),
        ("MatMul", 2, {}),  # from two rows on it pays
        ("MatMul", "n", {}),  # rows not static: kept
    ],
)
def test_prepacking_off_only_over_one_row(op, rows, expected):
    assert session.session_settings(_model(op, rows)) == expected


def test_layouts_off_where_their_copy_passes_the_allowance(monkeypatch):
    model = _model("Conv", 1)
    assert session.session_settings(model) == {}  # under the 64 MB floor
    monkeypatch.setattr(session, "COPY_FLOOR_MB", 0.0)
    assert session.session_settings(model) == {"layouts": False}  # 0.27x > 0.15x


def test_large_weights_pin_the_mmap_threshold(monkeypatch):
    monkeypatch.setattr(session, "PIN_FROM_MB", 256 / (1 << 20))  # 256 bytes: the 8x8 weight
    assert session.session_settings(_model("MatMul", 4)) == {
        "mmap_threshold": session.PINNED_MMAP_THRESHOLD
    }


def test_the_handler_runs_under_the_written_settings(tmp_path, monkeypatch):
    monkeypatch.delenv("MOPAR_MMAP_THRESHOLD", raising=False)
    path = tmp_path / "model.onnx"
    onnx.save_model(_model("MatMul", 1), str(path))
    session.write_session(path)
    assert saved_settings(tmp_path / SESSION_FILE) == {"prepacking": False}
    x = np.ones((1, 8), np.float32)
    got = SliceHandler(tmp_path, intra_op_threads=1).handle({"x": x})["y"]
    w = numpy_helper.to_array(_model("MatMul", 1).graph.initializer[0])
    np.testing.assert_allclose(got, x @ w, rtol=1e-5)
    onnx.save_model(_model("MatMul", 2), str(path))
    session.write_session(path)  # the defaults again: the stale file goes
    assert not (tmp_path / SESSION_FILE).exists()


@pytest.mark.parametrize("text", ["{", '{"prepacking": 1}', '{"arena": true}', "[]"])
def test_settings_that_are_not_ours_are_refused(tmp_path, text):
    (tmp_path / SESSION_FILE).write_text(text)
    with pytest.raises(ValueError, match="is not session settings: recompile the bundle"):
        saved_settings(tmp_path / SESSION_FILE)


def test_a_cast_of_a_16_bit_weight_waits_for_its_users_input(tmp_path):
    w = numpy_helper.from_array(np.ones((8, 8), np.float16), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["w"], ["wide"], to=TensorProto.FLOAT),
            helper.make_node("Transpose", ["wide"], ["wide_t"]),
            helper.make_node("MatMul", ["x", "wide_t"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [w],
    )
    path = tmp_path / "model.onnx"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save_model(model, str(path))
    session.write_session(path)
    assert saved_settings(tmp_path / SESSION_FILE) == {"folding": False, "layouts": False}
    nodes = onnx.load(str(path)).graph.node
    assert [n.op_type for n in nodes] == [
        "Shape",
        "Concat",
        "Reshape",
        "Cast",
        "Transpose",
        "MatMul",
    ]
    assert nodes[0].input[0] == "x"  # the cast waits for x, through the Transpose
    x = np.arange(8, dtype=np.float32)[None]
    got = SliceHandler(tmp_path, intra_op_threads=1).handle({"x": x})["y"]
    np.testing.assert_array_equal(got, x @ np.ones((8, 8), np.float32))
    assert 0 < session.cast_share(path) < 1


def test_the_quantisers_see_cast_16_bit_weights_as_float32_initializers(tmp_path):
    from mopar.compress.quantize import _constant_ops, _widen_casts

    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 4)).astype(np.float16)
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["w"], ["wide"], to=TensorProto.FLOAT),
            helper.make_node("Transpose", ["wide"], ["wide_t"]),
            helper.make_node("MatMul", ["x", "wide_t"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    session.cast_after_inputs(model.graph)  # as compile writes it
    assert "MatMul" not in _constant_ops(model)
    _widen_casts(model)
    assert [n.op_type for n in model.graph.node] == ["MatMul"]
    (weight,) = model.graph.initializer
    np.testing.assert_array_equal(numpy_helper.to_array(weight), w.astype(np.float32).T)
    assert _constant_ops(model)["MatMul"] == [(model.graph.node[0].name, 32)]


def test_prepacking_off_where_its_copy_of_the_largest_layer_passes_the_allowance(monkeypatch):
    monkeypatch.setattr(session, "COPY_FLOOR_MB", 0.0)  # one layer: all of the weights
    assert session.session_settings(_model("MatMul", 2)) == {"prepacking": False}
