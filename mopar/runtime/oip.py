"""The Open Inference Protocol (KServe v2, as Triton, KServe, MLServer and TorchServe speak it):
its routes, bodies and answers, for every door that serves it (the function server, the Lambda
handler's HTTP events, ``mopar serve``). torch-free.

================================ ======= =================================================
path                             method  answer
================================ ======= =================================================
``/v2``                          GET     the server's metadata: its name, version, extensions
``/v2/health/live``, ``/ready``  GET     200 while it serves
``/v2/models/{name}``            GET     the model's metadata: inputs and outputs with their
                                         datatypes and shapes (-1 on a dynamic axis)
``/v2/models/{name}/ready``      GET     200 while it serves
``/v2/models/{name}/infer``      POST    the outputs, as JSON or with the binary extension
================================ ======= =================================================

``{name}`` is the model's name as ``plan.json`` gives it; ``/versions/{v}`` may follow it (a
bundle is one version). An inference request is JSON, ``{"inputs": [{"name", "shape",
"datatype", "data"}], "outputs": [{"name"}]}``; with the binary tensor data extension the JSON
is the first ``Inference-Header-Content-Length`` bytes of the body, and an input whose
``parameters`` give a ``binary_data_size`` takes its row-major bytes from what follows, in
order. An answer's output is binary where the request's output asks ``binary_data`` (or its
``parameters`` ask ``binary_data_output`` for all), else a flat list in ``data``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING

import numpy as np

from mopar.runtime import bodies
from mopar.runtime.bodies import checked
from mopar.runtime.core import RequestError

if TYPE_CHECKING:
    from mopar.bundle.function import TensorSpec

__all__ = [
    "DATATYPES",
    "DTYPES",
    "HEADER_LENGTH",
    "Infer",
    "Route",
    "Tensor",
    "described",
    "model_metadata",
    "read_infer",
    "refusal",
    "route",
    "server_metadata",
    "write_infer",
]


HEADER_LENGTH = "Inference-Header-Content-Length"
"""The binary extension's header: how many bytes of the body are its JSON."""

DATATYPES = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "uint16": "UINT16",
    "uint32": "UINT32",
    "uint64": "UINT64",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float16": "FP16",
    "float32": "FP32",
    "float64": "FP64",
}
"""numpy's dtype names as the protocol's datatypes."""
DTYPES = {v: k for k, v in DATATYPES.items()}
"""The protocol's datatypes as numpy's dtype names."""


@dataclass(frozen=True)
class Route:
    """A request path under ``/v2``: ``what`` it asks (``server``, ``live``, ``ready``,
    ``model``, ``model_ready`` or ``infer``) and of which ``model`` (empty for the server's)."""

    what: str
    model: str = ""


def route(path: str) -> Route | None:
    """The protocol's route of ``path``; None where it is not under ``/v2``.

    Raises:
        RequestError: (404) a path under ``/v2`` that the protocol does not have.
    """
    parts = [p for p in path.split("/") if p]
    if not parts or parts[0] != "v2":
        return None
    rest = parts[1:]
    if not rest:
        return Route("server")
    if rest in (["health", "live"], ["health", "ready"]):
        return Route(rest[1])
    if rest[0] == "models" and len(rest) >= 2:
        name, tail = rest[1], rest[2:]
        if tail[:1] == ["versions"] and len(tail) >= 2:
            tail = tail[2:]
        if not tail:
            return Route("model", name)
        if tail in (["ready"], ["infer"]):
            return Route("model_ready" if tail == ["ready"] else "infer", name)
    raise RequestError(
        f"{path} is not a path of the Open Inference Protocol; this serves /v2, "
        "/v2/health/live, /v2/health/ready, /v2/models/{name}[/ready] and "
        "POST /v2/models/{name}/infer",
        404,
    )


@dataclass(frozen=True)
class Tensor:
    """A tensor as the model's metadata lists it: ``shape`` has -1 on a dynamic axis."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def received(cls, t: TensorSpec) -> Tensor:
        """A tensor a function receives: -1 where its smallest and largest sizes differ."""
        low = t.min_shape or t.shape
        dims = [hi if lo == hi else -1 for lo, hi in zip(low, t.shape)]
        return cls(
            t.name, t.dtype, tuple(-1 if t.rows and k == 0 else d for k, d in enumerate(dims))
        )

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "datatype": _datatype(self.dtype), "shape": list(self.shape)}


def server_metadata(version: str) -> dict[str, object]:
    """``GET /v2``'s answer."""
    return {"name": "mopar", "version": version, "extensions": ["binary_tensor_data"]}


