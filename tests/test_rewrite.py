"""Rewrite: splitting the exported graph by a Plan into slice GraphModules."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from mopar import api
from mopar.emit.onnx_export import run_slices_torch
from mopar.errors import InternalError
from mopar.rewrite import output_values, split_by_plan
from tests import models
from tests.conftest import SKIPNET_INPUT, eager, groups_at, plan_of


def _chain_output(lg, slices, inputs):
    values = run_slices_torch(slices, inputs)
    return [values[v] for v in output_values(lg)]


def test_skip_connection_crossing_a_cut_is_handed_over(skipnet_analysis):
    lg = skipnet_analysis.layers
    s0, s1, s2 = split_by_plan(lg, plan_of([["stem", "act"], ["mid1"], ["mid2", "head"]]))
    # act's output (value "t:relu") is read by mid1 and, across the middle slice, by mid2's add.
    assert [t.name for t in s0.outputs] == ["t:relu"]
    assert [t.name for t in s1.inputs] == ["t:relu"]
    assert [t.name for t in s1.outputs] == ["t:tanh"]
    assert {t.name for t in s2.inputs} == {"t:tanh", "t:relu"}
    skip = next(t for t in s2.inputs if t.name == "t:relu")
    assert (skip.shape, skip.dtype, skip.nbytes) == ((1, 8, 8, 8), "float32", 2048)


def test_slice_inputs_are_exactly_the_tensors_made_outside_it(skipnet_analysis):
    lg = skipnet_analysis.layers
    slices = split_by_plan(lg, plan_of([["stem"], ["act", "mid1", "mid2"], ["head"]]))
    assert [[t.name for t in s.inputs] for s in slices] == [["x"], ["t:conv2d"], ["t:add"]]
    assert [[t.name for t in s.outputs] for s in slices] == [
        ["t:conv2d"],
        ["t:add"],
        ["t:conv2d_3"],
    ]


def test_placeholders_of_a_slice_follow_its_inputs(skipnet_analysis):
    lg = skipnet_analysis.layers
    for s in split_by_plan(lg, plan_of([["stem", "act"], ["mid1"], ["mid2", "head"]])):
        placeholders = [n.name for n in s.gm.graph.nodes if n.op == "placeholder"]
        # FX names are identifiers; the public (ONNX) name of a cut tensor is "t:" + that name.
        assert [p if p == "x" else f"t:{p}" for p in placeholders] == [t.name for t in s.inputs]


def _all_partitions(n_layers: int):
    for k in range(n_layers):
        yield from itertools.combinations(range(1, n_layers), k)


@pytest.mark.parametrize("cuts", list(_all_partitions(5)), ids=str)
def test_every_partition_of_skipnet_chains_to_the_eager_output(skipnet_analysis, cuts):
    lg = skipnet_analysis.layers
    names = [la.name for la in lg.layers]
    slices = split_by_plan(lg, plan_of(groups_at(names, cuts)))
    assert len(slices) == len(cuts) + 1
    inputs = skipnet_analysis.captured.inputs
    (got,) = _chain_output(lg, slices, inputs)
    torch.testing.assert_close(got, eager(models.skipnet(), inputs))


@pytest.mark.parametrize(
    "factory, specs, n",
    [
        ("blocknet", [SKIPNET_INPUT], 3),
        ("relu_rename", [SKIPNET_INPUT], 4),
        ("bert", None, 3),
        ("gpt2", ["input_ids=1x16:int64:0..100"], 3),
    ],
)
def test_planned_slices_chain_to_the_eager_output(factory, specs, n):
    from mopar.config import CompileConfig

    analysis = api.analyze(f"tests.models:{factory}", specs or list(models.TEXT_INPUTS))
    lg, cm = analysis.layers, analysis.captured
    config = CompileConfig(slices=n)
    slices = split_by_plan(lg, api.plan_from(analysis, config, api.predict(lg, config)))
    got = _chain_output(lg, slices, cm.inputs)
    want = [torch.from_numpy(cm.reference[name]) for name in cm.output_names]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_parameters_are_copied_only_into_slices_that_read_them(skipnet_analysis):
    lg = skipnet_analysis.layers
    s0, s1 = split_by_plan(lg, plan_of([["stem", "act"], ["mid1", "mid2", "head"]]))
    held = {n.target for n in s0.gm.graph.nodes if n.op == "get_attr"}
    assert held and all(str(t).startswith("stem") for t in held)
    held = {n.target for n in s1.gm.graph.nodes if n.op == "get_attr"}
    assert held and not any(str(t).startswith("stem") for t in held)


def test_plan_that_leaves_layers_out_is_an_internal_error(skipnet_analysis):
    with pytest.raises(InternalError, match="unassigned"):
        split_by_plan(skipnet_analysis.layers, plan_of([["stem", "act"], ["mid1"]]))


def test_output_values_name_the_model_outputs(skipnet_analysis):
    lg = skipnet_analysis.layers
    assert output_values(lg) == ("t:conv2d_3",)
    assert np.asarray(skipnet_analysis.captured.reference["output_0"]).shape == (1, 4, 8, 8)
