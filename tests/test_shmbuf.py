"""Reusable shared-memory buffers: what one process writes in place, another reads back as a view."""

from __future__ import annotations

import numpy as np
import pytest

from mopar.runner.shmbuf import BufferPool

ARRAYS = {
    "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
    "scalar": np.array(7, dtype=np.int64),
    "f64": np.linspace(0, 1, 5),
    "empty": np.zeros((0, 3), np.float32),
    "bool": np.array([True, False, True]),
}


@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_a_tensor_written_by_one_pool_is_read_back_by_another(tmp_path, name):
    writer, reader = BufferPool(tmp_path), BufferPool(tmp_path)
    writer.write("r0x0-v0.t", ARRAYS[name])
    got = reader.read("r0x0-v0.t")
    assert got.dtype == ARRAYS[name].dtype and got.shape == ARRAYS[name].shape
    np.testing.assert_array_equal(got, ARRAYS[name])


def test_a_raw_tensor_is_read_as_an_aligned_view_over_the_buffer(tmp_path):
    pool = BufferPool(tmp_path)
    pool.write("r0x0-v0.t", np.ones((4, 4), np.float64))
    got = pool.read("r0x0-v0.t")
    assert not got.flags.owndata and got.flags.aligned and got.flags.c_contiguous


def test_a_buffer_grows_for_a_larger_tensor_and_the_reader_follows(tmp_path):
    writer, reader = BufferPool(tmp_path), BufferPool(tmp_path)
    writer.write("r0x0-v0.t", np.ones(4, np.float32))
    np.testing.assert_array_equal(reader.read("r0x0-v0.t"), np.ones(4, np.float32))
    big = np.arange(1 << 20, dtype=np.float32)
    writer.write("r0x0-v0.t", big)
    np.testing.assert_array_equal(reader.read("r0x0-v0.t"), big)
    writer.write("r0x0-v0.t", np.zeros(3, np.int32))  # smaller again: same file, no shrink
    np.testing.assert_array_equal(reader.read("r0x0-v0.t"), np.zeros(3, np.int32))
    assert [p.name for p in tmp_path.iterdir()] == ["r0x0-v0.t"]


@pytest.mark.parametrize("codec", ["zstd", "fp16", "int8+zstd"])
def test_an_encoded_tensor_goes_in_the_same_buffer_with_its_length(tmp_path, codec):
    pool = BufferPool(tmp_path)
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    pool.write("r0x0-v0.t", x, codec=codec)
    np.testing.assert_allclose(pool.read("r0x0-v0.t"), x, atol=0.05)


def test_reading_a_buffer_never_written_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        BufferPool(tmp_path).read("r0x0-v0.t")
