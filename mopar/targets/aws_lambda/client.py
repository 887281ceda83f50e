"""A client of Lambda's Invoke API, for ``mopar invoke URL``: one synchronous invocation of a
function with the model inputs as its JSON event. No torch.

What speaks the Invoke API (``POST /2015-03-31/functions/<name>/invocations``, a JSON event in,
the handler's JSON answer out) without AWS's request signing:

- AWS's Lambda Runtime Interface Emulator, in front of one function image: the function's name
  is always ``function`` (``http://127.0.0.1:9000/2015-03-31/functions/function/invocations``);
- ``sam local start-lambda``, in front of a template's functions, each by its logical id
  (``http://127.0.0.1:3001/2015-03-31/functions/<LogicalId>/invocations``).

AWS's own endpoint (``lambda.<region>.amazonaws.com``) takes only signed requests: there a client
calls the entry's Function URL (plain HTTP, which `mopar.runner.remote` posts an .npz to) or
``aws lambda invoke``. The event is ``{"inputs": {name: nested lists}}``, which the bundle's
handler (`mopar.runtime.aws`) answers ``{"outputs": {name: nested lists}, ...}``.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from mopar.errors import RuntimeFailure
from mopar.runtime import bodies

__all__ = ["CLIENT", "INVOKE_PATH", "LambdaClient", "invocations_url"]

INVOKE_PATH = re.compile(r"^/2015-03-31/functions/(?P<name>[^/]+)/invocations/?$")
"""The Invoke API's path: the function's name (or ARN) in it."""

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def invocations_url(endpoint: str, function: str) -> str:
    """The Invoke API URL of ``function`` at ``endpoint`` (``http://127.0.0.1:3001``)."""
    return f"{endpoint.rstrip('/')}/2015-03-31/functions/{urllib.parse.quote(function)}/invocations"


@dataclass(frozen=True)
class LambdaClient:
    """`mopar.target.Client` of the ``lambda`` target: the Invoke API, unsigned."""

    def handles(self, url: str) -> bool:
        """Whether ``url`` is an Invoke API URL (its path is ``INVOKE_PATH``)."""
        return INVOKE_PATH.match(urllib.parse.urlsplit(url).path) is not None

    def request(
        self, url: str, inputs: Mapping[str, np.ndarray], *, timeout_s: float
    ) -> dict[str, np.ndarray]:
        """Invoke the function at ``url`` with ``inputs``; the outputs it answers.

        Raises:
            RuntimeFailure: the endpoint is unreachable or refused the call, or the function
                failed (its error, in one line).
        """
        event = {"inputs": {k: np.asarray(v).tolist() for k, v in inputs.items()}}
        request = urllib.request.Request(
            url,
            data=json.dumps(event).encode(),
            method="POST",
            headers={
                "Content-Type": "application/json",
                "X-Amz-Invocation-Type": "RequestResponse",
            },
        )
        host = urllib.parse.urlsplit(url).hostname or ""
        # this machine's own endpoints are reached directly, whatever proxy the environment names
        handlers = [urllib.request.ProxyHandler({})] if host in _LOOPBACK else []
        try:
            with urllib.request.build_opener(*handlers).open(request, timeout=timeout_s) as got:
                body, failed = got.read(), got.headers.get("X-Amz-Function-Error")
        except urllib.error.HTTPError as exc:
            raise RuntimeFailure(_refused(url, exc.code, exc.read()[:2000], host)) from None
        except (urllib.error.URLError, OSError) as exc:
            raise RuntimeFailure(
                f"cannot reach {url} ({getattr(exc, 'reason', exc)}); start the emulator or "
                "`sam local start-lambda`, or check the URL"
            ) from None
        return _outputs(url, body, failed)


def _outputs(url: str, body: bytes, failed: str | None) -> dict[str, np.ndarray]:
    try:
        answer = json.loads(body or b"{}")
    except ValueError:
        raise RuntimeFailure(
            f"{url} answered {body[:80]!r}, not JSON; is it an Invoke API?"
        ) from None
    if not isinstance(answer, dict):
        raise RuntimeFailure(f"{url} answered {str(answer)[:80]}, not a JSON object")
    message = answer.get("error") or answer.get("errorMessage")
    if failed or message:  # the handler's error answer, or an error Lambda reports for it
        status = f" {answer['status']}" if "status" in answer else ""
        raise RuntimeFailure(
            f"the function at {url} failed{status}: {' '.join(str(message).split())}"
        )
    try:
        return bodies.decode_answer(json.dumps(answer).encode(), bodies.Format.JSON.media_type)
    except ValueError as exc:
        raise RuntimeFailure(
            f"{url} answered JSON that does not read as outputs ({exc}); is it a mopar "
            "bundle's entry function?"
        ) from None


def _refused(url: str, status: int, body: bytes, host: str) -> str:
    text = " ".join(body.decode(errors="replace").split())
    if status == 403 and host.endswith(".amazonaws.com"):
        return (
            f"{url} answered 403: AWS's Invoke API takes only signed requests; call the entry's "
            "Function URL instead, or `aws lambda invoke`"
        )
    return f"{url} answered {status}: {text or 'no body'}"


CLIENT = LambdaClient()
"""The ``lambda`` target's client (`mopar.target.PackageTarget.client`)."""
