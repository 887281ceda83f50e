"""Argument handling of the Python API (`mopar.api`): example inputs, options, error wording.

Read in order:

* `example_arrays` turns what a caller passes -- torch.export's ``(args, kwargs)`` or mopar's
  own forms -- into named numpy arrays for `mopar.frontend.capture`. The rule for
  ``example_args``:

  ===================  ==========================================================================
  ``None`` or ``()``   no positional inputs; a .pt2 or ExportedProgram then uses its own
  tuple                positional inputs (tensors or numpy arrays) bound to forward()'s
                       parameters in order, as ``torch.export.export(model, args, kwargs)``
  dict                 inputs by forward() parameter name (the same as ``example_kwargs``)
  list of str          ``"NAME=SHAPE:DTYPE"`` specs, filled with seeded random values (a tuple
                       of strings too: strings are never tensors)
  str or PathLike      an .npz of arrays keyed by forward() parameter name
  ===================  ==========================================================================

  ``example_kwargs`` (a dict) adds inputs by name; it goes with a tuple only.
* `compile_config` checks ``**options`` against `CompileConfig`'s fields and types, and a
  ``platform=`` (a `mopar.facts.Platform` built in code) against the options it replaces.
* `python_terms` words the `MoparError`s of a public function for Python callers. mopar's
  phases raise errors that name options as data (`mopar.errors.Option`); the CLI renders them
  as flags (``--slices``), and under `python_terms` they read as the arguments they stand for
  (``slices=``).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import numbers
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from mopar.config import KEEP_POSITIONS, CompileConfig, DynamicDim, Tolerance, parse_dynamic
from mopar.errors import InputSpecError, MoparError, Option, OptionError, Worded
from mopar.facts import Platform

__all__ = [
    "PLAN_OPTIONS",
    "COMPILE_OPTIONS",
    "check_arguments",
    "check_choices",
    "compile_config",
    "dynamic_dims",
    "example_arrays",
    "python_terms",
]

# --- example inputs ------------------------------------------------------------------------------

_FORMS = (
    "a tuple of positional inputs (as torch.export.export takes), a dict of inputs by name, "
    "a list of 'NAME=SHAPE:DTYPE' specs, or the path of an .npz"
)


def example_arrays(
    loaded: Any, example_args: Any, example_kwargs: Any
) -> tuple[dict[str, np.ndarray] | None, tuple[str, ...]]:
    """The example inputs of ``loaded`` (a `LoadedModel`) by input name, or None for none, and
    notes on what was assumed to read them (`mopar.frontend.inputs.fit_example_npz`).

    Raises:
        InputSpecError: naming ``example_args`` or ``example_kwargs`` and what it should be.
    """
    named = _named(example_kwargs, "example_kwargs") if example_kwargs is not None else {}
    where, notes = "example_kwargs", ()
    if _empty(example_args):
        arrays = named
    elif _is_specs(example_args):
        _alone(example_kwargs, "spec strings")
        arrays, where = _specs(example_args), "example_args"
    elif isinstance(example_args, tuple):
        arrays = _bind_positional(loaded, example_args, named)
    elif isinstance(example_args, Mapping):
        _alone(example_kwargs, "a dict")
        arrays, where = _named(example_args, "example_args"), "example_args"
    elif isinstance(example_args, (str, os.PathLike)):
        _alone(example_kwargs, "an .npz path")
        (arrays, notes), where = _npz(example_args, loaded), "example_args"
    else:
        raise InputSpecError(_not_understood(example_args))
    if loaded.exported is None:  # an exported program's inputs are checked as it is bound
        _check_names(loaded, arrays, where)
    return arrays or None, notes


def _check_names(loaded: Any, arrays: dict[str, np.ndarray], where: str) -> None:
    """The example inputs fit forward()'s parameters. The CLI reaches these checks too (its
    ``--input``s arrive as spec strings), and its next step is another: each error carries
    both wordings."""
    from mopar.frontend.capture import input_names, needed_inputs

    names = ", ".join(input_names(loaded))
    unknown = [k for k in arrays if k not in input_names(loaded)]
    if unknown:
        raise InputSpecError(
            Worded(cli=(), python=(f"{where}: ",)),
            f"input {unknown[0]!r} is not an argument of {loaded.name}.forward({names}); ",
            Worded(
                cli=("rename the ", Option("example_args", cli="input"), " to one of those"),
                python=("name each input after one of those",),
            ),
        )
    if not arrays:
        raise InputSpecError(
            f"model {loaded.name!r} needs example inputs: {needed_inputs(loaded)}",
            Worded(
                cli=(
                    "; pass ",
                    Option("example_args", cli="input", metavar="NAME=DIMxDIM:DTYPE"),
                    " for each, or ",
                    Option("example_args", cli="example-inputs", metavar="FILE.npz"),
                ),
                python=(
                    ", and example_args is empty; pass them as torch.export.export takes them: "
                    "mopar.partition(model, (x,)) or mopar.partition(model, (), {'x': x})",
                ),
            ),
        )


def _empty(example_args: Any) -> bool:
    return example_args is None or (isinstance(example_args, (tuple, list)) and not example_args)


def _is_specs(example_args: Any) -> bool:
    from mopar.frontend.inputs import InputSpec

    return isinstance(example_args, (tuple, list)) and all(
        isinstance(s, (str, InputSpec)) for s in example_args
    )


def _specs(items: Any) -> dict[str, np.ndarray]:
    from mopar.frontend.inputs import make_example_arrays, parse_input_spec

    specs = tuple(parse_input_spec(s) if isinstance(s, str) else s for s in items)
    return make_example_arrays(specs)


def _alone(example_kwargs: Any, form: str) -> None:
    if example_kwargs is not None:
        raise InputSpecError(
            f"example_kwargs goes with a tuple of positional inputs, but example_args is {form}; "
            "pass example_args=(...) with example_kwargs={...}, or every input in one of them"
        )


def _npz(path: str | os.PathLike, loaded: Any) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    from mopar.frontend.capture import input_shapes
    from mopar.frontend.inputs import fit_example_npz, load_example_npz

    text = os.fspath(path)
    if isinstance(path, str) and "=" in text and not Path(text).exists():
        raise InputSpecError(
            Worded(
                cli=(
                    Option("example_args", cli="example-inputs"),
                    f" file {text!r} does not exist; give a spec as ",
                    Option("example_args", cli="input", value=text),
                ),
                python=(
                    f"example_args {text!r} is a string, which mopar reads as the path of an "
                    f".npz; put spec strings in a list: [{text!r}]",
                ),
            )
        )
    return fit_example_npz(load_example_npz(Path(text)), input_shapes(loaded), Path(text).name)


def _bind_positional(
    loaded: Any, args: tuple, named: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Bind ``args`` to the model's positional parameters by name, as Python binds a call."""
    from mopar.frontend.capture import input_names

    names = input_names(loaded, positional=True)
    if len(args) > len(names):
        raise InputSpecError(
            f"example_args has {len(args)} inputs, but {_forward(loaded)} takes {len(names)} "
            f"positionally; pass at most {len(names)}, or name the others in example_kwargs"
        )
    bound: dict[str, np.ndarray] = {}
    for i, (name, value) in enumerate(zip(names, args)):
        if name in named:
            raise InputSpecError(
                f"input {name!r} is given twice, as example_args[{i}] and as "
                f"example_kwargs[{name!r}]; give it once"
            )
        if value is not None:  # None: forward()'s default
            bound[name] = _array(value, f"example_args[{i}]")
    return {**bound, **named}


