"""The files and folders of a bundle, by name (`mopar.emit.bundle` draws the whole layout)."""

from __future__ import annotations

import re

__all__ = [
    "PLAN_FILE",
    "FUNCTION_FILE",
    "FUNCTIONS_DIR",
    "MODEL_FILE",
    "WEIGHTS_FILE",
    "REFERENCE_FILE",
    "HOT_DIR",
    "WARM_DIR",
    "TOKENIZER_FILE",
    "UNITS_DIR",
    "FUNCTION_NAME_RE",
]

PLAN_FILE = "plan.json"
"""The bundle's manifest (`mopar.bundle.document`), at its root."""
FUNCTION_FILE = "function.json"
"""A function's spec (`mopar.bundle.function`), in its folder."""
FUNCTIONS_DIR = "functions"
"""The folder of the functions' folders, ``functions/<name>``."""
MODEL_FILE = "model.onnx"
"""A function's graph, in its folder."""
WEIGHTS_FILE = "model.onnx.data"
"""A function's weights, beside its ``model.onnx``, when it has any (ONNX external data)."""
REFERENCE_FILE = "reference.npz"
"""A sample input and the original model's output (``input.<name>``, ``output.<name>``)."""
HOT_DIR = "hot"
"""The folder, inside a dispatch function's, of the model of the experts it holds itself."""
WARM_DIR = "warm"
"""The folder, inside a dispatch function's, of the next layer's router: hidden states in, the
experts they would be routed to out."""
TOKENIZER_FILE = "tokenizer.json"
"""A ``--generate`` bundle's tokenizer, where the model's folder had one (the ``tokenizers``
library's file), at its root and in its main function's folder: the main function reads it as
data to tokenize a request's text."""
UNITS_DIR = "units"
"""The folder, inside a ``--generate`` main function's, of the other units it runs
(``units/<name>``: each a function folder of the bundle)."""
FUNCTION_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
"""A function's name (``s0``, ``s1.e0-e3``, ``s2-shard1``): also its folder's in a bundle
(``functions/<name>``), so never a path."""
