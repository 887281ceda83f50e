"""Codecs at the cuts: round trips, error bounds (against eager PyTorch casts), refused bombs and
malformed sections, the version-2 payload, and a bundle whose manifest sets codecs, served by
real slice processes through /dev/shm."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mopar.codec import (
    CODEC_NAMES,
    CODES,
    Bf16Codec,
    CodecError,
    Fp16Codec,
    Int8Codec,
    PayloadError,
    ZstdCodec,
    codec_for_code,
    get_codec,
)
from mopar.codec.quant import MIN_CHANNEL_ELEMENTS
from mopar.codec.zstd import SPARSE_ZEROS, shuffle, unshuffle
from mopar.errors import BundleError
from mopar.runner.bundle import read_manifest, read_reference
from mopar.runner.local import shm_root
from mopar.runner.shmbuf import BufferPool
from mopar.runtime.wire import DTYPE_CODES, decode, encode
from tests.conftest import run_watched
from tools.profiler.tensorfile import read_tensor, write_tensor

HEAD = struct.Struct("<4sBBBBQ")
LOSSLESS = [n for n in CODEC_NAMES if get_codec(n).lossless] + ["zstd:19", "zstd:-5"]
LOSSY = [n for n in CODEC_NAMES if not get_codec(n).lossless] + ["int8+zstd:1"]
ALL = LOSSLESS + LOSSY

_rng = np.random.default_rng(0)
FLOATS = {
    "float32 NCHW": _rng.standard_normal((2, 16, 9, 9)).astype(np.float32),
    "float32 relu": np.maximum(_rng.standard_normal((1, 8, 16, 16)), 0).astype(np.float32),
    "float16": (_rng.standard_normal((3, 70)) * 10).astype(np.float16),
    "float64 1-d": np.linspace(-3, 7, 101),
    "float32 0-d": np.array(-2.5, dtype=np.float32),
    "float32 empty": np.zeros((0, 3), dtype=np.float32),
    "float32 empty channels": np.zeros((2, 5, 0, 4), dtype=np.float32),
    "float32 non-contiguous": np.arange(96, dtype=np.float32).reshape(8, 12)[:, ::3],
    "float32 big-endian": np.arange(12, dtype=">f4").reshape(3, 4) / 3,
    "float32 constant": np.full((1, 4, 8, 8), 1.25, dtype=np.float32),
}
OTHERS = {
    "int64": np.array([[-(2**62), 2**62 + 5, 0, 7]], dtype=np.int64),
    "int64 indices": np.arange(1000, dtype=np.int64).reshape(10, 100),
    "int8": np.array([-128, 0, 127], dtype=np.int8),
    "bool": np.array([[True, False, True]]),
    "int64 0-d": np.array(9, dtype=np.int64),
    "int64 empty": np.zeros((0,), dtype=np.int64),
}


def _tolerance(codec: str, x: np.ndarray, data: bytes) -> np.ndarray:
    """The error each element of ``x`` may have after a round trip through ``codec``."""
    x64 = np.abs(x.astype(np.float64))
    own = np.finfo(x.dtype).eps * x64  # rounding back into the tensor's own dtype
    if codec.startswith("fp16"):
        return 2.0**-11 * x64 + 2.0**-25 + own
    if codec.startswith("bf16"):
        return 2.0**-8 * x64 + 2.0**-133 + own
    section = zstandard.ZstdDecompressor().decompress(data[1:]) if "+zstd" in codec else data
    step = Int8Codec().steps(section, shape=x.shape).astype(np.float64)
    return step * (0.5 + 1e-4) + 4 * np.finfo(np.float32).eps * float(x64.max(initial=0)) + own


def _round_trip(codec: str, x: np.ndarray) -> tuple[np.ndarray, bytes]:
    c = get_codec(codec)
    data = c.encode(x)
    assert len(data) <= c.max_encoded_bytes(x.dtype, x.shape)
    got = c.decode(data, dtype=x.dtype, shape=x.shape)
    assert got.dtype == x.dtype.newbyteorder("=") and got.shape == x.shape
    assert got.flags.writeable and got.flags.c_contiguous
    return got, data


# --- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("array", list(FLOATS) + list(OTHERS))
@pytest.mark.parametrize("codec", LOSSLESS)
def test_lossless_codecs_round_trip_bit_exactly(codec, array):
    x = {**FLOATS, **OTHERS}[array]
    got, _ = _round_trip(codec, x)
    assert got.tobytes() == x.astype(x.dtype.newbyteorder("=")).tobytes()


@pytest.mark.parametrize("array", list(FLOATS))
@pytest.mark.parametrize("codec", LOSSY)
def test_lossy_codecs_round_trip_within_their_bound(codec, array):
    x = FLOATS[array]
    got, data = _round_trip(codec, x)
    err = np.abs(got.astype(np.float64) - x.astype(np.float64))
    assert np.all(err <= _tolerance(codec, x, data))


@pytest.mark.parametrize("array", list(FLOATS) + list(OTHERS))
@pytest.mark.parametrize("codec", ALL)
def test_payloads_and_files_round_trip_through_the_wire(tmp_path, codec, array):
    x = {**FLOATS, **OTHERS}[array]
    if not get_codec(codec).supports(x.dtype):
        with pytest.raises(PayloadError, match=f"cannot carry {x.dtype.name}"):
            encode(x, codec)
        return
    want = get_codec(codec).decode(get_codec(codec).encode(x), dtype=x.dtype, shape=x.shape)
    payload = encode(x, codec)
    assert HEAD.unpack(payload[: HEAD.size])[1:4] == (
        2,
        DTYPE_CODES[x.dtype.name],
        get_codec(codec).code,
    )
    np.testing.assert_array_equal(decode(payload), want)
    write_tensor(tmp_path / "r0x0-v0.t", x, codec=codec)
    assert (tmp_path / "r0x0-v0.t").read_bytes() == payload
    got = read_tensor(tmp_path / "r0x0-v0.t")
    assert got.dtype == want.dtype and got.shape == x.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8", "int8+zstd"])
@pytest.mark.parametrize("dtype", ["int64", "int32", "bool", "uint8"])
def test_lossy_codecs_refuse_integer_and_bool_tensors(codec, dtype):
    with pytest.raises(CodecError, match=f"cannot carry {dtype} tensors.*use none or zstd"):
        get_codec(codec).encode(np.zeros(4, dtype=dtype))


# --- zstd -----------------------------------------------------------------------------------------


def test_zstd_is_bit_exact_on_special_floats():
    bits = np.array(
        [
            0x7FC00001,
            0xFFC12345,
            0x7F800000,
            0xFF800000,
            0x80000000,
            0x00000001,
            0x7F7FFFFF,
            0x3F800000,
        ],
        dtype=np.uint32,
    )
    x = np.tile(bits, 50).view(np.float32).reshape(4, 100)
    got, _ = _round_trip("zstd", x)
    assert got.view(np.uint32).tobytes() == x.view(np.uint32).tobytes()


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_shuffle_groups_byte_k_of_every_element_and_unshuffle_inverts_it(itemsize):
    raw = np.arange(12 * itemsize, dtype=np.uint8)
    planes = shuffle(raw, itemsize)
    if itemsize > 1:
        assert planes[:12].tolist() == [itemsize * i for i in range(12)]  # every byte 0 first
    back = np.empty_like(raw)
    unshuffle(planes, back, itemsize)
    assert back.tobytes() == raw.tobytes()


def test_dense_floats_are_shuffled_and_come_out_smaller_than_plain_zstd():
    x = np.random.default_rng(5).standard_normal((1, 64, 32, 32)).astype(np.float32)
    plain = zstandard.ZstdCompressor(level=3).compress(x.tobytes())
    section = ZstdCodec().encode(x)
    assert section[0] == 1  # the filter byte: shuffled
    assert len(section) < 0.97 * len(plain)


def test_mostly_zero_tensors_are_not_shuffled_since_zero_runs_compress_better_as_they_are():
    x = np.maximum(np.random.default_rng(5).standard_normal((1, 64, 32, 32)), 0).astype(np.float32)
    assert (x == 0).mean() > SPARSE_ZEROS
    plain = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(x.tobytes())
    section = ZstdCodec().encode(x)
    assert section[0] == 0 and len(section) == 1 + len(plain)
    assert len(ZstdCodec().encode(x)) < len(
        zstandard.ZstdCompressor(level=3).compress(shuffle(x.reshape(-1).view(np.uint8), 4))
    )


def test_zstd_level_changes_the_name_not_the_code():
    assert get_codec("zstd").level == 3
    assert (get_codec("zstd:19").name, get_codec("zstd:19").code) == ("zstd:19", 1)
    assert get_codec("int8+zstd:-2").name == "int8+zstd:-2"
    assert get_codec("zstd:3").name == "zstd"


# --- casts, against eager PyTorch -----------------------------------------------------------------


_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=0, max_dims=3, max_side=9), elements=_f32))
def test_bf16_matches_torch_rounding_and_its_relative_bound(x):
    got, data = _round_trip("bf16", x)
    want = torch.from_numpy(x.copy()).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(got, want)  # both round to nearest even; both overflow to inf
    finite = np.isfinite(got)
    assert np.all(
        np.abs(got[finite] - x[finite]).astype(np.float64) <= _tolerance("bf16", x, data)[finite]
    )


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=0, max_dims=3, max_side=9),
        elements=st.floats(-65504, 65504, width=32),
    )
)
def test_fp16_matches_torch_and_its_relative_bound(x):
    got, data = _round_trip("fp16", x)
    np.testing.assert_array_equal(got, torch.from_numpy(x.copy()).half().float().numpy())
    err = np.abs(got.astype(np.float64) - x.astype(np.float64))
    assert np.all(err <= _tolerance("fp16", x, data))


def test_bf16_rounds_halfway_cases_to_even_and_keeps_nan_and_inf():
    one = 1.0
    x = np.array(
        [
            one + 2**-8,
            one + 3 * 2**-8,
            np.nan,
            -np.inf,
            np.inf,
            -0.0,
            np.frombuffer(struct.pack("<I", 0x7F800001), np.float32)[0],
        ],
        np.float32,
    )
    got, _ = _round_trip("bf16", x)
    assert got[:2].tolist() == [1.0, one + 2**-6]
    assert np.isnan(got[2]) and np.isnan(got[6])  # a NaN whose payload would carry into inf
    assert got[3:5].tolist() == [-np.inf, np.inf] and np.signbit(got[5])


def test_casts_halve_the_bytes_of_float32():
    x = FLOATS["float32 NCHW"]
    assert len(Fp16Codec().encode(x)) == len(Bf16Codec().encode(x)) == x.nbytes // 2


# --- int8 -----------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    x=hnp.arrays(
        st.sampled_from([np.float32, np.float64, np.float16]),
        hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=12),
        elements=st.floats(-1e4, 1e4, width=16),
    ),
    codec=st.sampled_from(["int8", "int8+zstd"]),
)
def test_int8_error_is_at_most_half_a_step_per_channel(x, codec):
    got, data = _round_trip(codec, x)
    err = np.abs(got.astype(np.float64) - x.astype(np.float64))
    assert np.all(err <= _tolerance(codec, x, data))


@pytest.mark.parametrize(
    "shape, channels",
    [
        ((1, 8, 16, 16), 8),  # NCHW: per channel
        ((2, 50, 64), 50),  # (batch, positions, hidden): per position
        ((1, 1000), 1),  # one logit per "channel": per tensor
        ((4, 3, 2, 2), 1),  # 16 elements per channel: per tensor
        ((5,), 1),
        ((), 1),
    ],
)
def test_int8_quantises_per_channel_on_axis_1_when_channels_are_big_enough(shape, channels):
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    data = Int8Codec().encode(x)
    assert struct.unpack("<I", data[:4]) == (channels,)
    assert len(data) == 4 + 8 * channels + x.size
    per = x.size // shape[1] if len(shape) >= 2 else 0
    assert (channels > 1) == (len(shape) >= 2 and per >= MIN_CHANNEL_ELEMENTS)


def test_int8_scales_travel_in_the_section_and_a_constant_channel_is_exact():
    x = np.random.default_rng(3).standard_normal((1, 3, 10, 10)).astype(np.float32)
    x[0, 1] = 7.0
    x[0, 2] *= 100
    data = Int8Codec().encode(x)
    step = Int8Codec().steps(data, shape=x.shape).reshape(-1)
    assert step[1] == 0 and step[2] > 50 * step[0]
    got = get_codec("int8").decode(data, dtype="float32", shape=(1, 3, 10, 10))  # nothing else
    assert np.all(got[0, 1] == 7.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_int8_refuses_nan_and_infinity(bad):
    x = np.ones((2, 3), np.float32)
    x[1, 2] = bad
    with pytest.raises(CodecError, match="NaN or infinite"):
        Int8Codec().encode(x)


def test_int8_refuses_float64_values_beyond_float32_range():
    with pytest.raises(CodecError, match="float32's range"):
        Int8Codec().encode(np.array([-1e300, 1e300]))


# --- the registry ---------------------------------------------------------------------------------


def test_every_name_parses_to_a_codec_with_its_code_and_back():
    assert len(set(CODES.values())) == len(CODES)
    for name, code in CODES.items():
        codec = get_codec(name)
        assert (codec.name, codec.code) == (name, code)
        assert codec_for_code(code).name == name
        assert codec.lossless == (name in ("none", "zstd"))
    assert codec_for_code(200) is None


@pytest.mark.parametrize(
    "name, message",
    [
        ("gzip", "unknown codec 'gzip'"),
        ("zstd+fp16", "unknown codec"),
        ("zstd+zstd", "unknown codec"),
        ("fp16+int8", "unknown codec"),
        ("int8+zstd+zstd", "unknown codec"),
        ("zstd:fast", "level must be an integer"),
        ("zstd:0", "level 0 is ambiguous"),
        ("zstd:23", "from -7 to 22"),
        ("FP16", "unknown codec"),
        ("", "unknown codec"),
        (3, "must be a string"),
        (["zstd"], "must be a string"),
    ],
)
def test_bad_codec_names_are_refused_with_the_list_of_good_ones(name, message):
    with pytest.raises(CodecError, match=message) as info:
        get_codec(name)
    assert "must be a string" in message or "int8+zstd" in str(info.value)


def test_the_codec_package_does_not_import_torch():
    code = "import sys, mopar.codec; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"


# --- bombs ----------------------------------------------------------------------------------------


BOMB_BYTES = 64 << 20


@pytest.fixture(scope="module")
def declared_bomb() -> bytes:
    """A 2 kB zstd section that declares (and holds) 64 MiB of zeros."""
    return b"\0" + zstandard.ZstdCompressor(level=1).compress(bytes(BOMB_BYTES))


@pytest.fixture(scope="module")
def streamed_bomb() -> bytes:
    """The same 64 MiB as a frame with no content size: only decompressing reveals it."""
    cobj = zstandard.ZstdCompressor(level=1).compressobj()
    chunk = bytes(1 << 20)
    frame = b"".join(cobj.compress(chunk) for _ in range(BOMB_BYTES >> 20)) + cobj.flush()
    assert zstandard.frame_content_size(frame) == -1
    return b"\0" + frame


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _refused(fn, match: str) -> None:
    def call():
        with pytest.raises(PayloadError, match=match):
            fn()

    assert _peak_bytes(call) < 8 << 20  # far below the 64 MiB the frame holds


@pytest.mark.parametrize("codec", ["zstd", "fp16+zstd", "bf16+zstd", "int8+zstd"])
def test_a_frame_declaring_more_than_the_tensor_is_refused_before_decompressing(
    declared_bomb, codec
):
    _refused(
        lambda: get_codec(codec).decode(declared_bomb, dtype="float32", shape=(1, 16, 32, 32)),
        "declares 67108864 content bytes.*refused before decompressing",
    )


@pytest.mark.parametrize("codec", ["zstd", "fp16+zstd", "int8+zstd"])
def test_a_frame_inflating_to_more_than_the_tensor_is_stopped_at_the_tensor_size(
    streamed_bomb, codec
):
    _refused(
        lambda: get_codec(codec).decode(streamed_bomb, dtype="float32", shape=(1, 16, 32, 32)),
        "does not decompress to",
    )


@pytest.mark.parametrize("via", ["bytes", "file"])
def test_a_bomb_payload_is_refused_by_decode_and_read_tensor(
    tmp_path, declared_bomb, streamed_bomb, via
):
    for frame, match in ((declared_bomb, "declares"), (streamed_bomb, "does not decompress")):
        dims = (512, 512)  # a 1 MiB tensor, whose zstd bound admits the 2 kB frame
        payload = (
            HEAD.pack(b"MOPT", 2, DTYPE_CODES["float32"], CODES["zstd"], 2, len(frame))
            + struct.pack("<2Q", *dims)
            + frame
        )
        if via == "bytes":
            _refused(lambda payload=payload: decode(payload), match)
        else:
            path = tmp_path / "bomb.t"
            path.write_bytes(payload)
            _refused(lambda path=path: read_tensor(path), match)


def test_an_empty_tensor_takes_no_bytes_from_a_frame():
    frame = b"\0" + zstandard.ZstdCompressor().compress(b"\0")
    with pytest.raises(PayloadError, match="declares 1 content bytes"):
        ZstdCodec().decode(frame, dtype="float32", shape=(0, 4))


# --- malformed sections ---------------------------------------------------------------------------


X = np.random.default_rng(4).standard_normal((1, 4, 8, 8)).astype(np.float32)


def _zstd_frame(section: bytes, filt: int = 0) -> bytes:
    return bytes((filt,)) + zstandard.ZstdCompressor().compress(section)


@pytest.mark.parametrize(
    "codec, data, message",
    [
        ("zstd", b"", "zstd section has filter nothing"),
        ("zstd", b"\2" + ZstdCodec().encode(X)[1:], "has filter 2, expected 0 \\(plain\\) or 1"),
        ("zstd", b"\0MOPT" + bytes(40), "does not start with a zstd frame"),
        ("zstd", b"\1", "does not start with a zstd frame"),
        ("zstd", ZstdCodec().encode(X)[:5], "malformed or truncated"),
        ("zstd", ZstdCodec().encode(X)[:-9], "does not decompress"),
        ("zstd", ZstdCodec().encode(X) + b"junk", "does not decompress"),
        ("zstd", ZstdCodec().encode(X)[:-1] + b"\0", "does not decompress"),  # checksum
        ("zstd", _zstd_frame(X.tobytes()[:-4]), "declares 1020 content bytes.*exactly 1024"),
        ("fp16", bytes(511), "fp16 section has 511 bytes, the tensor needs 512"),
        ("bf16", bytes(513), "bf16 section has 513 bytes"),
        ("fp16+zstd", _zstd_frame(bytes(100)), "fp16 section has 100 bytes"),
        ("fp16+zstd", _zstd_frame(bytes(511)), "not a whole number of 2-byte elements"),
        ("int8", b"\1", "shorter than its 4-byte channel count"),
        ("int8", struct.pack("<I", 3) + bytes(300), "3 channels; a tensor of shape"),
        ("int8", struct.pack("<I", 4) + bytes(32), "int8 section has 36 bytes"),
        (
            "int8",
            struct.pack("<I", 1) + struct.pack("<ff", 0, -1) + bytes(256),
            "negative or non-finite step",
        ),
        ("int8", struct.pack("<I", 1) + struct.pack("<ff", np.nan, 1) + bytes(256), "non-finite"),
        ("int8+zstd", _zstd_frame(b"\1\0"), "shorter than its 4-byte channel count"),
    ],
)
def test_malformed_sections_are_refused_with_a_payload_error(codec, data, message):
    with pytest.raises(PayloadError, match=message):
        get_codec(codec).decode(data, dtype="float32", shape=X.shape)


def _v2(*, dtype="float32", codec=1, dims=(2, 2), length=None, data=b""):
    length = len(data) if length is None else length
    return (
        HEAD.pack(b"MOPT", 2, DTYPE_CODES[dtype], codec, len(dims), length)
        + struct.pack(f"<{len(dims)}Q", *dims)
        + data
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"codec": 8}, "unknown codec code 8"),
        ({"codec": 255}, "unknown codec code 255"),
        (
            {"codec": CODES["fp16"], "dtype": "int64", "data": bytes(8)},
            "codec fp16 \\(code 2\\) cannot carry int64",
        ),
        ({"codec": CODES["int8+zstd"], "dtype": "bool"}, "cannot carry bool"),
        ({"codec": CODES["fp16"], "length": 9, "data": bytes(9)}, "exceeds the 8-byte bound"),
        ({"codec": CODES["zstd"], "length": 10**9}, "exceeds the .*-byte bound of codec zstd"),
        ({"codec": CODES["zstd"], "dims": (2**40, 2**40)}, "byte limit"),
        ({"codec": CODES["zstd"], "length": 20, "data": bytes(4)}, "header says 20"),
    ],
)
def test_the_header_is_checked_against_the_codec_before_decoding(tmp_path, kwargs, message):
    payload = _v2(**kwargs)
    with pytest.raises(PayloadError, match=message):
        decode(payload)
    (tmp_path / "bad.t").write_bytes(payload)
    with pytest.raises(PayloadError, match=message):
        read_tensor(tmp_path / "bad.t")


@settings(max_examples=300, deadline=None)
@given(codec=st.sampled_from(ALL), data=st.data())
def test_a_corrupted_payload_decodes_or_raises_payload_error_never_anything_else(codec, data):
    x = FLOATS["float32 relu"][:, :2, :4]
    good = bytearray(encode(x, codec))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(good) - 1))
        good[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(good)))
    try:
        got = decode(bytes(good[:cut]) if data.draw(st.booleans()) else bytes(good))
    except PayloadError:
        return
    assert isinstance(got, np.ndarray) and got.size <= 1 << 20


# --- a bundle whose manifest sets codecs ----------------------------------------------------------


def _set_codecs(bundle, codecs: dict[str, dict[str, str]]) -> None:
    path = bundle / "plan.json"
    doc = json.loads(path.read_text())
    for s in doc["io"]["functions"]:
        if s["name"] in codecs:
            s["codecs"] = codecs[s["name"]]
    path.write_text(json.dumps(doc, indent=1))


def _cut_codecs(codec: str) -> dict[str, dict[str, str]]:
    # SkipNet in 3 slices: s0 hands t:relu to s1 and s2 (the skip), s1 hands t:tanh to s2.
    return {"s0": {"t:relu": codec}, "s1": {"t:tanh": codec}}


def test_manifest_codecs_are_read_and_absent_means_none(skipnet_bundle, bundle_copy):
    assert all(s.codecs == {} for s in read_manifest(skipnet_bundle).slices)
    _set_codecs(bundle_copy, {"s0": {"t:relu": "int8+zstd:9"}, "s1": {"t:tanh": "none"}})
    assert [dict(s.codecs) for s in read_manifest(bundle_copy).slices] == [
        {"t:relu": "int8+zstd:9"},
        {"t:tanh": "none"},
        {},
    ]


@pytest.mark.parametrize(
    "codecs, message",
    [
        ({"s0": {"t:relu": "gzip"}}, "slice s0, tensor 't:relu': unknown codec 'gzip'"),
        ({"s0": {"t:tanh": "zstd"}}, "names 't:tanh', which is not one of its outputs"),
        ({"s0": ["zstd"]}, "codecs must map tensor names to codec names"),
        ({"s0": {"t:relu": 3}}, "must be a string"),
    ],
)
def test_bad_manifest_codecs_are_a_bundle_error(bundle_copy, codecs, message):
    _set_codecs(bundle_copy, codecs)
    with pytest.raises(BundleError, match=message):
        read_manifest(bundle_copy)


def test_a_lossy_codec_on_an_integer_tensor_is_a_bundle_error(bundle_copy):
    doc = json.loads((bundle_copy / "plan.json").read_text())
    doc["io"]["functions"][0]["outputs"][0]["dtype"] = "int64"
    (bundle_copy / "plan.json").write_text(json.dumps(doc))
    _set_codecs(bundle_copy, {"s0": {"t:relu": "fp16"}})
    with pytest.raises(BundleError, match="codec fp16 cannot carry 't:relu', a int64 tensor"):
        read_manifest(bundle_copy)


@pytest.mark.parametrize(
    "codec, tolerance",
    [
        ("zstd", 1e-4),
        # a level, and bf16 before zstd: the same run as [zstd] and [int8+zstd] (a lossy codec,
        # then zstd), which cover it by default; the round trips above check each codec's bytes
        pytest.param("zstd:-3", 1e-4, marks=pytest.mark.slow),
        ("fp16", 1e-2),
        pytest.param("bf16+zstd", 5e-2, marks=pytest.mark.slow),
        ("int8+zstd", 5e-2),
    ],
)
def test_a_bundle_with_codecs_at_its_cuts_passes_mopar_run_check(bundle_copy, codec, tolerance):
    _set_codecs(bundle_copy, _cut_codecs(codec))
    watched = run_watched(
        "run",
        bundle_copy,
        "--check",
        "--requests",
        "2",
        "--json",
        "--rtol",
        str(tolerance),
        "--atol",
        str(tolerance),
    )
    assert watched.returncode == 0, watched.stderr + watched.stdout
    report = json.loads(watched.stdout)
    assert report["errors"] == 0
    assert report["max_rel_err"] <= tolerance
    if get_codec(codec).lossless:
        assert report["max_rel_err"] <= 1e-5
    else:  # the error shows that the slices really handed over quantised tensors
        assert report["max_rel_err"] > 1e-6


class _Slice:
    """One real slice process (``python -m mopar.runner.worker``) and its request pipe."""

    def __init__(self, function_dir, shm) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mopar.runner.worker", str(function_dir), str(shm), "1"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        assert json.loads(self.proc.stdout.readline())["event"] == "ready"

    def ask(self, msg: dict) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def _buffer_head(path: Path) -> tuple:
    """The wire header of a reusable shm buffer (`mopar.runner.shmbuf`): after its 8-byte offset."""
    data = path.read_bytes()
    (start,) = struct.unpack("<Q", data[:8])
    return HEAD.unpack(data[start : start + HEAD.size])


def test_the_worker_writes_smaller_shm_files_with_zstd_and_the_next_slice_reads_them(
    skipnet_bundle,
):
    inputs, _ = read_reference(skipnet_bundle / "reference.npz")
    shm = Path(tempfile.mkdtemp(prefix="mopar-codec-test-", dir=shm_root()))
    pool = BufferPool(shm)
    first = second = None
    try:
        pool.write("r0x0-v0.t", inputs["x"])
        first = _Slice(skipnet_bundle / "functions" / "s0", shm)
        sizes = {}
        for rid, codec in enumerate(["none", "zstd", "int8+zstd"]):
            msg = {"id": rid, "inputs": {"x": "r0x0-v0.t"}, "outputs": {"t:relu": f"r0x{rid}-v1.t"}}
            if codec != "none":
                msg["codecs"] = {"t:relu": codec}
            assert first.ask(msg)["event"] == "done"
            head = _buffer_head(shm / f"r0x{rid}-v1.t")
            assert head[3] == CODES[codec]
            sizes[codec] = head[5]  # the section's length
        raw, packed = (np.array(pool.read(f"r0x{i}-v1.t")) for i in range(2))
        assert packed.tobytes() == raw.tobytes()
        assert sizes["zstd"] < 0.8 * sizes["none"] and sizes["int8+zstd"] < sizes["none"] / 4
        # The next slice reads the compressed buffer, with no hint but its header.
        second = _Slice(skipnet_bundle / "functions" / "s1", shm)
        for rid in range(3):
            reply = second.ask(
                {
                    "id": rid,
                    "inputs": {"t:relu": f"r0x{rid}-v1.t"},
                    "outputs": {"t:tanh": f"r0x{rid}-v2.t"},
                }
            )
            assert reply["event"] == "done", reply
        assert pool.read("r0x1-v2.t").tobytes() == pool.read("r0x0-v2.t").tobytes()
        reply = first.ask(
            {
                "id": 9,
                "inputs": {"x": "r0x0-v0.t"},
                "outputs": {"t:relu": "r0x9-v1.t"},
                "codecs": {"t:relu": "gzip"},
            }
        )
        assert reply["event"] == "error" and "unknown codec 'gzip'" in reply["message"]
    finally:
        for s in (first, second):
            if s is not None:
                s.close()
        pool.close()
        shutil.rmtree(shm, ignore_errors=True)
