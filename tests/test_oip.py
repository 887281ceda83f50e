"""The Open Inference Protocol (KServe v2) on ``mopar serve``, driven by a client no one here
wrote: tritonclient's ``InferenceServerClient``. The protocol's reading and writing
(`mopar.runtime.oip`) is checked apart, without servers."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from mopar.bundle.function import TensorSpec
from mopar.runner.bundle import read_manifest, read_reference
from mopar.runner.check import compare_outputs
from mopar.runtime import oip
from mopar.runtime.core import RequestError
from tests.conftest import served as serving

httpclient = pytest.importorskip("tritonclient.http")


@pytest.fixture(scope="module")
def served(skipnet_bundle):
    """``mopar serve`` of the SkipNet bundle on a free port: its address and the bundle."""
    with serving(skipnet_bundle) as (address, _):
        yield address, skipnet_bundle


def test_tritonclient_reads_the_metadata_and_infers_the_reference(served):
    address, bundle = served
    model = read_manifest(bundle).model
    inputs, expected = read_reference(bundle / "reference.npz")
    client = httpclient.InferenceServerClient(address)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(model)
    meta = client.get_model_metadata(model)
    assert meta["name"] == model
    (x,) = inputs.values()
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": list(x.shape)}]
    assert [o["name"] for o in meta["outputs"]] == list(expected)
    assert all(o["datatype"] == "FP32" for o in meta["outputs"])
    for binary_in in (True, False):
        for binary_out in (True, False):
            given = httpclient.InferInput("x", list(x.shape), "FP32")
            given.set_data_from_numpy(x, binary_data=binary_in)
            asked = [httpclient.InferRequestedOutput(n, binary_data=binary_out) for n in expected]
            result = client.infer(model, [given], outputs=asked, request_id="r1")
            got = {n: result.as_numpy(n) for n in expected}
            assert compare_outputs(got, expected).max_rel_err <= 1e-5, (binary_in, binary_out)
            assert result.get_response()["id"] == "r1"
    client.close()


def test_a_wrong_datatype_or_model_is_refused_naming_it(served):
    address, bundle = served
    model = read_manifest(bundle).model
    inputs, _ = read_reference(bundle / "reference.npz")
    x = inputs["x"].astype(np.float64)
    client = httpclient.InferenceServerClient(address)
    given = httpclient.InferInput("x", list(x.shape), "FP64")
    given.set_data_from_numpy(x)
    with pytest.raises(Exception, match=r"datatype FP64.*takes FP32"):
        client.infer(model, [given])
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"http://{address}/v2/models/other", timeout=30)
    assert missing.value.code == 404 and model in json.loads(missing.value.read())["error"]
    client.close()


def _spec(**kw) -> TensorSpec:
    return TensorSpec(name="x", shape=(2, 3), dtype="float32", **kw)


def test_a_request_reads_json_and_binary_inputs_and_answers_as_asked():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    as_json = json.dumps(
        {"inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32", "data": x.ravel().tolist()}]}
    ).encode()
    infer = oip.read_infer(as_json, None, [_spec()])
    assert np.array_equal(infer.arrays["x"], x) and infer.outputs is None
    head = json.dumps(
        {
            "inputs": [
                {"name": "x", "shape": [2, 3], "datatype": "FP32",
                 "parameters": {"binary_data_size": 24}}
            ],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    ).encode()  # fmt: skip
    infer = oip.read_infer(head + x.tobytes(), str(len(head)), [_spec()])
    assert np.array_equal(infer.arrays["x"], x) and infer.outputs == {"y": True}
    body, headers = oip.write_infer("m", {"y": x * 2, "z": x}, infer)  # y alone, binary
    length = int(dict(headers)[oip.HEADER_LENGTH])
    doc = json.loads(body[:length])
    assert [o["name"] for o in doc["outputs"]] == ["y"]
    assert np.array_equal(np.frombuffer(body[length:], np.float32).reshape(2, 3), x * 2)


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ({"name": "x", "shape": [2, 3], "datatype": "INT64", "data": [0] * 6}, "datatype INT64"),
        ({"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [0] * 3}, "expected"),
        ({"name": "x", "shape": [2, 3], "datatype": "FP32", "data": [0] * 5}, "5 values"),
        ({"name": "w", "shape": [2, 3], "datatype": "FP32", "data": [0] * 6}, "'w' is not"),
    ],
)
def test_a_request_that_differs_from_the_model_is_a_400_naming_the_input(entry, said):
    body = json.dumps({"inputs": [entry]}).encode()
    with pytest.raises(RequestError, match=said) as refused:
        oip.read_infer(body, None, [_spec()])
    assert refused.value.status == 400


def test_routes_and_a_dynamic_axis_in_the_metadata():
    assert oip.route("/v2") == oip.Route("server")
    assert oip.route("/v2/health/live") == oip.Route("live")
    assert oip.route("/v2/models/m/versions/1/infer") == oip.Route("infer", "m")
    assert oip.route("/v2/models/m/ready") == oip.Route("model_ready", "m")
    assert oip.route("/_/health") is None
    with pytest.raises(RequestError) as unknown:
        oip.route("/v2/models/m/stats")
    assert unknown.value.status == 404
    dynamic = oip.Tensor.received(_spec(min_shape=(2, 1)))
    assert dynamic.to_dict() == {"name": "x", "datatype": "FP32", "shape": [2, -1]}


def _post(app, path: str, doc: dict) -> tuple[int, dict]:
    body = json.dumps(doc).encode()
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": path,
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.input": io.BytesIO(body),
    }
    status: list[int] = []
    out = b"".join(app(environ, lambda s, h: status.append(int(s.split()[0]))))
    return status[0], json.loads(out)


def test_each_function_server_infers_by_the_protocol_along_the_chain(skipnet_bundle):
    """Each function with no next one answers its outgoing tensors: three v2 requests, one per
    function, each the last one's outputs, end at the model's outputs."""
    from mopar.runtime.server import app_from_env

    apps = [
        app_from_env({"MOPAR_FUNCTION_DIR": str(skipnet_bundle / "functions" / f"s{i}")})
        for i in range(3)
    ]
    model = read_manifest(skipnet_bundle).model
    inputs, expected = read_reference(skipnet_bundle / "reference.npz")
    tensors = [
        {"name": k, "shape": list(v.shape), "datatype": "FP32", "data": v.ravel().tolist()}
        for k, v in inputs.items()
    ]
    for app in apps:
        status, doc = _post(app, f"/v2/models/{model}/infer", {"inputs": tensors})
        assert status == 200 and doc["model_name"] == model, doc
        tensors = doc["outputs"]
    got = {t["name"]: np.asarray(t["data"], np.float32).reshape(t["shape"]) for t in tensors}
    assert compare_outputs(got, expected).max_rel_err <= 1e-5
    status, doc = _post(apps[0], "/v2/models/other/infer", {"inputs": []})
    assert status == 404 and model in doc["error"]


def test_the_lambda_handler_serves_the_protocol_in_http_events(skipnet_bundle):
    """A Function URL event at /v2/... runs the chain (each function invoking the next) and
    answers by the protocol, binary outputs base64 in the proxy answer."""
    import base64

    from tests.test_lambda import Context, _chain

    first = _chain(skipnet_bundle, {})[0]
    model = read_manifest(skipnet_bundle).model
    inputs, expected = read_reference(skipnet_bundle / "reference.npz")

    def event(method: str, path: str, body: bytes = b"", headers: dict | None = None) -> dict:
        return {
            "version": "2.0",
            "rawPath": path,
            "headers": headers or {},
            "requestContext": {"http": {"method": method}},
            "body": base64.b64encode(body).decode(),
            "isBase64Encoded": True,
        }

    meta = first(event("GET", f"/v2/models/{model}"), Context("fn-s0"))
    assert meta["statusCode"] == 200
    assert [t["name"] for t in json.loads(meta["body"])["inputs"]] == list(inputs)
    x = inputs["x"]
    head = json.dumps(
        {
            "inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                        "parameters": {"binary_data_size": x.nbytes}}],
            "parameters": {"binary_data_output": True},
        }
    ).encode()  # fmt: skip
    answer = first(
        event("POST", f"/v2/models/{model}/infer", head + x.tobytes(),
              {oip.HEADER_LENGTH: str(len(head))}),
        Context("fn-s0"),
    )  # fmt: skip
    assert answer["statusCode"] == 200 and answer["isBase64Encoded"], answer
    body = base64.b64decode(answer["body"])
    length = int(answer["headers"][oip.HEADER_LENGTH])
    got, at = {}, length
    for out in json.loads(body[:length])["outputs"]:
        size = out["parameters"]["binary_data_size"]
        got[out["name"]] = np.frombuffer(body[at : at + size], np.float32).reshape(out["shape"])
        at += size
    assert compare_outputs(got, expected).max_rel_err <= 1e-5
    wrong = first(event("POST", "/v2/models/other/infer", b"{}"), Context("fn-s0"))
    assert wrong["statusCode"] == 404
