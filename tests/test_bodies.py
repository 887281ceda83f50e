"""Standard request and answer bodies (`mopar.runtime.bodies`): JSON, .npy and .npz besides the
frame, at every door (the function server, the Lambda handler, ``mopar serve``) and in the client
(``mopar invoke``).

The unit tests use hand-made tensor specs; the doors run the shared SkipNet bundle (read-only).
The end-to-end test sends a JSON body with the real ``curl`` to ``mopar serve`` on a free
127.0.0.1 port and stops every process it started.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import shutil
import subprocess
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import psutil
import pytest
from click.testing import CliRunner

from mopar.bundle.function import TensorSpec
from mopar.cli import cli
from mopar.runner.bundle import read_manifest, read_reference
from mopar.runner.check import compare_outputs
from mopar.runner.processes import free_port
from mopar.runtime import bodies, oip
from mopar.runtime.bodies import Format, Limits
from mopar.runtime.core import RequestError
from mopar.runtime.frame import decode_payloads, encode_frame, split_frame
from mopar.runtime.httpd import PEEK_BYTES
from mopar.runtime.server import app_from_env
from tests.conftest import MOPAR, ROOT, pid_alive, served
from tests.test_lambda import Context, _chain

X = TensorSpec(name="x", shape=(1, 3, 4), dtype="float32")
IDS = TensorSpec(name="ids", shape=(1, 5), dtype="int64")
IO = (X, IDS)
RNG = np.random.default_rng(0)
GOOD = {
    "x": RNG.standard_normal((1, 3, 4)).astype(np.float32),
    "ids": np.arange(5, dtype=np.int64).reshape(1, 5),
}


def _npy(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=True)
    return buf.getvalue()


def _npz(compressed: bool = False, **arrays) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()


def _json(**inputs) -> bytes:
    return json.dumps({"inputs": {k: np.asarray(v).tolist() for k, v in inputs.items()}}).encode()


def _same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(got[k], want[k])


# --- decoding, each format -------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type, body",
    [
        ("application/json", _json(**GOOD)),
        ("application/json; charset=utf-8", _json(**GOOD)),
        ("text/plain", _json(**GOOD)),  # faas-cli invoke's default type
        ("application/x-npz", _npz(**GOOD)),
        ("application/x-npz", _npz(compressed=True, **GOOD)),
        ("application/octet-stream", _npz(**GOOD)),  # sniffed: PK
        ("", _npz(ids=GOOD["ids"], x=GOOD["x"])),  # no type; any order of members
        ("application/octet-stream", encode_frame(GOOD)),
        (None, encode_frame(GOOD)),
    ],
)
def test_every_format_decodes_to_the_declared_tensors_in_their_order(content_type, body):
    _same(bodies.decode_request(body, content_type, IO), GOOD)


def test_json_numbers_take_the_declared_dtype_and_npy_serves_a_one_input_function():
    got = bodies.decode_request(_json(x=GOOD["x"].astype(np.float64)), "application/json", (X,))
    assert got["x"].dtype == np.float32
    np.testing.assert_allclose(got["x"], GOOD["x"], rtol=1e-7)
    for kind in ("application/x-npy", "application/octet-stream"):  # declared, and sniffed
        _same(bodies.decode_request(_npy(GOOD["x"]), kind, (X,)), {"x": GOOD["x"]})
    big_endian = GOOD["x"].astype(">f4")
    assert bodies.decode_request(_npy(big_endian), "application/x-npy", (X,))["x"].dtype == "<f4"


def test_rows_tensors_take_from_one_to_their_rows():
    tokens = TensorSpec(name="t", shape=(8, 2), dtype="float32", rows=True)
    got = bodies.decode_request(_json(t=np.ones((3, 2))), "application/json", (tokens,))
    assert got["t"].shape == (3, 2)


# --- refusals: one line, 4xx, naming the input, what was expected and what came --------------


class _Boom:
    def __reduce__(self):
        return (Path("/tmp/mopar-bodies-unpickled").touch, ())


_OBJECTS = np.array([_Boom()], dtype=object)


@pytest.mark.parametrize(
    "content_type, body, status, words",
    [
        ("text/csv", b"x", 415, "content type 'text/csv' is not served"),
        ("application/x-www-form-urlencoded", _json(**GOOD), 415, "Content-Type: application/json"),
        ("application/json", b"{not json", 400, "not JSON"),
        ("application/json", b"[1, 2]", 400, '{"inputs"'),
        ("application/json", json.dumps({"x": 1}).encode(), 400, "got keys ['x']"),
        ("application/json", _json(x=GOOD["x"]), 400, "lacks ['ids']"),
        ("application/json", _json(**GOOD, y=[1]), 400, "unexpected ['y']"),
        ("application/json", _json(x=GOOD["x"][..., :3], ids=GOOD["ids"]), 400, "'x' is [1, 3, 3]"),
        (
            "application/json",
            json.dumps({"inputs": {"x": [[[1, 2], [3]]], "ids": [[0] * 5]}}).encode(),
            400,
            "'x' is not a rectangular",
        ),
        (
            "application/json",
            json.dumps({"inputs": {"x": [[["a"] * 4] * 3], "ids": [[0] * 5]}}).encode(),
            400,
            "'x' holds text values",
        ),
        ("application/json", _json(x=GOOD["x"], ids=[[0.5] * 5]), 400, "'ids' holds fractional"),
        ("application/json", _json(x=GOOD["x"], ids=[[2**70] * 5]), 400, "out of range"),
        ("application/json", _json(x=GOOD["x"], ids=[[2**63] * 5]), 400, "outside int64"),
        (
            "application/x-npz",
            _npz(x=GOOD["x"].astype(np.float64), ids=GOOD["ids"]),
            400,
            "'x' is float64",
        ),
        ("application/x-npz", _npz(x=GOOD["x"]), 400, "lacks ['ids']"),
        ("application/x-npz", _npz(x=GOOD["x"], ids=_OBJECTS), 400, "allow_pickle=False"),
        ("application/x-npz", b"PK\x03\x04 not really a zip", 400, "not a readable zip"),
        ("application/x-npy", _npy(GOOD["x"]), 400, "receives 2 tensors"),
        ("application/octet-stream", b"MOPF garbage", 400, "malformed frame"),
        ("application/octet-stream", encode_frame({"x": GOOD["x"]}), 400, "lacks ['ids']"),
    ],
)
def test_a_bad_body_is_refused_in_one_line_naming_what_is_wrong(content_type, body, status, words):
    with pytest.raises(RequestError) as info:
        bodies.decode_request(body, content_type, IO)
    assert info.value.status == status
    assert words in str(info.value) and "\n" not in str(info.value)


def test_npy_and_npz_are_never_unpickled(tmp_path):
    marker = Path("/tmp/mopar-bodies-unpickled")
    marker.unlink(missing_ok=True)
    for content_type, body in (
        ("application/x-npy", _npy(_OBJECTS)),
        ("application/x-npz", _npz(x=_OBJECTS, ids=GOOD["ids"])),
        ("application/x-npy", pickle.dumps(_Boom())),
    ):
        with pytest.raises(RequestError) as info:
            bodies.decode_request(body, content_type, (X,) if "npy" in content_type else IO)
        assert info.value.status == 400
    assert not marker.exists()


def test_an_npz_member_larger_than_its_input_is_refused_before_it_is_inflated():
    bomb = _npz(compressed=True, x=np.zeros((1000, 1000), np.float32), ids=GOOD["ids"])
    assert len(bomb) < 20_000  # 4 MB of zeros, deflated
    with pytest.raises(RequestError, match=r"'x' in the .npz is 4000128 bytes, more than"):
        bodies.decode_request(bomb, "application/x-npz", IO)


def test_a_zip_member_that_is_not_an_npy_is_refused():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("x.txt", "hello")
    with pytest.raises(RequestError, match="holds 'x.txt', not an .npy"):
        bodies.decode_request(buf.getvalue(), "application/x-npz", IO)


# --- the limits -------------------------------------------------------------------------------


def test_each_format_of_the_largest_valid_request_fits_its_limit():
    """Worst cases: float32 values written as float64 reprs (what tolist gives), negative with an
    exponent; an .npz compressed or not; .npy for one input."""
    big = TensorSpec(name="x", shape=(1, 16, 32, 32), dtype="float32")
    x = -np.abs(RNG.standard_normal(big.shape)).astype(np.float32) * np.float32(1e-30)
    limits = Limits.of((big,), frame_bytes=len(encode_frame({"x": x})))
    assert len(_json(x=x)) <= limits.json
    assert len(json.dumps({"inputs": {"x": x.tolist()}}, indent=1)) <= limits.json
    assert len(_npz(x=x)) <= limits.npz and len(_npz(compressed=True, x=x)) <= limits.npz
    assert len(_npy(x)) <= limits.npy
    assert limits.of_format(None) == max(limits.frame, limits.npz, limits.npy)
    assert limits.largest == limits.json  # JSON is the widest format
    assert Limits.of(IO, frame_bytes=1).npy is None  # two inputs: no .npy


# --- formats asked for, and answers ----------------------------------------------------------


@pytest.mark.parametrize(
    "accept, fmt",
    [
        (None, Format.JSON),  # a client's default: JSON, as curl's */* too
        ("", Format.JSON),
        ("*/*", Format.JSON),
        ("application/octet-stream", Format.FRAME),
        ("application/json", Format.JSON),
        ("text/html, application/json;q=0.9, */*;q=0.1", Format.JSON),
        ("application/json;q=0, application/x-npz", Format.NPZ),
        ("application/x-npy", Format.NPY),
    ],
)
def test_accept_picks_the_first_served_format(accept, fmt):
    assert bodies.answer_format(accept) is fmt


def test_an_accept_of_nothing_served_is_a_406():
    with pytest.raises(RequestError) as info:
        bodies.answer_format("text/html")
    assert info.value.status == 406 and "application/json" in str(info.value)


def test_answers_round_trip_in_every_format():
    outputs = {"logits": GOOD["x"], "file": GOOD["ids"]}  # "file" is np.savez's own argument
    for fmt in (Format.FRAME, Format.NPZ):
        body, kind = bodies.encode_answer(outputs, fmt.media_type)
        assert kind == fmt.media_type
        _same(bodies.decode_answer(body, kind), outputs)
    _same(dict(np.load(io.BytesIO(bodies.encode_answer(outputs, "application/x-npz")[0]))), outputs)
    body, kind = bodies.encode_answer(outputs, "application/json")
    assert kind == "application/json"
    assert json.loads(body) == {"outputs": {k: v.tolist() for k, v in outputs.items()}}
    body, kind = bodies.encode_answer({"logits": GOOD["x"]}, "application/x-npy")
    _same({"logits": np.load(io.BytesIO(body), allow_pickle=False)}, {"logits": GOOD["x"]})
    with pytest.raises(RequestError) as info:
        bodies.encode_answer(outputs, "application/x-npy")
    assert info.value.status == 406 and "application/x-npz" in str(info.value)


def test_request_frame_passes_a_frame_through_and_encodes_the_others_with_their_codecs():
    frame = encode_frame(GOOD)
    assert bodies.request_frame(frame, "application/octet-stream", IO) is frame
    half = (TensorSpec(name="x", shape=(1, 3, 4), dtype="float32", codec="fp16"), IDS)
    payloads = split_frame(bodies.request_frame(_json(**GOOD), "application/json", half))
    assert payloads["x"][6] != split_frame(frame)["x"][6]  # the codec byte of the header
    np.testing.assert_allclose(decode_payloads(payloads)["x"], GOOD["x"], rtol=1e-3, atol=1e-3)


# --- the doors, on the shared SkipNet bundle -------------------------------------------------


def _wsgi(app, body: bytes, content_type: str, accept: str | None = None):
    environ = {
        "REQUEST_METHOD": "POST",
        "CONTENT_TYPE": content_type,
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.input": io.BytesIO(body),
        **({"HTTP_ACCEPT": accept} if accept else {}),
    }
    status = []
    out = b"".join(app(environ, lambda s, h: status.append((int(s.split()[0]), dict(h)))))
    return status[0][0], status[0][1], out


@pytest.fixture(scope="module")
def apps(skipnet_bundle):
    """Each function's WSGI app with no MOPAR_NEXT: each answers its own outgoing frame."""
    return [
        app_from_env({"MOPAR_FUNCTION_DIR": str(skipnet_bundle / "functions" / f"s{i}")})
        for i in range(3)
    ]