def _named(mapping: Any, where: str) -> dict[str, np.ndarray]:
    if not isinstance(mapping, Mapping):
        raise InputSpecError(
            f"{where} is {_a(type(mapping).__name__)}; pass a dict from forward() parameter "
            "name to tensor, e.g. {'x': x}"
        )
    out: dict[str, np.ndarray] = {}
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise InputSpecError(
                f"{where} has the key {key!r}; name each input by its forward() parameter, a str"
            )
        if value is not None:  # None: forward()'s default
            out[key] = _array(value, f"{where}[{key!r}]")
    return out


def _array(value: Any, where: str) -> np.ndarray:
    """``value`` as a numpy array that mopar owns (a copy: capture keeps it, torch wants it
    writable)."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            raise InputSpecError(
                f"{where} is a tensor on the meta device, which holds a shape but no values; "
                "pass a tensor with values (torch.randn(...) or real data, on the CPU)"
            )
        try:
            return value.detach().cpu().resolve_conj().resolve_neg().numpy().copy()
        except (TypeError, RuntimeError, NotImplementedError, AssertionError) as exc:
            raise InputSpecError(_unreadable(value, where, exc)) from None
    if isinstance(value, (np.ndarray, np.generic)):
        return np.array(value)
    nested = (
        " (nested inputs are not supported: make forward() take tensors)"
        if isinstance(value, (list, tuple, dict))
        else ""
    )
    raise InputSpecError(
        f"{where} is {_a(type(value).__name__)}{nested}; each example input must be a tensor or "
        "a numpy array; bind constants in the model itself (e.g. a wrapper module)"
    )


def _unreadable(value: Any, where: str, exc: BaseException) -> str:
    """Why mopar cannot read the values of tensor ``value`` (``where``), and the fix."""
    import torch

    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    try:
        torch.empty(0, dtype=value.dtype).numpy()
    except TypeError:
        return (
            f"{where} is {_a(str(value.dtype))} tensor, which mopar cannot hand over ({reason}); "
            "pass float32, float16, float64, int64, int32 or bool"
        )
    if value.device.type != "cpu":
        return (
            f"{where} is a tensor on {value.device} whose values mopar cannot read ({reason}); "
            "pass it as x.cpu()"
        )
    return (
        f"{where} is {_a(type(value).__name__)}, whose values mopar cannot read ({reason}); "
        "pass a plain torch.Tensor or numpy array"
    )


def _not_understood(example_args: Any) -> str:
    import torch

    kind = type(example_args).__name__
    if isinstance(example_args, (torch.Tensor, np.ndarray)):
        return (
            f"example_args is {_a(kind)}; pass a tuple of positional inputs, as "
            "torch.export.export takes them: (x,)"
        )
    if isinstance(example_args, list):
        kinds = ", ".join(sorted({type(a).__name__ for a in example_args}))
        return (
            f"example_args is a list of {kinds}; pass positional inputs as a tuple, as "
            "torch.export.export takes them: tuple(inputs), or spec strings alone in a list"
        )
    return f"example_args is {_a(kind)}; pass {_FORMS}"


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _forward(loaded: Any) -> str:
    from mopar.frontend.capture import input_names

    names = ", ".join(input_names(loaded))
    if loaded.exported is not None:
        return f"the exported program {loaded.name}({names})"
    return f"{loaded.name}.forward({names})"


# --- options -------------------------------------------------------------------------------------

PLAN_OPTIONS = frozenset(
    {
        "slices",
        "strategy",
        "target",
        "transport",
        "colocate",
        "arch",
        "slo_ms",
        "max_slowdown",
        "max_memory_mb",
        "cold_start_rate",
        "simplify_threshold",
        "min_memory",
        "parallel",
        "force_parallel",
        "profiles_dir",
        "experts",
        "expert_group",
        "hot_experts",
        "rate",
        "trace",
        "chain",
        "dynamic",
        "keep_positions",
        "generate",
        "max_seq_len",
    }
)
"""What `mopar.partition` takes as ``**options``: the planning fields of `CompileConfig`."""

EXPERT_MODES = ("functions", "inline")
"""How a mixture-of-experts model's experts are deployed (``--experts``)."""