def model_metadata(
    name: str, inputs: Sequence[Tensor], outputs: Sequence[Tensor]
) -> dict[str, object]:
    """``GET /v2/models/{name}``'s answer."""
    return {
        "name": name,
        "versions": ["1"],
        "platform": "mopar_onnx",
        "inputs": [t.to_dict() for t in inputs],
        "outputs": [t.to_dict() for t in outputs],
    }


def described(
    route: Route, method: str, model: str, inputs: Sequence[Tensor], outputs: Sequence[Tensor]
) -> dict[str, object] | None:
    """What a ``GET`` of ``route`` answers, where ``model`` is served with ``inputs`` and
    ``outputs``: the server's or the model's metadata, or that it is live and ready; None for
    ``POST .../infer``, which the door serves.

    Raises:
        RequestError: 404 for another model; 405 for a method the route does not take.
    """
    if route.model and route.model != model:
        raise RequestError(f"model {route.model!r} is not served here; this serves {model!r}", 404)
    wanted = "POST" if route.what == "infer" else "GET"
    if method != wanted:
        raise RequestError(f"{method} is not served there; {wanted} it", 405)
    if route.what == "infer":
        return None
    if route.what == "server":
        return server_metadata(_version())
    if route.what == "model":
        return model_metadata(model, inputs, outputs)
    return {route.what: True}


def _version() -> str:
    try:
        return metadata.version("mopar")
    except metadata.PackageNotFoundError:
        return "unknown"


def _datatype(dtype: str) -> str:
    return DATATYPES.get(dtype, dtype.upper())


@dataclass(frozen=True)
class Infer:
    """An inference request, read: its inputs (checked against what is served), its ``id``,
    the outputs it asks for by name with whether each comes binary (None: all, each binary
    where ``binary`` says)."""

    arrays: Mapping[str, np.ndarray]
    id: str | None
    outputs: Mapping[str, bool] | None
    binary: bool