def test_function_servers_take_json_and_npz_bodies_and_answer_as_accept_asks(apps, skipnet_bundle):
    """The entry takes the model input as JSON; each function answers the next one's body in
    another format, and the last answers JSON equal to the reference."""
    inputs, expected = read_reference(skipnet_bundle / "reference.npz")
    status, headers, body = _wsgi(apps[0], _json(**inputs), "application/json", "application/x-npz")
    assert status == 200 and headers["Content-Type"] == "application/x-npz", body
    status, headers, body = _wsgi(apps[1], body, "application/x-npz", "application/json")
    assert status == 200 and headers["Content-Type"] == "application/json", body
    as_request = json.dumps({"inputs": json.loads(body)["outputs"]}).encode()
    status, headers, body = _wsgi(apps[2], as_request, "application/json", "application/json")
    assert status == 200 and headers["Content-Type"] == "application/json", body
    assert headers["X-Mopar-Timing"].startswith("s2=")
    got = {k: np.asarray(v, np.float32) for k, v in json.loads(body)["outputs"].items()}
    assert compare_outputs(got, expected).max_rel_err <= 1e-5
    # an npz body asking for JSON, and nothing asked: JSON; a frame only where asked by name
    status, _, body = _wsgi(apps[0], _npz(**inputs), "application/x-npz")
    assert status == 200 and "outputs" in json.loads(body)
    frame = "application/octet-stream"
    status, headers, body = _wsgi(apps[0], _npz(**inputs), "application/x-npz", frame)
    assert headers["Content-Type"] == frame and split_frame(body)