COMPILE_OPTIONS = frozenset({f.name for f in fields(CompileConfig)} - {"depth"} | {"rtol", "atol"})
"""What `mopar.compile` takes as ``**options``: every `CompileConfig` field, and ``rtol`` and
``atol`` (the fields of ``tolerance``, as the CLI's ``--rtol``/``--atol``)."""

# The numeric bounds the CLI's click types give its flags: (low, high, low excluded).
_BOUNDS: dict[str, tuple[float, float | None, bool]] = {
    "depth": (1, None, False),
    "parallel": (1, 16, False),
    "slo_ms": (0, None, True),
    "max_slowdown": (1, None, False),
    "max_memory_mb": (1, None, False),
    "cold_start_rate": (0, 1, False),
    "expert_group": (1, None, False),
    "max_output_error": (0, None, False),
    "max_top1_change": (0, 100, False),
    "min_cosine": (-1, 1, False),
    "codec_budget_s": (0, None, False),
    "rtol": (0, None, False),
    "atol": (0, None, False),
    "rate": (0, None, True),
    "hot_experts": (0, None, False),
    "max_seq_len": (2, None, False),
}


def compile_config(
    function: str,
    allowed: frozenset[str],
    *,
    depth: Any,
    options: dict[str, Any],
    platform: Any = None,
) -> CompileConfig:
    """The `CompileConfig` of ``function(**options)``; `OptionError` for an unknown option, a
    value of the wrong type, or a ``platform`` given with the options that choose one from the
    profiles, and `PlanError` for an unknown strategy. (`mopar.facts.load_facts` checks the
    target, arch and transport as it loads them.)"""
    _typed("platform", platform, Platform | None)
    chosen = sorted({"target", "arch"} & set(options))
    if platform is not None and chosen:
        raise OptionError(
            f"{function}() got platform= and {chosen[0]}={options[chosen[0]]!r}; {chosen[0]}= "
            "chooses a platform from the profiles and platform= is one already: pass one of them"
        )
    unknown = sorted(set(options) - allowed)
    if unknown:
        near = difflib.get_close_matches(unknown[0], allowed, n=1)
        raise OptionError(
            f"{function}() got an unknown option {unknown[0]}={options[unknown[0]]!r}"
            + (f" (did you mean {near[0]}=?)" if near else "")
            + f"; valid options: {', '.join(f'{n}=' for n in sorted(allowed))}"
        )
    hints = typing.get_type_hints(CompileConfig)
    hints.update(rtol=float, atol=float)
    values = {k: _typed(k, v, hints[k]) for k, v in options.items() if k != "dynamic"}
    if "dynamic" in options:
        values["dynamic"] = dynamic_dims(options["dynamic"])
    values["depth"] = _typed("depth", depth, hints["depth"])
    if values.get("profiles_dir", ...) is None:
        del values["profiles_dir"]
    given = Tolerance.given(values.pop("rtol", None), values.pop("atol", None))
    if given is not None:
        if "tolerance" in values:
            raise OptionError("pass tolerance= or rtol=/atol=, not both")
        values["tolerance"] = given
    config = CompileConfig(**values)
    check_choices(config)
    return config


