"""The layer graph: grouping nodes into layers, the tensors on its edges, and what it measures."""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
import pytest

from mopar import api
from mopar.ir import INPUT, OUTPUT
from tests import models
from tests.conftest import SKIPNET_INPUT

IMAGE = [SKIPNET_INPUT]


def _analyze(factory: str, specs=IMAGE, **kw):
    return api.analyze(f"tests.models:{factory}", specs, **kw)


def names(lg) -> list[str]:
    return [layer.name for layer in lg.layers]


def test_leaf_modules_become_layers_in_call_order(skipnet_analysis):
    lg = skipnet_analysis.layers
    assert names(lg) == ["stem", "act", "mid1", "mid2", "head"]
    assert [la.module_type for la in lg.layers] == ["Conv2d", "ReLU", "Conv2d", "Conv2d", "Conv2d"]
    assert [la.index for la in lg.layers] == list(range(5))


def test_functional_ops_attach_to_the_neighbouring_layer(skipnet_analysis):
    layers = {la.name: la for la in skipnet_analysis.layers}
    # torch.tanh in the root's forward follows mid1; the residual add follows mid2.
    assert layers["mid1"].ops == ("conv2d", "tanh")
    assert layers["mid2"].ops == ("conv2d", "add")


def test_residual_add_inside_a_block_attaches_to_a_leaf_layer_not_to_the_block():
    lg = _analyze("blocknet").layers
    assert names(lg) == ["stem", "block.conv", "block.bn", "head"]
    assert "block" not in names(lg)
    owner = {n: la.name for la in lg.layers for n in la.nodes}
    adds = [n for n in owner if n.startswith("add")]
    assert adds and all(owner[n].startswith("block.") for n in adds)


def test_every_graph_node_belongs_to_exactly_one_layer(skipnet_analysis):
    lg = skipnet_analysis.layers
    body = [n.name for n in lg.gm.graph.nodes if n.op == "call_function"]
    in_layers = [n for la in lg.layers for n in la.nodes]
    assert sorted(in_layers) == sorted(body)
    assert dict(lg.node_layer) == {n: la.name for la in lg.layers for n in la.nodes}


def test_a_module_called_twice_yields_two_layers():
    lg = _analyze("twice").layers
    assert names(lg) == ["conv1", "relu", "conv2", "relu#1"]
    assert lg.layers[1].module_type == lg.layers[3].module_type == "ReLU"
    assert set(lg.layers[1].nodes).isdisjoint(lg.layers[3].nodes)


@pytest.mark.parametrize("factory", ["skipnet", "blocknet", "twice", "relu_rename"])
def test_layer_graph_is_a_dag_whose_layer_order_is_topological(factory):
    lg = _analyze(factory).layers
    graph = lg.graph
    assert nx.is_directed_acyclic_graph(graph)
    assert set(graph.nodes) == {INPUT, OUTPUT, *names(lg)}
    order = {la.name: la.index for la in lg.layers} | {INPUT: -1, OUTPUT: len(lg)}
    for u, v in graph.edges:
        assert order[u] < order[v], (u, v)
    assert graph.in_degree(INPUT) == 0 and graph.out_degree(OUTPUT) == 0


def test_skip_connection_is_an_edge_from_its_maker_to_its_reader(skipnet_analysis):
    graph = skipnet_analysis.layers.graph
    assert graph.has_edge("act", "mid2")
    (skip,) = graph.edges["act", "mid2"]["tensors"]
    assert (skip.name, skip.shape, skip.dtype) == ("t:relu", (1, 8, 8, 8), "float32")


@pytest.mark.parametrize("factory, specs", [("skipnet", IMAGE), ("bert", list(models.TEXT_INPUTS))])
def test_edges_carry_tensors_whose_bytes_are_shape_times_itemsize(factory, specs):
    lg = _analyze(factory, specs).layers
    seen = 0
    for _, _, data in lg.graph.edges(data=True):
        for t in data["tensors"]:
            assert t.nbytes == math.prod(t.shape) * np.dtype(t.dtype).itemsize, t
            seen += 1
        assert data["bytes"] == sum(t.nbytes for t in data["tensors"])
    assert seen >= len(lg)
    # The model inputs and outputs are edges from INPUT and into OUTPUT.
    assert {t.name for _, _, ts in lg.graph.out_edges(INPUT, data="tensors") for t in ts} == {
        t.name for t in lg.inputs
    }


def test_input_and_output_tensors_are_described(skipnet_analysis):
    lg = skipnet_analysis.layers
    (x,) = lg.inputs
    (y,) = lg.outputs
    assert (x.name, x.shape, x.dtype, x.nbytes) == ("x", (1, 3, 8, 8), "float32", 768)
    assert (y.name, y.shape, y.dtype, y.nbytes) == ("output_0", (1, 4, 8, 8), "float32", 1024)


def test_param_bytes_of_a_conv2d_layer_count_weight_and_bias():
    lg = _analyze("conv_only").layers
    (conv,) = lg.layers
    assert conv.param_bytes == (8 * 3 * 3 * 3 + 8) * 4
    assert lg.param_bytes == (8 * 3 * 3 * 3 + 8) * 4


def test_model_param_bytes_equal_the_modules_parameters(skipnet_analysis):
    model = models.skipnet()
    expected = sum(p.numel() * p.element_size() for p in model.parameters())
    assert skipnet_analysis.layers.param_bytes == expected
    assert sum(la.param_bytes for la in skipnet_analysis.layers) == expected


def test_flops_of_a_linear_layer_count_a_multiply_add_as_two():
    (fc,) = _analyze("linear_only", ["x=1x16:float32"]).layers.layers
    assert fc.ops == ("linear",)
    assert fc.flops == 2 * 16 * 32
    assert fc.param_bytes == (16 * 32 + 32) * 4


def test_flops_of_a_conv2d_layer_are_two_macs_per_output_element():
    (conv,) = _analyze("conv_only").layers.layers
    out_elements = 1 * 8 * 6 * 6
    assert conv.flops == 2 * out_elements * (3 * 3 * 3)


def test_activation_and_output_bytes_of_a_layer(skipnet_analysis):
    layers = {la.name: la for la in skipnet_analysis.layers}
    assert layers["stem"].activation_bytes == 8 * 8 * 8 * 4
    assert layers["head"].output_bytes == 4 * 8 * 8 * 4


def test_depth_groups_layers_by_truncated_module_path():
    leaf = _analyze("blocknet").layers
    coarse = _analyze("blocknet", depth=1).layers
    assert names(coarse) == ["stem", "block", "head"]
    assert len(coarse) < len(leaf)
    block = coarse.layers[1]
    assert set(block.nodes) == set(leaf.layers[1].nodes) | set(leaf.layers[2].nodes)
    assert block.param_bytes == leaf.layers[1].param_bytes + leaf.layers[2].param_bytes