@pytest.mark.parametrize(
    "content_type, accept, status, words",
    [
        ("application/json", None, 400, "lacks ['x']"),
        ("text/csv", None, 415, "not served"),
        ("application/json", "text/html", 406, "names no answer format"),
    ],
)
def test_a_function_server_refuses_a_bad_standard_request_and_stays_up(
    apps, skipnet_bundle, content_type, accept, status, words
):
    inputs, _ = read_reference(skipnet_bundle / "reference.npz")
    got, headers, body = _wsgi(apps[0], _json(y=[1]), content_type, accept)
    assert got == status and words in json.loads(body)["error"], body
    assert _wsgi(apps[0], _json(**inputs), "application/json")[0] == 200


def test_a_json_body_over_its_limit_is_refused_from_content_length(apps):
    app = apps[0]
    environ = {
        "REQUEST_METHOD": "POST",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(app.limits.json + 1),
        "wsgi.input": io.BytesIO(b""),  # never read
    }
    status = []
    body = b"".join(app(environ, lambda s, h: status.append(s)))
    assert status[0].startswith("413") and "exceeds" in json.loads(body)["error"]


_X = (TensorSpec(name="x", shape=(1, 3, 8, 8), dtype="float32"),)


def _frame_of(**arrays) -> bytes:
    return encode_frame(arrays)


