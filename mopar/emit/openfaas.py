"""``stack.yml`` for faas-cli: one OpenFaaS function per slice, sized from the plan."""

from __future__ import annotations

import re
from typing import Any

import yaml

from mopar.partition import Plan

__all__ = ["dns1123", "function_names", "stack_yaml", "TEMPLATE_LANG"]

TEMPLATE_LANG = "mopar-onnx"


def dns1123(text: str, *, max_len: int = 63) -> str:
    """Lower-case ``text`` into a DNS-1123 label: [a-z0-9-], alphanumeric at both ends."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    label = re.sub(r"-{2,}", "-", label)[:max_len].strip("-")
    return label or "model"


def function_names(plan: Plan) -> list[str]:
    """The OpenFaaS function name of each slice: ``<model>-<slice>``, DNS-1123, <= 63 chars."""
    suffixes = [f"-{dns1123(s.name)}" for s in plan.slices]
    base = dns1123(plan.model, max_len=63 - max(len(x) for x in suffixes))
    return [base + x for x in suffixes]


def stack_yaml(plan: Plan, *, gateway: str = "http://127.0.0.1:8080", transport: str = "shm") -> str:
    """Render the faas-cli stack file for ``plan``."""
    names = function_names(plan)
    functions: dict[str, Any] = {}
    for i, (name, s) in enumerate(zip(names, plan.slices)):
        memory = f"{s.memory_mb}Mi"
        functions[name] = {
            "lang": TEMPLATE_LANG,
            "handler": f"./functions/{s.name}",
            "image": f"{name}:latest",
            "labels": {
                "com.mopar.model": dns1123(plan.model),
                "com.mopar.slice": str(i),
                "com.mopar.transport": transport,
            },
            "annotations": {
                "com.mopar.layers": f"{s.layers[0]} .. {s.layers[-1]}",
                "com.mopar.param-bytes": str(s.param_bytes),
            },
            "environment": {
                "MOPAR_SLICE": s.name,
                "MOPAR_NEXT": names[i + 1] if i + 1 < len(names) else "",
                "MOPAR_TRANSPORT": transport,
            },
            "limits": {"memory": memory},
            "requests": {"memory": memory},
            "build_args": {"TEST_ENABLED": "false"},
        }
    doc = {
        "version": 1.0,
        "provider": {"name": "openfaas", "gateway": gateway},
        "functions": functions,
    }
    return yaml.safe_dump(doc, sort_keys=False)