def dynamic_dims(value: Any) -> tuple[DynamicDim, ...]:
    """``dynamic=``: one ``"NAME:AXIS=MIN..MAX"`` or `DynamicDim`, or a list of them."""
    items = [value] if isinstance(value, (str, DynamicDim)) else value
    if not isinstance(items, (list, tuple)) or not all(
        isinstance(d, (str, DynamicDim)) for d in items
    ):
        raise OptionError(
            f"dynamic={value!r} is {_a(type(value).__name__)}; expected a list of "
            "'NAME:AXIS=MIN..MAX' strings, e.g. dynamic=['input_ids:1=1..512']"
        )
    return tuple(d if isinstance(d, DynamicDim) else parse_dynamic(d) for d in items)


def check_arguments(*, progress: Any = None, **values: Any) -> None:
    """Check a public function's own keyword arguments (``depth``, ``trust_pickle``, ``force``,
    ``out``, ``progress``) against their types."""
    kinds = {"depth": int | None, "trust_pickle": bool, "force": bool, "out": Path}
    for name, value in values.items():
        _typed(name, value, kinds[name])
    if values.get("out") is not None:
        _own_folder(Path(values["out"]))
    if progress is not None and not callable(progress):
        raise OptionError(
            f"progress={progress!r} is {_a(type(progress).__name__)}; expected a "
            "callable taking (phase, done, total), or None"
        )


def _own_folder(out: Path) -> None:
    """``out`` is a folder compile may make, and replace whole: not the working directory,
    nor one that holds it (``"."``, ``".."``, ``"/"``)."""
    here, there = Path.cwd().resolve(), out.resolve()
    if there == here or there in here.parents:
        what = (
            "the working directory"
            if there == here
            else "a folder that holds the working directory"
        )
        raise OptionError(
            f"out={str(out)!r} is {what}; compile writes the bundle as a folder of its own "
            "(force=True replaces it whole): give a new folder, e.g. out='bundle'"
        )


