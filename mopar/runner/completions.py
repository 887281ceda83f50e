"""A ``--generate`` bundle as one local HTTP endpoint that generates: ``mopar serve`` of such a
bundle.

`CompletionsEndpoint` starts the bundle's main function and the expert functions it calls, as
``mopar generate`` does (`mopar.runner.generation.Generation`), and serves, as a WSGI app:

- ``POST /generate``: the generation request docs/generate.md documents (``input_ids`` or
  ``text``, ``max_new_tokens``, ``temperature``, ``seed``), answered with its tokens and times;
- ``POST /v1/completions``: OpenAI's completions, so that its clients work: ``prompt`` as token
  ids (a list of them, or one list in a list) or text where a tokenizer travels with the
  bundle; ``max_tokens`` (default 16, as OpenAI's), ``temperature`` (default 0 here: greedy,
  the model's own tokens), ``seed``; one choice, whose ``text`` is the new tokens decoded (empty
  without a tokenizer) and whose ``token_ids`` are the new tokens; ``usage`` counts tokens;
- ``GET /v1/models``: the model, named as ``plan.json`` names it.

A request that asks for what is not served (``n`` above 1, ``stream``, ``echo``, ``stop``,
another model) is a 400 (404 for the model) in OpenAI's error form, naming the field.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from mopar.bundle.layout import TOKENIZER_FILE
from mopar.errors import RuntimeFailure
from mopar.runner.bundle import BundleManifest
from mopar.runner.generation import Generation, generation_of
from mopar.runtime.core import RequestError
from mopar.runtime.generate import GenerateRequest, GenerateRequestError
from mopar.runtime.httpd import REASONS
from mopar.runtime.server import GENERATE_BODY_BYTES, create_function_server, read_body

__all__ = ["CompletionsEndpoint"]

OPENAI_MAX_TOKENS = 16
"""OpenAI's completions' default ``max_tokens``."""

_UNSERVED = {"n": 1, "best_of": 1, "stream": False, "echo": False, "stop": None, "suffix": None}
"""Fields this endpoint takes only at these values (OpenAI's defaults)."""
_TAKEN = {"model", "prompt", "max_tokens", "temperature", "seed", "top_p", "user", "logprobs"}
"""Fields taken: read, or (``top_p``, ``user``, ``logprobs``) accepted and not used."""


class CompletionsEndpoint:
    """The generation of ``manifest`` served (``options``: as `Generation`'s)."""

    def __init__(self, manifest: BundleManifest, *, threads: int = 4, **options: Any) -> None:
        self.manifest = manifest
        self.spec = generation_of(manifest)
        self.threads = threads
        self.options = options
        self.generation: Generation | None = None
        path = Path(manifest.root) / TOKENIZER_FILE
        self.tokenizer = _tokenizer(path) if path.is_file() else None

    def __enter__(self) -> CompletionsEndpoint:
        self.generation = Generation.of(self.manifest, **self.options)
        return self

    def __exit__(self, *_) -> None:
        if self.generation is not None:
            self.generation.close()
            self.generation = None

    def server(self, *, host: str, port: int):
        """A waitress server of this endpoint on ``host:port`` (0: a free port)."""
        return create_function_server(
            self, host=host, port=port, threads=self.threads, max_body=GENERATE_BODY_BYTES
        )

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "").rstrip("/")
        try:
            status, doc = self._serve(environ, path)
        except RequestError as exc:
            status, doc = exc.status, _error(path, str(exc), exc.status)
        except RuntimeFailure as exc:
            status, doc = 502, _error(path, str(exc), 502)
        body = json.dumps(doc).encode()
        start_response(
            f"{status} {REASONS.get(status, 'Error')}",
            [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
        )
        return [body]

    def _serve(self, environ: dict, path: str) -> tuple[int, dict]:
        method = environ["REQUEST_METHOD"]
        if method == "GET" and path == "/v1/models":
            return 200, {"object": "list", "data": [self._model()]}
        if method == "GET" and path in ("/v1/models/" + self.manifest.model, "/_/health"):
            return 200, self._model()
        if method != "POST" or path not in ("/generate", "/v1/completions"):
            raise RequestError(
                f"{method} {path or '/'} is not served; POST /generate or /v1/completions, or "
                "GET /v1/models",
                404 if method == "POST" else 405,
            )
        try:
            body = json.loads(bytes(read_body(environ, GENERATE_BODY_BYTES)))
        except ValueError as exc:
            raise RequestError(f"the request is not JSON ({exc})") from None
        if path == "/generate":
            return 200, self._generate(body).to_dict()
        return 200, self._complete(body)

    def _model(self) -> dict:
        return {"id": self.manifest.model, "object": "model", "created": 0, "owned_by": "mopar"}

    def _generate(self, body: object):
        if self.generation is None:
            raise RuntimeError("the endpoint is not started; use it as a context manager")
        if isinstance(body, dict) and "text" not in body:
            try:  # refused here, in one line, before the main function sees it
                GenerateRequest.parse(body, self.spec)
            except GenerateRequestError as exc:
                raise RequestError(str(exc)) from None
        try:
            answer, _ = self.generation.run(body if isinstance(body, dict) else {})
        except RuntimeFailure as exc:
            if "refused" in str(exc):  # the main function's 4xx: the request's fault
                raise RequestError(str(exc)) from None
            raise
        return answer

    def _complete(self, body: object) -> dict:
        if not isinstance(body, dict):
            raise RequestError("a completions request is a JSON object")
        model = body.get("model")
        if model != self.manifest.model:
            raise RequestError(
                f"model {model!r} is not served here; this serves {self.manifest.model!r}", 404
            )
        for field, value in _UNSERVED.items():
            if body.get(field, value) not in (value, None):
                raise RequestError(f"{field} {body[field]!r} is not served; leave it out")
        unknown = sorted(set(body) - set(_UNSERVED) - _TAKEN)
        if unknown:
            raise RequestError(f"unknown field {unknown[0]!r} in a completions request")
        prompt = self._prompt(body.get("prompt"))
        request: dict = {
            "input_ids": prompt,
            "max_new_tokens": body.get("max_tokens") or OPENAI_MAX_TOKENS,
        }
        if body.get("temperature"):
            request["temperature"] = body["temperature"]
        if body.get("seed") is not None:
            request["seed"] = body["seed"]
        answer = self._generate(request)
        text = self.tokenizer.decode(list(answer.tokens)) if self.tokenizer is not None else ""
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.manifest.model,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "token_ids": list(answer.tokens),
                    "logprobs": None,
                    "finish_reason": "stop" if answer.stopped == "eos" else "length",
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(answer.tokens),
                "total_tokens": len(prompt) + len(answer.tokens),
            },
        }

    def _prompt(self, prompt: object) -> list[int]:
        """The prompt's token ids: ids as they are (one list in a list too), text tokenized."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        if isinstance(prompt, str) and prompt:
            if self.tokenizer is None:
                raise RequestError(
                    "this bundle has no tokenizer, so a prompt is token ids; send "
                    '"prompt": [1, 2, 3], or compile a folder that holds tokenizer.json'
                )
            return list(self.tokenizer.encode(prompt).ids)
        raise RequestError(
            "prompt is one text or one list of token ids (one prompt a request); got "
            f"{type(prompt).__name__}"
        )


def _tokenizer(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def _error(path: str, message: str, status: int) -> dict:
    """An error as the route's clients read one: OpenAI's form under /v1, else mopar's."""
    if not path.startswith("/v1"):
        return {"error": message}
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
