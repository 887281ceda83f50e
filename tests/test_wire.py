"""The tensor payload format: round trips, and a header that is validated before allocating."""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest

from mopar.runtime.wire import (
    DTYPE_CODES,
    MAX_PAYLOAD_BYTES,
    PayloadError,
    decode,
    encode,
    encode_parts,
)
from tools.profiler.tensorfile import read_tensor, write_tensor

HEAD = struct.Struct("<4sBBBBQ")

ARRAYS = {
    "float32 4-d": np.random.default_rng(0).standard_normal((1, 3, 4, 5)).astype(np.float32),
    "float16": np.arange(12, dtype=np.float16).reshape(3, 4) / 7,
    "float64": np.linspace(-1, 1, 9),
    "int64 big values": np.array([[-(2**62), 2**62 + 5]], dtype=np.int64),
    "int32": np.arange(-5, 5, dtype=np.int32),
    "int16": np.array([-32768, 32767], dtype=np.int16),
    "int8": np.array([-128, 0, 127], dtype=np.int8),
    "uint8": np.arange(256, dtype=np.uint8),
    "bool": np.array([[True, False, True]]),
    "empty": np.zeros((0, 3), dtype=np.float32),
    "empty int64": np.zeros((2, 0, 4), dtype=np.int64),
    "8-d": np.ones((1, 2, 1, 2, 1, 2, 1, 2), dtype=np.float32),
    "non-contiguous": np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2],
    "fortran order": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
}


def _same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", list(ARRAYS))
def test_encode_decode_round_trips(name):
    _same(decode(encode(ARRAYS[name])), ARRAYS[name])


@pytest.mark.parametrize("name", list(ARRAYS))
def test_write_read_round_trips(tmp_path, name):
    path = tmp_path / "r0x0-v0.t"
    write_tensor(path, ARRAYS[name])
    _same(read_tensor(path), ARRAYS[name])
    assert path.read_bytes() == encode(ARRAYS[name])  # the file is exactly the payload


def test_header_layout_is_little_endian_magic_version_dtype_codec_ndim_length_dims():
    data = encode(np.zeros((2, 3), dtype=np.int32))
    magic, version, dtype, codec, ndim, length = HEAD.unpack(data[: HEAD.size])
    assert (magic, version, codec, ndim, length) == (b"MOPT", 2, 0, 2, 24)
    assert dtype == DTYPE_CODES["int32"]
    assert struct.unpack("<2Q", data[HEAD.size : HEAD.size + 16]) == (2, 3)
    assert len(data) == HEAD.size + 16 + 24


def test_write_tensor_leaves_no_temp_file(tmp_path):
    for i in range(3):
        write_tensor(tmp_path / f"r0x{i}-v0.t", np.ones((4, 4), np.float32))
    write_tensor(tmp_path / "r0x0-v0.t", np.zeros(2, np.int64))  # overwrite
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r0x0-v0.t", "r0x1-v0.t", "r0x2-v0.t"]


def test_write_tensor_of_an_unsendable_dtype_leaves_no_file(tmp_path):
    with pytest.raises(PayloadError, match="cannot be sent"):
        write_tensor(tmp_path / "r0x0-v0.t", np.zeros(3, dtype=np.complex64))
    assert list(tmp_path.iterdir()) == []


def test_rank_above_eight_cannot_be_sent():
    with pytest.raises(PayloadError, match="rank 9"):
        encode(np.zeros((1,) * 9, dtype=np.float32))


# --- header validation ----------------------------------------------------------------------------


