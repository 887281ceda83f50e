"""A compile of a large model: weights out of memory while functions are served, a verify that
holds one unit's session at a time, the latency check's room and its verdict."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mopar.pipeline.latency import Slowdown
from mopar.pipeline.release import released, weight_tensors
from mopar.runner.inprocess import OneAtATime, streamed_sessions


def _shared_model():
    torch.manual_seed(0)
    first = torch.nn.Linear(64, 64)
    second = torch.nn.Linear(64, 64)
    second.weight = first.weight  # one Parameter in two modules
    model = torch.nn.Sequential(first, torch.nn.ReLU(), second).eval()
    model.register_buffer("table", torch.arange(12, dtype=torch.bfloat16).reshape(3, 4))
    return model


def test_released_weights_are_on_disk_inside_and_the_same_tensors_after(tmp_path):
    model = _shared_model()
    x = torch.randn(2, 64)
    want = model(x)
    tensors = weight_tensors([model, {"again": [model]}])
    assert len(tensors) == 4  # the shared weight once, two biases, the buffer
    before = [t.clone() for t in tensors]
    with released([model], tmp_path, from_mb=0.0) as mb:
        # at least these tensors' bytes (also any other live tensor on their storages)
        assert mb >= sum(t.numel() * t.element_size() for t in before) / 2**20
        assert all(t.numel() == 0 for t in tensors)
        assert len(list(tmp_path.glob(".weights-*/weights.bin"))) == 1
    assert not list(tmp_path.iterdir())  # the scratch file is gone
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(tensors, before))
    assert model[0].weight is model[2].weight
    assert torch.equal(model(x), want)


def test_a_tensor_outside_the_roots_on_a_weight_storage_is_released_too(tmp_path):
    model = _shared_model()
    alias = model[0].weight.detach()  # another object on the same storage (a loaded program's)
    with released([model], tmp_path, from_mb=0.0):
        assert alias.numel() == 0
    assert torch.equal(alias, model[0].weight)


def test_tensors_on_one_storage_share_the_one_read_back(tmp_path):
    model = _shared_model()
    half = model[0].weight[:32]  # a view: offset 0, the first half of the rows
    tail = model[0].weight[32:]  # a view at an offset
    want = model[0].weight.clone()
    with released([model], tmp_path, from_mb=0.0):
        assert half.numel() == 0 and tail.numel() == 0
    assert torch.equal(model[0].weight, want)
    assert torch.equal(torch.cat([half, tail]), want)
    ptr = model[0].weight.untyped_storage().data_ptr()
    assert half.untyped_storage().data_ptr() == tail.untyped_storage().data_ptr() == ptr
    assert tail.storage_offset() == 32 * 64


def test_released_puts_the_weights_back_when_the_block_fails(tmp_path):
    model = _shared_model()
    want = model[0].weight.clone()
    with pytest.raises(RuntimeError, match="serving failed"):
        with released([model], tmp_path, from_mb=0.0):
            raise RuntimeError("serving failed")
    assert torch.equal(model[0].weight, want) and not list(tmp_path.iterdir())


def test_a_small_model_is_not_released(tmp_path):
    model = _shared_model()
    with released([model], tmp_path) as mb:
        assert mb == 0.0 and model[0].weight.numel() == 64 * 64


def _onnx(tmp_path, name: str, scale: float):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])],
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [helper.make_tensor("k", TensorProto.FLOAT, [2], [scale, scale])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    return path


def test_one_at_a_time_holds_a_single_session(tmp_path):
    sessions = OneAtATime({"a": _onnx(tmp_path, "a", 2.0), "b": _onnx(tmp_path, "b", 3.0)})
    a = sessions["a"]
    assert sessions["a"] is a  # asked again: the same one
    b = sessions["b"]
    assert sessions._open[0] == "b" and b is not a
    assert b.run(None, {"x": np.ones(2, np.float32)})[0].tolist() == [3.0, 3.0]
    assert sorted(sessions) == ["a", "b"] and len(sessions) == 2


def test_a_chain_with_expert_functions_keeps_every_session(tmp_path):
    class Unit:
        def __init__(self, name, rows=False):
            self.name, self.rows, self.dispatch = name, rows, None

    paths = [_onnx(tmp_path, "a", 2.0), _onnx(tmp_path, "b", 3.0)]
    assert isinstance(streamed_sessions(paths, [Unit("a"), Unit("b")]), OneAtATime)
    assert isinstance(streamed_sessions(paths, [Unit("a"), Unit("b", rows=True)]), dict)


def _slowdown(ratio, low, high):
    return Slowdown(
        functions=3,
        rounds=30,
        p50_ms=10.0,
        unsplit_p50_ms=9.5,
        ratio=ratio,
        low=low,
        high=high,
        bound=1.05,
    )


def test_a_plan_measured_over_its_bound_is_not_kept_even_within_the_noise():
    assert not _slowdown(1.02, 0.98, 1.04).misses  # within
    assert not _slowdown(1.04, 1.00, 1.09).misses  # unclear, median at or below the bound
    assert _slowdown(1.056, 1.01, 1.10).misses  # unclear, median above: planned again
    assert _slowdown(1.20, 1.10, 1.30).misses  # over


def test_the_latency_check_needs_room_for_the_unsplit_model_beside_the_plan(monkeypatch):
    import psutil

    from mopar.pipeline.driver import _no_room
    from mopar.plan import Function
    from tests.conftest import chain_plan

    unsplit = chain_plan([Function(name="s0", layers=("a",), memory_mb=3000)], model="m")
    plan = chain_plan(
        [Function(name=f"s{i}", layers=(str(i),), memory_mb=1600) for i in range(2)], model="m"
    )
    free = type("Free", (), {"available": 8000 * 2**20})
    monkeypatch.setattr(psutil, "virtual_memory", lambda: free)
    assert _no_room(unsplit, plan, in_turn=False) == ""  # 6,200 MB of 8,000
    free.available = 6000 * 2**20
    assert _no_room(unsplit, plan, in_turn=False) == (
        "latency check: not run: serving the unsplit model beside the plan needs 6200 MB, "
        "more than this machine has available (6000 MB); the plan's latency is the predicted one"
    )
    # served one function at a time, the largest alone must fit: the unsplit model's 3,000 MB
    assert _no_room(unsplit, plan, in_turn=True) == ""
    free.available = 2900 * 2**20
    assert _no_room(unsplit, plan, in_turn=True).startswith(
        "latency check: not run: serving the unsplit model after the plan needs 3000 MB"
    )


def test_measuring_refuses_more_functions_than_the_machine_holds(monkeypatch):
    import psutil

    from mopar.errors import MoparError
    from mopar.pipeline.serving import room_for
    from mopar.plan import Function
    from tests.conftest import chain_plan

    plan = chain_plan(
        [Function(name=f"s{i}", layers=(str(i),), memory_mb=1600) for i in range(3)], model="m"
    )
    free = type("Free", (), {"available": 5000 * 2**20})
    monkeypatch.setattr(psutil, "virtual_memory", lambda: free)
    room_for(plan)  # 4,800 MB of 5,000
    free.available = 4000 * 2**20
    with pytest.raises(MoparError, match=r"serves its 3 functions at once, 4800 MB as planned, "):
        room_for(plan)
    room_for(plan, in_turn=True)  # one function at a time: 1,600 MB
    free.available = 1500 * 2**20
    with pytest.raises(MoparError, match=r"serves its largest function alone, 1600 MB as "):
        room_for(plan, in_turn=True)
