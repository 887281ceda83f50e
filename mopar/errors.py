"""The mopar error tree, and the options its messages name as data.

A `MoparError` is something the user can fix: its message names the value seen, what was expected,
and the next step. The CLI prints it as one line and exits 1. `InternalError` is a bug in mopar;
the CLI exits 2 for it (and for any other unexpected exception).

A message is a sequence of parts: text, an `Option` (an option the message is about, by its
Python name, with the value it shows or suggests) and `Worded` (a stretch the CLI and the API
word differently). Inner layers raise with options as data; `MoparError.render` words them in a
style: ``"cli"`` (``--max-memory-mb 512``, what the CLI prints) or ``"python"``
(``max_memory_mb=512``, what `mopar.api` raises)::

    raise PlanError(Option("slices"), f" must be between 1 and {n}, got {got}")
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Literal

__all__ = [
    "DEBUG",
    "one_line",
    "Option",
    "Worded",
    "Part",
    "Style",
    "MoparError",
    "OptionError",
    "ModelLoadError",
    "UntrustedPickleError",
    "MachineMemoryError",
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

Style = Literal["cli", "python"]
"""How a message names options: the CLI's flags or the Python API's arguments."""

INPUTS = "example_args"
"""The `Option` name of the example inputs; the API names the argument that carried them."""


@dataclass(frozen=True)
class Option:
    """An option a message is about, as data; `render` words it for the CLI or for Python.

    Attributes:
        name: the Python name: a `CompileConfig` field or an argument of the API
            (``"max_memory_mb"``); ``"example_args"`` stands for the example inputs, which the
            API words as the argument that carried them.
        value: the value the message shows or suggests (None: the option alone; True: an
            on/off flag, ``--force`` / ``force=True``).
        metavar: a placeholder shown instead of a value (``DIR``).
        cli: the CLI's flag name when it is not ``name`` with dashes (``"profiles"`` for
            ``profiles_dir``).
        quoted: the CLI shows a str value quoted (``--target 'gcp'``); Python always does.
        python: the API's wording of an option the API has no argument for (``--debug``).
    """

    name: str
    _: KW_ONLY
    value: object = None
    metavar: str | None = None
    cli: str | None = None
    quoted: bool = False
    python: str | None = None

    def render(self, style: Style, *, inputs: str = INPUTS) -> str:
        """``--name VALUE`` (style ``"cli"``) or ``name=VALUE`` (style ``"python"``);
        ``inputs`` is the API argument that carried the example inputs."""
        if style == "cli":
            flag = f"--{self.cli or self.name.replace('_', '-')}"
            if self.metavar is not None:
                return f"{flag} {self.metavar}"
            if self.value is None or self.value is True:
                return flag
            return f"{flag} {_cli_value(self.value, quoted=self.quoted)}"
        if self.python is not None:
            return self.python
        name = inputs if self.name == INPUTS else self.name
        if self.metavar is not None:
            return f"{name}={self.metavar}"
        if self.value is None:
            return name if self.name == INPUTS else f"{name}="
        return f"{name}={_python_value(self.value)}"


@dataclass(frozen=True, kw_only=True)
class Worded:
    """A stretch of a message that the CLI and the API word differently beyond an option's
    name (a next step only one of them can take).

    Attributes:
        cli: the parts the CLI shows.
        python: the parts the API shows.
    """

    cli: tuple[Part, ...]
    python: tuple[Part, ...]


Part = str | Option | Worded
"""One piece of a `MoparError` message."""

DEBUG = Option(
    "debug", python="the 'mopar' logger at DEBUG (logging.getLogger('mopar').setLevel('DEBUG'))"
)
"""The CLI's ``--debug``, which shows tracebacks and torch's log; the API's nearest is the
``mopar`` logger at DEBUG."""


def _cli_value(value: object, *, quoted: bool) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    if isinstance(value, float):
        return f"{value:g}"
    return repr(value) if quoted and isinstance(value, str) else str(value)


def _python_value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return repr(value)


def render(parts: Sequence[Part], style: Style, *, inputs: str = INPUTS) -> str:
    """``parts`` as one message in ``style``."""
    out = []
    for part in parts:
        if isinstance(part, Option):
            out.append(part.render(style, inputs=inputs))
        elif isinstance(part, Worded):
            out.append(render(getattr(part, style), style, inputs=inputs))
        else:
            out.append(str(part))
    return "".join(out)


def one_line(text: str) -> str:
    """``text`` with every character that is not printable escaped as Python writes it
    (``\\n``): what a message quotes from a file stays on the message's one line."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in str(text))


class MoparError(Exception):
    """A problem with the user's input that the user can fix.

    Its message is ``parts`` (text, `Option`, `Worded`). ``str(exc)`` is the CLI's wording
    (``--slices``), unless a public API function has called `speak` for its Python callers
    (``slices=``); `render` gives either.
    """

    def __init__(self, *parts: Part) -> None:
        super().__init__(*parts)
        self.parts = parts
        self.style: Style = "cli"
        self.inputs = INPUTS

    def render(self, style: Style, *, inputs: str | None = None) -> str:
        """The message in ``style``; ``inputs`` is the API argument that carried the example
        inputs (None: the one `speak` was told, or ``example_args``)."""
        return render(self.parts, style, inputs=inputs or self.inputs)

    def speak(self, style: Style, *, inputs: str = INPUTS) -> None:
        """Make ``str(self)`` the message in ``style`` (the API calls it for Python callers)."""
        self.style, self.inputs = style, inputs

    def __str__(self) -> str:
        return self.render(self.style)


class OptionError(MoparError):
    """An option of the Python API is unknown, of the wrong type or out of range."""


class ModelLoadError(MoparError):
    """The model file is missing, corrupt or of an unsupported kind."""


class UntrustedPickleError(ModelLoadError):
    """The model is a pickle and the user did not opt in to unpickling it."""


class MachineMemoryError(ModelLoadError):
    """The model's weights do not fit the machine that compiles it: ``weights_bytes`` x
    ``factor`` (what compiling holds at its peak) is more than ``available_bytes``."""

    def __init__(self, *parts: Part, weights_bytes=0, available_bytes=0, factor=0.0) -> None:
        super().__init__(*parts)
        self.weights_bytes, self.available_bytes = weights_bytes, available_bytes
        self.factor = factor


class InputSpecError(MoparError):
    """An ``--input`` spec or example-input file is malformed or does not fit the model."""


class CaptureError(MoparError):
    """torch.export could not capture the model."""


class PlanError(MoparError):
    """The requested partition cannot be made (e.g. ``--slices`` out of range)."""


class PartitionInfeasibleError(PlanError):
    """No plan meets a constraint (latency bound, slice count, memory limit).

    Its message is ``reason`` (what no plan meets: a part, or a sequence of them), ``"; "``,
    then ``fix`` (the next step). A caller that plans on without the constraint quotes `why`,
    the reason alone.

    Attributes:
        reason: the parts that say what no plan meets.
        fix: the parts that say what to do.
    """

    def __init__(self, reason: Part | Sequence[Part], *fix: Part) -> None:
        reason = (reason,) if isinstance(reason, (str, Option, Worded)) else tuple(reason)
        super().__init__(*reason, *(("; ", *fix) if fix else ()))
        self.reason = reason
        self.fix = fix

    def __reduce__(self):
        return (type(self), (self.reason, *self.fix), self.__dict__)

    def why(self, style: Style | None = None) -> str:
        """The reason alone, in ``style`` (None: the style ``str(self)`` speaks)."""
        return render(self.reason, style or self.style, inputs=self.inputs)


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