def _payload(*, magic=b"MOPT", version=2, dtype=1, codec=0, dims=(2, 2), length=None, data=None):
    itemsize = 4
    n = int(np.prod(dims)) if dims else 1
    length = n * itemsize if length is None else length
    data = bytes(n * itemsize) if data is None else data
    return (
        HEAD.pack(magic, version, dtype, codec, len(dims), length)
        + struct.pack(f"<{len(dims)}Q", *dims)
        + data
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"magic": b"NOPE"}, "bad magic"),
        ({"version": 1}, "version 1 is not supported \\(expected 2\\)"),
        ({"version": 3}, "version 3"),
        ({"dtype": 99}, "unknown dtype code 99"),
        ({"dtype": DTYPE_CODES["bfloat16"]}, "unknown dtype code"),
        ({"codec": 200}, "unknown codec code 200"),
        ({"length": 15}, "does not match shape"),
        ({"data": bytes(15)}, "header says 16"),
        ({"data": bytes(17)}, "header says 16"),
    ],
)
def test_decode_rejects_a_bad_header(kwargs, message):
    with pytest.raises(PayloadError, match=message):
        decode(_payload(**kwargs))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"magic": b"NOPE"}, "bad magic"),
        ({"version": 0}, "version 0"),
        ({"dtype": 0}, "unknown dtype code 0"),
        ({"codec": 99}, "unknown codec code 99"),
        ({"length": 32}, "does not match shape"),
    ],
)
def test_read_tensor_rejects_a_bad_header(tmp_path, kwargs, message):
    path = tmp_path / "bad.t"
    path.write_bytes(_payload(**kwargs))
    with pytest.raises(PayloadError, match=message):
        read_tensor(path)


def test_truncated_payloads_are_rejected(tmp_path):
    good = encode(np.arange(16, dtype=np.float32).reshape(4, 4))
    for cut in (3, HEAD.size, HEAD.size + 5, HEAD.size + 16, len(good) - 1):
        with pytest.raises(PayloadError):
            decode(good[:cut])
        path = tmp_path / f"cut{cut}.t"
        path.write_bytes(good[:cut])
        with pytest.raises(PayloadError):
            read_tensor(path)


def test_rank_above_eight_in_a_header_is_rejected():
    bad = HEAD.pack(b"MOPT", 2, 1, 0, 9, 4) + struct.pack("<9Q", *([1] * 9)) + bytes(4)
    with pytest.raises(PayloadError, match="rank 9"):
        decode(bad)


@pytest.mark.parametrize("dims", [(2**40, 2**40), (2**63, 2), (MAX_PAYLOAD_BYTES // 4 + 1,)])
def test_a_header_claiming_a_huge_shape_is_rejected_without_allocating(tmp_path, dims):
    itemsize = 4
    claimed = itemsize
    for d in dims:
        claimed *= d
    head = HEAD.pack(
        b"MOPT", 2, DTYPE_CODES["float32"], 0, len(dims), claimed % 2**64
    ) + struct.pack(f"<{len(dims)}Q", *dims)
    path = tmp_path / "huge.t"
    path.write_bytes(head + bytes(64))
    tracemalloc.start()
    try:
        with pytest.raises(PayloadError, match="limit"):
            read_tensor(path)
        with pytest.raises(PayloadError, match="limit"):
            decode(head + bytes(64))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


# --- bugs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("via", ["bytes", "file"])
def test_a_0_d_tensor_round_trips(tmp_path, via):
    scalar = np.array(3.5, dtype=np.float32)
    if via == "bytes":
        got = decode(encode(scalar))
    else:
        write_tensor(tmp_path / "r0x0-v0.t", scalar)
        got = read_tensor(tmp_path / "r0x0-v0.t")
    _same(got, scalar)


@pytest.mark.parametrize("via", ["bytes", "file"])
def test_a_big_endian_array_round_trips_by_value(tmp_path, via):
    big = np.arange(6, dtype=">f4").reshape(2, 3)
    if via == "bytes":
        got = decode(encode(big))
    else:
        write_tensor(tmp_path / "r0x0-v0.t", big)
        got = read_tensor(tmp_path / "r0x0-v0.t")
    np.testing.assert_array_equal(got, big)


@pytest.mark.parametrize("name", [*ARRAYS, "0-d", "big-endian"])
@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_encode_parts_joined_are_exactly_encode(name, codec):
    array = {
        "0-d": np.array(3.5, dtype=np.float32),
        "big-endian": np.arange(6, dtype=">f4").reshape(2, 3),
    }.get(name, ARRAYS.get(name))
    parts = encode_parts(array, codec)
    assert b"".join(parts) == encode(array, codec)
    _same(decode(b"".join(parts)), array.astype(array.dtype.newbyteorder("=")))


def test_encode_parts_of_a_c_ordered_array_is_a_view_of_its_bytes_not_a_copy():
    array = np.arange(1000, dtype=np.float32)
    _, section = encode_parts(array)
    assert isinstance(section, memoryview)
    array[0] = 42.0  # the view sees the array's own memory
    assert np.frombuffer(section, dtype=np.float32)[0] == 42.0