def read_infer(
    body: bytes | memoryview, header_length: str | None, receives: Sequence[TensorSpec]
) -> Infer:
    """The request of ``POST .../infer``, its inputs checked against ``receives`` (names,
    datatypes, shapes) and refused in one line naming what came and what is served.

    Raises:
        RequestError: (400) naming the input at fault.
    """
    data = memoryview(body)
    size = _header_length(header_length, len(data))
    try:
        doc = json.loads(bytes(data[:size]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(
            f"the inference request is not JSON ({exc}); send "
            '{"inputs": [{"name", "shape", "datatype", "data"}]}'
        ) from None
    entries = doc.get("inputs") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise RequestError(
            'an inference request is {"inputs": [{"name", "shape", "datatype", "data"}, ...]}; '
            f"inputs {[t.name for t in receives]}"
        )
    by_name = {t.name: t for t in receives}
    arrays: dict[str, np.ndarray] = {}
    offset = size
    for entry in entries:
        name = str(entry.get("name"))
        array, used = _input(entry, by_name.get(name), data[offset:])
        offset += used
        arrays[name] = array
    if offset != len(data):
        raise RequestError(
            f"the body has {len(data) - offset} bytes after its inputs' binary data; each "
            "binary input gives its binary_data_size"
        )
    params = doc.get("parameters") if isinstance(doc.get("parameters"), dict) else {}
    asked = doc.get("outputs")
    outputs = None
    if isinstance(asked, list):
        outputs = {
            str(o.get("name")): bool((o.get("parameters") or {}).get("binary_data", False))
            for o in asked
            if isinstance(o, dict)
        }
    rid = doc.get("id")
    return Infer(
        arrays=checked(arrays, receives, "inference request"),
        id=str(rid) if rid is not None else None,
        outputs=outputs,
        binary=bool(params.get("binary_data_output", False)),
    )


def refusal(
    environ: Mapping[str, str],
    head: bytes,
    receives: Sequence[TensorSpec],
    *,
    size: int,
    limit: int,
) -> RequestError:
    """Why a request body of ``size`` bytes over ``limit`` is refused, from its first bytes
    (`mopar.runtime.httpd.Refusal`, for every door): on this protocol's routes its head is read
    as the request's JSON, elsewhere as its format (`mopar.runtime.bodies.head_tensors`)."""
    if environ.get("PATH_INFO", "").startswith("/v2/"):
        seen, what = bodies.as_far_as_read(_heads(head)), "inference request"
    else:
        seen, what = bodies.head_tensors(head, environ.get("CONTENT_TYPE"))
    return bodies.refusal(seen, what, receives, size=size, limit=limit)


_ENTRY = re.compile(r'"name"\s*:\s*"([^"]{1,256})"')
_SHAPE = re.compile(r'"shape"\s*:\s*\[([\d\s,]*)\]')
_DATATYPE = re.compile(r'"datatype"\s*:\s*"(\w+)"')


def _heads(head: bytes) -> Iterator[bodies.Seen]:
    """An inference request's inputs, as far as their names, shapes and datatypes come before
    their data (tritonclient's order, and the whole JSON with the binary extension)."""
    text = head.decode("utf-8", errors="ignore")
    found = list(_ENTRY.finditer(text))
    for i, m in enumerate(found):
        end = found[i + 1].start() if i + 1 < len(found) else len(text)
        entry = text[m.end() : end].split('"data"')[0]
        shape, datatype = _SHAPE.search(entry), _DATATYPE.search(entry)
        if shape is None:
            continue
        dims = tuple(int(d) for d in shape.group(1).replace(" ", "").split(",") if d)
        dtype = DTYPES.get(datatype.group(1)) if datatype else None
        yield m.group(1), (np.dtype(dtype) if dtype else None), dims


def _header_length(given: str | None, total: int) -> int:
    if given is None or given == "":
        return total
    try:
        size = int(given)
    except ValueError:
        size = -1
    if not 0 <= size <= total:
        raise RequestError(
            f"{HEADER_LENGTH} {given!r} is not a size within the body's {total} bytes"
        )
    return size


def _input(
    entry: Mapping[str, object], spec: TensorSpec | None, rest: memoryview
) -> tuple[np.ndarray, int]:
    """One input of the request, and how many bytes of the binary rest it took."""
    name = str(entry.get("name"))
    if spec is None:
        raise RequestError(f"input {name!r} is not one this model takes")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise RequestError(f"input {name!r} has no shape (a list of sizes); give its shape")
    datatype = str(entry.get("datatype", ""))
    want = _datatype(spec.dtype)
    if datatype != want:
        raise RequestError(
            f"input {name!r} is datatype {datatype or 'none'}, and this model takes "
            f"{want} ({spec.describe()}); convert it to {spec.dtype}"
        )
    dtype = np.dtype(DTYPES.get(datatype, spec.dtype))
    params = entry.get("parameters")
    size = params.get("binary_data_size") if isinstance(params, dict) else None
    count = int(np.prod(shape, dtype=np.int64))
    if size is not None:
        if not isinstance(size, int) or size != count * dtype.itemsize or size > len(rest):
            raise RequestError(
                f"input {name!r}'s binary_data_size {size!r} is not {count} x "
                f"{dtype.itemsize} bytes within the body"
            )
        array = np.frombuffer(rest[:size], dtype=dtype).reshape(shape)
        return array, size
    try:
        array = np.asarray(entry.get("data"), dtype=dtype)
    except (TypeError, ValueError):
        raise RequestError(f"input {name!r}'s data is not a list of {datatype} values") from None
    if array.size != count:
        raise RequestError(
            f"input {name!r} has {array.size} values in data for shape {shape} ({count})"
        )
    return array.reshape(shape), 0


def write_infer(
    model: str, outputs: Mapping[str, np.ndarray], infer: Infer
) -> tuple[bytes, list[tuple[str, str]]]:
    """``POST .../infer``'s answer: its body and headers (``Content-Type``, and
    `HEADER_LENGTH` where outputs are binary).

    Raises:
        RequestError: (400) it asked for an output the model does not give.
    """
    names = list(outputs) if infer.outputs is None else list(infer.outputs)
    unknown = [n for n in names if n not in outputs]
    if unknown:
        raise RequestError(f"outputs {unknown} are not the model's; it gives {list(outputs)}")
    entries, blobs = [], []
    for name in names:
        array = np.ascontiguousarray(outputs[name])
        binary = infer.binary if infer.outputs is None else infer.outputs[name]
        entry: dict[str, object] = {
            "name": name,
            "datatype": _datatype(array.dtype.name),
            "shape": list(array.shape),
        }
        if binary:
            blob = array.tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = array.reshape(-1).tolist()
        entries.append(entry)
    doc: dict[str, object] = {"model_name": model, "model_version": "1", "outputs": entries}
    if infer.id is not None:
        doc["id"] = infer.id
    head = json.dumps(doc).encode()
    if not blobs:
        return head, [("Content-Type", "application/json")]
    return b"".join((head, *blobs)), [
        ("Content-Type", "application/octet-stream"),
        (HEADER_LENGTH, str(len(head))),
    ]