@pytest.mark.parametrize(
    "encode, what",
    [
        (_npz, ".npz"),
        (lambda **a: _npz(compressed=True, **a), ".npz"),
        (lambda **a: _npy(a["x"]), ".npy"),
        (_frame_of, "frame"),
    ],
)
def test_a_body_over_its_limit_is_refused_for_its_dtype_or_batch_from_its_head(encode, what):
    def refused(array):
        body = encode(x=array)
        environ = {"PATH_INFO": "/", "CONTENT_TYPE": ""}
        return oip.refusal(environ, body[:PEEK_BYTES], _X, size=len(body), limit=1000)

    wrong = refused(np.zeros((1, 3, 8, 8), np.float64))
    assert wrong.status == 400 and f"'x' is float64 [1, 3, 8, 8] in the {what} body" in str(wrong)
    assert "expected float32 [1, 3, 8, 8]" in str(wrong)
    batch = refused(np.zeros((4, 3, 8, 8), np.float32))
    assert batch.status == 400 and "[4, 3, 8, 8]" in str(batch), batch
    assert "compiled for 1 on axis 0; `mopar compile --dynamic x:0=1..4` takes 4" in str(batch)
    fits = refused(np.zeros((1, 3, 8, 8), np.float32))  # only its size is wrong
    assert fits.status == 413 and "exceeds" in str(fits)


