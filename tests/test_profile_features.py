"""Feature rows and vectors: the fixed layout, CSV-style rows, and layers of tiny real models."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from mopar import api
from mopar.profile.features import (
    FAMILIES,
    FEATURE_NAMES,
    TIME_FEATURE_NAMES,
    Roofline,
    feature_matrix,
    feature_vector,
    layer_features,
    op_family,
    row_family,
    time_features,
)


class Mixed(nn.Module):
    """conv -> depthwise conv -> pool to a sequence -> LSTM -> dot-product attention -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.pool = nn.AdaptiveAvgPool2d((1, 4))
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.attn = DotAttention()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = self.pool(self.dw(self.conv(x))).flatten(2)  # (batch, 8 steps, 4 features)
        h, _ = self.lstm(seq)
        return self.fc(self.attn(h)[:, -1])


class DotAttention(nn.Module):
    """softmax(h h^T / sqrt(d)) h, without parameters: decomposed attention."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(h, h.transpose(1, 2)) / math.sqrt(h.shape[-1])
        return torch.matmul(torch.softmax(scores, dim=-1), h)


@pytest.fixture(scope="module")
def mixed():
    torch.manual_seed(0)
    return api.analyze(Mixed().eval(), {"x": torch.randn(2, 3, 8, 8)}).layers


def _layer(lg, name):
    return next(la for la in lg.layers if la.name == name)


def _onehot(vector: np.ndarray) -> str:
    (hot,) = np.flatnonzero(vector[: len(FAMILIES)])
    return FAMILIES[hot]


# --- layout and rows --------------------------------------------------------------------------


def test_the_layout_is_one_hot_families_then_logs_then_raw_numbers():
    assert len(FEATURE_NAMES) == len(set(FEATURE_NAMES)) == len(FAMILIES) + 7 + 5
    assert FEATURE_NAMES[: len(FAMILIES)] == tuple(f"op_{f}" for f in FAMILIES)
    raw = ("n_inputs", "output_rank", "batch_size", "kernel_size", "channels")
    assert FEATURE_NAMES[-5:] == raw


def test_time_features_add_bytes_moved_intensity_and_the_roofline_in_logs():
    assert TIME_FEATURE_NAMES[: len(FEATURE_NAMES)] == FEATURE_NAMES
    row = {"op_type": "Gemm", "flops": 2e6, "bytes_in": 4e3, "bytes_out": 4e3, "param_bytes": 2e3}
    roof = Roofline(flops_per_ms=1e6, bytes_per_ms=1e5, overhead_ms=0.5)
    (z,) = time_features(feature_matrix([row]), roof)
    f = dict(zip(TIME_FEATURE_NAMES, z))
    assert f["log1p_bytes_moved"] == pytest.approx(math.log1p(1e4))
    assert f["log_intensity"] == pytest.approx(math.log1p(2e6) - math.log1p(1e4))
    assert f["log_roofline_ms"] == pytest.approx(math.log(0.5 + max(2.0, 0.1)))
    (bare,) = time_features(feature_matrix([{"op_type": "relu"}]), roof)
    assert bare[-1] == pytest.approx(math.log(0.5))  # no work: the overhead alone


def test_a_csv_row_of_json_strings_gives_the_documented_numbers():
    row = {
        "op_type": "Conv",
        "params": "448",
        "param_bytes": "1792",
        "flops": "110592",
        "bytes_in": "3072",
        "bytes_out": "8192",
        "input_shapes": json.dumps([[4, 3, 8, 8]]),
        "output_shape": json.dumps([4, 16, 8, 8]),
        "kernel_size": "3",
    }
    f = dict(zip(FEATURE_NAMES, feature_vector(row)))
    assert f["op_conv"] == 1.0 and sum(f[f"op_{x}"] for x in FAMILIES) == 1.0
    assert f["log1p_params"] == pytest.approx(math.log1p(448))
    assert f["log1p_flops"] == pytest.approx(math.log1p(110592))
    assert f["log1p_max_input_numel"] == pytest.approx(math.log1p(4 * 3 * 8 * 8))
    assert f["log1p_output_numel"] == pytest.approx(math.log1p(4 * 16 * 8 * 8))
    assert (f["n_inputs"], f["output_rank"], f["batch_size"]) == (1, 4, 4)
    assert (f["kernel_size"], f["channels"]) == (3, 16)


def test_missing_optional_keys_and_blank_csv_cells_count_zero():
    bare = feature_vector({"op_type": "relu"})
    assert bare.shape == (len(FEATURE_NAMES),)
    assert _onehot(bare) == "elementwise" and bare[len(FAMILIES) :].sum() == 0
    blanks = feature_vector(
        {
            "op_type": "relu",
            "params": "",
            "flops": float("nan"),
            "input_shapes": "",
            "output_shape": None,
        }
    )
    np.testing.assert_array_equal(bare, blanks)


def test_a_row_without_an_op_type_is_refused_by_name():
    with pytest.raises(KeyError, match="op_type"):
        feature_vector({"params": 3})


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("aten.conv2d.default", "conv"),
        ("convolution", "conv"),
        ("ConvTranspose", "conv"),
        ("linear", "gemm"),
        ("addmm", "gemm"),
        ("mm", "gemm"),
        ("Gemm", "gemm"),
        ("MatMul", "matmul"),
        ("bmm", "batched_matmul"),
        ("scaled_dot_product_attention", "attention"),
        ("_scaled_dot_product_flash_attention", "attention"),
        ("lstm", "lstm"),
        ("GRU", "gru"),
        ("LayerNormalization", "layer_norm"),
        ("native_layer_norm", "layer_norm"),
        ("_native_batch_norm_legit_no_training", "batch_norm"),
        ("max_pool2d", "pool"),
        ("adaptive_avg_pool2d", "pool"),
        ("GlobalAveragePool", "pool"),
        ("embedding", "embedding"),
        ("Gather", "embedding"),
        ("_softmax", "softmax"),
        ("add.Tensor", "elementwise"),
        ("gelu", "elementwise"),
        ("relu_", "elementwise"),
        ("cat", "other"),
        ("depthwise_conv", "depthwise_conv"),
        ("no_such_op", "other"),
    ],
)
def test_aten_onnx_and_family_names_map_to_families(name, family):
    assert op_family(name) == family


def test_groups_equal_to_input_channels_make_a_conv_depthwise():
    conv = {"op_type": "conv2d", "input_shapes": [[1, 8, 4, 4]], "groups": 8}
    assert row_family(conv) == "depthwise_conv"
    assert row_family({**conv, "groups": 2}) == "conv"  # grouped, not depthwise
    assert row_family({**conv, "family": "conv"}) == "conv"  # a resolved family wins


def test_a_matmul_of_two_batched_operands_is_a_batched_matmul():
    batched = {"op_type": "matmul", "input_shapes": [[2, 5, 4], [2, 4, 5]]}
    assert row_family(batched) == "batched_matmul"
    assert row_family({"op_type": "matmul", "input_shapes": [[2, 5, 4], [4, 5]]}) == "matmul"


def test_feature_matrix_stacks_rows_and_handles_none():
    rows = [{"op_type": "conv"}, {"op_type": "softmax", "output_shape": [3, 7]}]
    assert feature_matrix(rows).shape == (2, len(FEATURE_NAMES))
    assert feature_matrix([]).shape == (0, len(FEATURE_NAMES))


# --- layers of a real model -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layer", "family"),
    [
        ("conv", "conv"),
        ("dw", "depthwise_conv"),
        ("lstm", "lstm"),
        ("fc", "gemm"),
        ("pool", "pool"),
        ("attn", "attention"),
    ],
)
def test_a_layer_is_one_hot_in_its_dominant_op_family(mixed, layer, family):
    vector = feature_vector(layer_features(_layer(mixed, layer), mixed))
    assert vector.shape == (len(FEATURE_NAMES),)
    assert _onehot(vector) == family


def test_layer_features_are_deterministic(mixed):
    for layer in mixed.layers:
        first = feature_vector(layer_features(layer, mixed))
        again = feature_vector(layer_features(layer, mixed))
        np.testing.assert_array_equal(first, again)


def test_layer_rows_carry_the_layer_measurements(mixed):
    conv = layer_features(_layer(mixed, "conv"), mixed)
    assert (conv["params"], conv["param_bytes"]) == (8 * 3 * 9 + 8, 4 * (8 * 3 * 9 + 8))
    assert conv["flops"] == _layer(mixed, "conv").flops
    assert conv["input_shapes"] == [[2, 3, 8, 8]] and conv["output_shape"] == [2, 8, 8, 8]
    assert (conv["bytes_in"], conv["bytes_out"]) == (4 * 2 * 3 * 8 * 8, 4 * 2 * 8 * 8 * 8)
    f = dict(zip(FEATURE_NAMES, feature_vector(conv)))
    assert (f["kernel_size"], f["channels"], f["batch_size"]) == (3, 8, 2)
    lstm = dict(zip(FEATURE_NAMES, feature_vector(layer_features(_layer(mixed, "lstm"), mixed))))
    assert lstm["channels"] == 6  # the hidden size
    for layer in mixed.layers:
        assert layer_features(layer, mixed)["param_bytes"] == layer.param_bytes


def test_16_bit_weights_cast_where_used_count_as_cast_bytes_and_a_table_does_not():
    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 8)
            self.head = nn.Linear(8, 6)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(ids))

    ids = torch.zeros(1, 5, dtype=torch.int64)
    half = api.analyze(Tokens().to(torch.bfloat16).eval(), {"ids": ids}).layers
    full = api.analyze(Tokens().eval(), {"ids": ids}).layers
    assert layer_features(_layer(half, "embed"), half)["cast_bytes"] == 0  # rows cast alone
    assert layer_features(_layer(half, "head"), half)["cast_bytes"] == 2 * (8 * 6 + 6)
    assert layer_features(_layer(full, "head"), full)["cast_bytes"] == 0
