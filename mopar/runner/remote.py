"""One request to a served or deployed bundle by its URL: ``mopar invoke URL``.

`request` asks each registered target whether the URL is one of its platform's API (`Client`:
Lambda's Invoke API, as AWS's emulator and ``sam local start-lambda`` serve it) and lets that
target's client call it; any other URL is plain HTTP (`post_npz`): ``mopar serve``, a function
server, an OpenFaaS gateway's function, a Lambda Function URL.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping

import numpy as np

from mopar.errors import RuntimeFailure
from mopar.runtime import bodies
from mopar.target import registered

__all__ = ["post_npz", "request"]

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def request(
    url: str, inputs: Mapping[str, np.ndarray], *, timeout_s: float
) -> dict[str, np.ndarray]:
    """The outputs ``url`` answers to ``inputs``: through the client of the target whose API it
    is, else `post_npz`.

    Raises:
        RuntimeFailure: unreachable, refused, or not answered with outputs.
    """
    for target in registered():
        client = target.client()
        if client is not None and client.handles(url):
            return client.request(url, inputs, timeout_s=timeout_s)
    return post_npz(url, inputs, timeout_s=timeout_s)


def post_npz(
    url: str, inputs: Mapping[str, np.ndarray], *, timeout_s: float
) -> dict[str, np.ndarray]:
    """POST ``inputs`` as an .npz asking for an .npz; the outputs it answers (a frame or JSON
    answer reads too).

    Raises:
        RuntimeFailure: unreachable, refused, or not answered with outputs.
    """
    kind = bodies.Format.NPZ.media_type
    req = urllib.request.Request(
        url,
        data=bodies.write_npz(dict(inputs)),
        method="POST",
        headers={"Content-Type": kind, "Accept": kind},
    )
    # this machine's own endpoints are reached directly, whatever proxy the environment names
    loopback = urllib.parse.urlsplit(url).hostname in _LOOPBACK
    opener = urllib.request.build_opener(*([urllib.request.ProxyHandler({})] if loopback else []))
    try:
        with opener.open(req, timeout=timeout_s) as answer:
            got, got_type = answer.read(), answer.headers.get("Content-Type")
    except urllib.error.HTTPError as exc:
        text = exc.read()[:2000].decode(errors="replace")
        try:
            text = json.loads(text).get("error", text)
        except (ValueError, AttributeError):
            pass
        raise RuntimeFailure(f"{url} answered {exc.code}: {' '.join(str(text).split())}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RuntimeFailure(
            f"cannot reach {url} ({reason}); start the bundle with `mopar serve BUNDLE --port "
            "P` or check the URL"
        ) from None
    try:
        return bodies.decode_answer(got, got_type)
    except ValueError as exc:
        raise RuntimeFailure(
            f"{url} answered {got_type or 'a body'} that does not read as outputs ({exc}); is "
            "it a mopar serve or function URL?"
        ) from None
