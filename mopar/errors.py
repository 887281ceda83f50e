"""The mopar error tree.

A `MoparError` is something the user can fix: its message names the value seen, what was expected,
and the next step. The CLI prints it as one line and exits 1. `InternalError` is a bug in mopar;
the CLI exits 2 for it (and for any other unexpected exception).
"""

from __future__ import annotations

__all__ = [
    "MoparError",
    "OptionError",
    "ModelLoadError",
    "UntrustedPickleError",
    "InputSpecError",
    "CaptureError",
    "PlanError",
    "PartitionInfeasibleError",
    "VerificationError",
    "BundleError",
    "RuntimeFailure",
    "ShmFullError",
    "ContainerError",
    "InternalError",
]


class MoparError(Exception):
    """A problem with the user's input that the user can fix."""


class OptionError(MoparError):
    """An option of the Python API is unknown, of the wrong type or out of range."""


class ModelLoadError(MoparError):
    """The model file is missing, corrupt or of an unsupported kind."""


class UntrustedPickleError(ModelLoadError):
    """The model is a pickle and the user did not opt in to unpickling it."""


class InputSpecError(MoparError):
    """An ``--input`` spec or example-input file is malformed or does not fit the model."""


class CaptureError(MoparError):
    """torch.export could not capture the model."""


class PlanError(MoparError):
    """The requested partition cannot be made (e.g. ``--slices`` out of range)."""


class PartitionInfeasibleError(PlanError):
    """No plan meets a constraint (latency bound, slice count, memory limit)."""


class VerificationError(MoparError):
    """The compiled slices do not reproduce the original model's output."""


class BundleError(MoparError):
    """A bundle directory is missing, incomplete or of another format version."""


class RuntimeFailure(MoparError):
    """A slice process failed while serving a request."""


class ShmFullError(MoparError):
    """The tmpfs that ``mopar run`` hands tensors over through (/dev/shm) has no room left."""


class ContainerError(MoparError):
    """No container engine, an engine this host will not run, or a failed image build or start."""


class InternalError(Exception):
    """A bug in mopar. Not a MoparError: the CLI exits 2 and asks for a report."""