def test_an_oip_json_head_is_read_for_its_datatype_and_shape_and_plain_json_only_for_size():
    doc = {"inputs": [{"name": "x", "shape": [1, 3, 8, 8], "datatype": "FP64", "data": [0] * 192}]}
    body = json.dumps(doc).encode()
    v2 = {"PATH_INFO": "/v2/models/m/infer", "CONTENT_TYPE": "application/json"}
    wrong = oip.refusal(v2, body, _X, size=len(body), limit=10)
    assert wrong.status == 400 and "'x' is float64 [1, 3, 8, 8]" in str(wrong)
    plain = _json(x=np.zeros((4, 3, 8, 8), np.float32))
    at_root = {"PATH_INFO": "/", "CONTENT_TYPE": "application/json"}
    assert oip.refusal(at_root, plain, _X, size=len(plain), limit=10).status == 413
    junk = b"\x93NUMPY\x01\x00garbage"
    at_root = {"PATH_INFO": "/", "CONTENT_TYPE": ""}
    assert oip.refusal(at_root, junk, _X, size=10**6, limit=10).status == 413


def test_serve_answers_a_wrong_dtype_or_batch_over_the_limit_with_its_400(skipnet_bundle):
    """Through waitress (`mopar serve`): a body over its limit is read as far as its head, then
    refused with what the head shows; tritonclient's binary request too."""
    import tritonclient.http as httpclient

    def post(address: str, body: bytes) -> tuple[int, str]:
        request = urllib.request.Request(
            f"http://{address}/", data=body, headers={"Content-Type": "application/x-npz"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())["error"]

    with served(skipnet_bundle) as (address, _):
        for dtype, words in ((np.float64, "is float64"), (np.float32, "--dynamic x:0=1..256")):
            body = _npz(x=np.zeros((256, 3, 8, 8), dtype))
            assert len(body) > 2 * PEEK_BYTES  # over the limit, and not read whole
            status, said = post(address, body)
            assert status == 400 and words in said, said
        fits = _npz(x=np.zeros((1, 3, 8, 8), np.float32)) + b"\0" * (8 * PEEK_BYTES)
        status, said = post(address, fits)
        assert status == 413 and "exceeds" in said, said
        client = httpclient.InferenceServerClient(address)
        given = httpclient.InferInput("x", [256, 3, 8, 8], "FP32")
        given.set_data_from_numpy(np.zeros((256, 3, 8, 8), np.float32), binary_data=True)
        with pytest.raises(Exception, match=r"compiled for 1 on axis 0"):
            client.infer(read_manifest(skipnet_bundle).model, [given])
        assert post(address, _npz(x=np.zeros((1, 3, 8, 8), np.float32)))[0] == 200
        client.close()


def _http_event(body: bytes, content_type: str, accept: str, *, binary: bool) -> dict:
    return {
        "version": "2.0",
        "headers": {"content-type": content_type, "accept": accept},
        "requestContext": {"http": {"method": "POST"}},
        "body": base64.b64encode(body).decode() if binary else body.decode(),
        "isBase64Encoded": binary,
    }


def test_the_lambda_handler_takes_json_and_npz_http_bodies_and_a_direct_json_event(
    skipnet_bundle,
):
    inputs, expected = read_reference(skipnet_bundle / "reference.npz")
    first = _chain(skipnet_bundle, {})[0]
    answer = first(
        _http_event(_json(**inputs), "application/json", "application/json", binary=False),
        Context("fn-s0"),
    )
    assert answer["statusCode"] == 200 and not answer["isBase64Encoded"], answer["body"]
    assert answer["headers"]["Content-Type"] == "application/json"
    got = {k: np.asarray(v, np.float32) for k, v in json.loads(answer["body"])["outputs"].items()}
    assert compare_outputs(got, expected).max_rel_err <= 1e-5
    event = _http_event(_npz(**inputs), "application/x-npz", "application/x-npz", binary=True)
    answer = first(event, Context("fn-s0"))
    assert answer["statusCode"] == 200 and answer["isBase64Encoded"]
    got = bodies.decode_answer(base64.b64decode(answer["body"]), "application/x-npz")
    assert compare_outputs(got, expected).max_rel_err <= 1e-5
    direct = first(json.loads(_json(**inputs)), Context("fn-s0"))
    got = {k: np.asarray(v, np.float32) for k, v in direct["outputs"].items()}
    assert compare_outputs(got, expected).max_rel_err <= 1e-5
    assert [s.split("=")[0] for s in direct["timing"].split(",")] == ["s0", "s1", "s2"]
    refused = first({"inputs": {"x": [1]}}, Context("fn-s0"))
    assert refused["status"] == 400 and "'x' is [1]" in refused["error"]
    big = _npz(x=np.zeros((256, 3, 8, 8), np.float64))  # over the limit: its head says why
    event = _http_event(big, "application/x-npz", "application/json", binary=True)
    refused = first(event, Context("fn-s0"))
    assert refused["statusCode"] == 400 and "is float64" in json.loads(refused["body"])["error"]


# --- mopar serve, curl and mopar invoke ------------------------------------------------------


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_json_to_mopar_serve_and_mopar_invoke_get_the_reference(skipnet_bundle, tmp_path):
    inputs, expected = read_reference(skipnet_bundle / "reference.npz")
    with served(skipnet_bundle) as (address, proc):
        url = f"http://{address}/"
        servers = psutil.Process(proc.pid).children(recursive=True)
        assert len(servers) >= 3  # a function server per function
        request = tmp_path / "request.json"
        request.write_bytes(_json(**inputs))
        curl = subprocess.run(
            [
                "curl", "-sS", "--fail-with-body", "--max-time", "60",
                "-H", "Content-Type: application/json", "-H", "Accept: application/json",
                "--data-binary", f"@{request}", url,
            ],
            capture_output=True,
            timeout=90,
        )  # fmt: skip
        assert curl.returncode == 0, (curl.stdout, curl.stderr)
        got = {k: np.asarray(v, np.float32) for k, v in json.loads(curl.stdout)["outputs"].items()}
        assert compare_outputs(got, expected).max_rel_err <= 1e-5
        out = tmp_path / "out.npz"
        invoke = subprocess.run(
            [MOPAR, "invoke", url, "--input", str(skipnet_bundle / "reference.npz"),
             "--output", str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        assert invoke.returncode == 0, invoke.stderr
        with np.load(out, allow_pickle=False) as data:
            got = {k: data[k] for k in data.files}
        assert list(got) == list(expected)
        assert compare_outputs(got, expected).max_rel_err <= 1e-5
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
    assert not [p.pid for p in servers if pid_alive(p.pid)], "every function server stopped"


def test_mopar_invoke_runs_a_bundle_once_and_prints_its_outputs(skipnet_bundle, tmp_path):
    reference = skipnet_bundle / "reference.npz"
    _, expected = read_reference(reference)
    result = CliRunner().invoke(
        cli, ["invoke", str(skipnet_bundle), "--input", str(reference), "--json"]
    )
    assert result.exit_code == 0, result.stderr
    got = {k: np.asarray(v, np.float32) for k, v in json.loads(result.stdout)["outputs"].items()}
    assert compare_outputs(got, expected).max_rel_err <= 1e-5


def test_mopar_invoke_help_of_a_bundle_lists_its_inputs_and_their_specs(skipnet_bundle):
    shown = CliRunner().invoke(cli, ["invoke", str(skipnet_bundle), "--help"])
    assert shown.exit_code == 0, shown.output
    assert "Inputs of this bundle:" in shown.output
    assert "x  float32 [1, 3, 8, 8]   --input x=1x3x8x8:float32" in shown.output
    plain = CliRunner().invoke(cli, ["invoke", "--help"])
    assert plain.exit_code == 0 and "Inputs of this bundle" not in plain.output


def test_mopar_invoke_takes_specs_a_json_file_or_a_protocol_body(skipnet_bundle, tmp_path):
    inputs, expected = read_reference(skipnet_bundle / "reference.npz")
    (x,) = inputs.values()
    plain, v2 = tmp_path / "plain.json", tmp_path / "v2.json"
    plain.write_text(json.dumps({"inputs": {"x": x.tolist()}}))  # floats: float32
    tensor = {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
    v2.write_text(json.dumps({"inputs": [tensor]}))
    for given in (plain, v2):
        result = CliRunner().invoke(
            cli, ["invoke", str(skipnet_bundle), "--input", str(given), "--json"]
        )
        assert result.exit_code == 0, result.stderr
        got = {
            k: np.asarray(v, np.float32) for k, v in json.loads(result.stdout)["outputs"].items()
        }
        assert compare_outputs(got, expected).max_rel_err <= 1e-5
    shape = "x".join(map(str, x.shape))
    spec = CliRunner().invoke(
        cli, ["invoke", str(skipnet_bundle), "--input", f"x={shape}:float32", "--json"]
    )
    assert spec.exit_code == 0, spec.stderr
    assert list(json.loads(spec.stdout)["outputs"]) == list(expected)
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    line = _one_error_line(
        CliRunner().invoke(cli, ["invoke", str(skipnet_bundle), "--input", str(empty)])
    )
    assert "holds no inputs" in line


def _one_error_line(result) -> str:
    assert result.exit_code == 1, (result.stdout, result.stderr)
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_mopar_invoke_errors_are_one_line_naming_the_fix(skipnet_bundle, tmp_path):
    reference = str(skipnet_bundle / "reference.npz")
    missing = _one_error_line(
        CliRunner().invoke(cli, ["invoke", "http://127.0.0.1:9/", "--input", "nope.npz"])
    )
    assert "'nope.npz' does not exist" in missing and "numpy.savez" in missing
    port = free_port()  # nothing listens there
    line = _one_error_line(
        CliRunner().invoke(cli, ["invoke", f"http://127.0.0.1:{port}/", "--input", reference])
    )
    assert f"cannot reach http://127.0.0.1:{port}/" in line and "mopar serve" in line
    line = _one_error_line(CliRunner().invoke(cli, ["invoke", "nowhere", "--input", reference]))
    assert "neither an http:// URL nor a bundle folder" in line
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, y=np.zeros((1, 3, 8, 8), np.float32))
    line = _one_error_line(
        CliRunner().invoke(cli, ["invoke", str(skipnet_bundle), "--input", str(wrong)])
    )
    assert "lacks ['x']" in line


def test_mopar_serve_on_a_port_in_use_is_one_line_before_any_function_starts(skipnet_bundle):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _one_error_line(
            CliRunner().invoke(cli, ["serve", str(skipnet_bundle), "--port", str(port)])
        )
    assert f"--port {port} cannot be listened on" in line and "--port 0" in line