def _typed(name: str, value: Any, hint: Any) -> Any:
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kinds = typing.get_args(hint) if union else (hint,)
    if value is None and type(None) in kinds:
        return None
    for kind in kinds:
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return _bounded(name, int(value))
        if kind is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
            return _bounded(name, float(value))
        if kind is str and isinstance(value, str):
            return value
        if kind is Path and isinstance(value, (str, os.PathLike)):
            return Path(value)
        plain = kind in (bool, int, float, str, Path)
        if not plain and isinstance(kind, type) and isinstance(value, kind):
            return value
    expected = " or ".join(_kind_name(k) for k in kinds)
    raise OptionError(f"{name}={value!r} is {_a(type(value).__name__)}; expected {expected}")


def _kind_name(kind: Any) -> str:
    if kind is type(None):
        return "None"
    if kind is Path:
        return "a path (str or pathlib.Path)"
    if kind.__module__.startswith("mopar."):
        return f"{kind.__module__}.{kind.__qualname__}"
    return getattr(kind, "__name__", str(kind))


def _bounded(name: str, value: float) -> float:
    if isinstance(value, float) and not math.isfinite(value):  # nan passes every bound
        raise OptionError(f"{name}={value!r} is not a finite number; pass a number")
    if name not in _BOUNDS:
        return value
    low, high, open_low = _BOUNDS[name]
    if (value <= low if open_low else value < low) or (high is not None and value > high):
        span = f"{'above' if open_low else 'at least'} {low:g}"
        span += f" and at most {high:g}" if high else ""
        raise OptionError(f"{name}={value!r} is out of range; it must be {span}")
    return value


def check_choices(config: CompileConfig) -> None:
    from mopar.bill import CHAINS
    from mopar.config import hot_experts_value
    from mopar.errors import PlanError
    from mopar.plan import STRATEGIES

    hot_experts_value(config.hot_experts)
    for name, value, known in (
        ("chain", config.chain, (None, *CHAINS)),  # None: the cheapest
        ("strategy", config.strategy, STRATEGIES),
        ("experts", config.experts, EXPERT_MODES),
        ("keep_positions", config.keep_positions, KEEP_POSITIONS),
    ):
        if value not in known:
            raise PlanError(
                "unknown ",
                Option(name, value=value, quoted=True),
                f"; choose one of {', '.join(k for k in known if k is not None)}",
            )
    if config.rate is not None and config.trace is not None:
        raise OptionError(
            "give either ", Option("rate"), " or ", Option("trace"), " (the traffic), not both"
        )
    lossy = (config.max_output_error, config.max_top1_change, config.min_cosine)
    if config.quantize == "auto" and all(b is None for b in lossy):
        raise OptionError(
            Option("quantize", value="auto"),
            " chooses each function's weights within a budget, and none was given; add ",
            Option("max_top1_change", value="1"),
            ", ",
            Option("max_output_error", value="0.01"),
            " or ",
            Option("min_cosine", value="0.99"),
        )
    for name, value, plain in (
        ("parallel", config.parallel, 1),
        ("codec", config.codec, "none"),
        ("quantize", config.quantize, "none"),
    ):
        if config.dynamic and value != plain:
            raise OptionError(
                Option("dynamic"),
                " and ",
                Option(name, value=value),
                " do not go together yet: sub-slices, codecs and quantised weights are made "
                "for one shape; drop one of them",
            )
    if config.generate and config.keep_positions != "all":  # the step's outputs: its cache too
        raise OptionError(
            Option("keep_positions", value=config.keep_positions),
            " cuts a forward's answer; with ",
            Option("generate"),
            " the main function answers with tokens: leave it out",
        )


# --- errors in Python's terms --------------------------------------------------------------------


def python_terms(fn: Callable) -> Callable:
    """Decorate a public API function: the `MoparError`s it raises name its Python arguments
    (`MoparError.speak`); ``exc.render("cli")`` still gives the CLI's wording."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MoparError as exc:
            bound = signature.bind_partial(*args, **kwargs).arguments
            by_name = _empty(bound.get("example_args")) and bound.get("example_kwargs") is not None
            exc.speak("python", inputs="example_kwargs" if by_name else "example_args")
            raise

    return call
