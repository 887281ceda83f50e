"""Frontend: load model files, parse input specs, capture with torch.export."""

from mopar.frontend.capture import CapturedModel
from mopar.frontend.inputs import InputSpec, load_example_npz, make_example_arrays, parse_input_spec
from mopar.frontend.load import LoadedModel, load_model
from mopar.frontend.shapes import capture

__all__ = [
    "CapturedModel",
    "InputSpec",
    "LoadedModel",
    "capture",
    "load_example_npz",
    "load_model",
    "make_example_arrays",
    "parse_input_spec",
]
