"""The pure helpers of the quantisation benchmark (`benchmarks.quantize`)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.quantize import accuracy, mc_terms, stacked


def test_mc_terms_weights_each_function_by_the_share_of_requests_that_invoked_it():
    report = {
        "requests": 4,
        "slices": [
            {"name": "d", "allocated_mb": 1024, "peak_rss_mb": 90.0, "p50_ms": 100.0, "calls": 4},
            {"name": "e", "allocated_mb": 512, "peak_rss_mb": 60.0, "p50_ms": 10.0, "calls": 1},
            {"name": "f", "allocated_mb": 512, "peak_rss_mb": 60.0, "p50_ms": None, "calls": 0},
        ],
    }
    got = mc_terms(report)
    assert got["mc_gb_s"] == pytest.approx(1.0 * 0.1 + 0.5 * 0.01 * 0.25)
    assert [t["share"] for t in got["functions"]] == [1.0, 0.25, 0.0]


def test_accuracy_pools_the_unmasked_tokens_only():
    ref = np.zeros((1, 3, 2), np.float32)
    ref[0, :, 0] = 1.0
    out = ref.copy()
    out[0, 2] = [0.0, 5.0]  # a padded position, orthogonal to its reference
    got = accuracy([{"h": ref}], [{"h": out}], [np.array([[1, 1, 0]])])
    assert got["pooled_cosine_min"] == pytest.approx(1.0)
    assert got["cosine"] == pytest.approx(0.0)  # effect_of's row minimum counts the padding
    assert got["top1_change"] == pytest.approx(1 / 3)


def test_stacked_puts_samples_on_the_first_axis():
    samples = [{"x": np.full((1, 2), i, np.int64)} for i in range(3)]
    got = stacked(samples)
    assert got["x"].shape == (3, 1, 2)
    assert got["x"][2, 0, 1] == 2
