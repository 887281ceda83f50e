"""AWS Lambda, as a target (`mopar.target`): its facts are its ``platforms.json`` entry;
``chains.py`` (``invoke``, ``stepfunctions``, ``event``), ``emit.py`` (``template.yaml`` and
``Dockerfile.lambda``), ``entry.py`` (the Lambda handler, `mopar.runtime.aws`), ``image.py``
(``Dockerfile.lambda`` on the bundle root) and ``emulate.py`` (Lambda's Invoke API around one
handler, on 127.0.0.1)."""

from __future__ import annotations

__all__ = ["NAME"]

NAME = "lambda"
"""``--target lambda``, and its key in ``platforms.json``."""
