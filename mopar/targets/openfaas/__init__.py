"""OpenFaaS on Kubernetes, as a target (`mopar.target`): its facts are its ``platforms.json``
entry; ``chains.py`` (``http``, ``callback``, ``shm``), ``emit.py`` (``stack.yml``, the
``mopar-onnx`` template with the runtime's copy, ``k8s/``), ``entry.py`` (the function server),
``image.py`` (the template's Dockerfile) and ``emulate.py`` (the gateway's async queue and a
client's callback URL, on 127.0.0.1)."""

from __future__ import annotations

__all__ = ["NAME"]

NAME = "openfaas"
"""``--target openfaas``, and its key in ``platforms.json``."""
