"""``mopar invoke``: send one request to a served bundle (a URL) or run a bundle once."""

from __future__ import annotations

import click

from mopar.cli.common import emit_json, stdout
from mopar.cli.options import Spec, json_output, options, timeout, transport

__all__ = ["invoke_cmd"]

_SHOWN = 5
"""Values shown per output without --output or --json."""


REQUEST: tuple[Spec, ...] = (
    Spec(
        decls=("--input", "input_given"),
        help="The model inputs: an .npz by name (a bundle's reference.npz works too), a JSON "
        'file ({"inputs": {name: nested lists}}, floats as float32 and whole numbers as int64, '
        "or an Open Inference Protocol body), or, as `mopar compile --input` takes them, one "
        "NAME=DIMxDIM:DTYPE[:LOW..HIGH] per input, filled with seeded random values. `mopar "
        "invoke BUNDLE --help` and `mopar serve` print each input's shape and dtype.",
        arg="F.npz|F.json|SPEC",
        shown="required",
        extra={"required": True, "multiple": True},
    ),
    Spec(
        decls=("--output",),
        help="Write the outputs to this .npz (default: print their names, shapes, dtypes and a "
        "few values).",
        type=click.Path(dir_okay=False),
        arg="OUT.npz",
    ),
    json_output('Print {"outputs": {name: nested lists}}.'),
    timeout(default=60.0, help="Seconds to wait for the answer."),
    transport(help="With a BUNDLE: how its functions hand tensors to each other."),
)


class _InvokeCommand(click.Command):
    """``mopar invoke BUNDLE --help`` also lists the inputs BUNDLE takes, with the ``--input``
    spec of each (help is printed before the arguments are read, so BUNDLE is found here)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["bundle_inputs"] = _bundle_inputs(next((a for a in args if a[:1] != "-"), ""))
        return super().parse_args(ctx, args)

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_epilog(ctx, formatter)
        lines = ctx.meta.get("bundle_inputs")
        if lines:
            with formatter.section("Inputs of this bundle"):
                formatter.write_dl(lines)


def _bundle_inputs(target: str) -> list[tuple[str, str]]:
    """Each input of the bundle at ``target`` (none: it is not a readable bundle) with its shape
    and dtype, and a ``--input`` spec that fills it."""
    from pathlib import Path

    from mopar.bundle.layout import PLAN_FILE
    from mopar.errors import MoparError
    from mopar.runner.bundle import read_manifest

    if not (Path(target) / PLAN_FILE).is_file():
        return []
    try:
        manifest = read_manifest(Path(target))
    except (MoparError, OSError, ValueError):
        return []
    return [
        (t.name, f"{t.describe()}   --input {t.name}={'x'.join(map(str, t.shape))}:{t.dtype}")
        for t in manifest.input_types.values()
    ]


@click.command("invoke", cls=_InvokeCommand)
@click.argument("target", metavar="URL|BUNDLE")
@options(REQUEST)
def invoke_cmd(target, input_given, output, as_json, timeout_s, transport) -> None:
    """Send the inputs of --input to URL, or run BUNDLE once on them as `mopar run` does;
    write or print the outputs.

    URL is plain HTTP (one POST of an .npz, answered as .npz: `mopar serve`, a function, a
    Lambda Function URL), or Lambda's Invoke API (the JSON event {"inputs": ...}): AWS's
    emulator's http://HOST:PORT/2015-03-31/functions/function/invocations, or `sam local
    start-lambda`'s http://HOST:PORT/2015-03-31/functions/ENTRY/invocations.

    Exit codes: 0 ok; 1 a bad input file, an unreachable URL or a refused request."""
    from pathlib import Path

    from mopar.errors import OptionError
    from mopar.runner.bundle import read_manifest

    inputs = _inputs(input_given)
    if target.startswith(("http://", "https://")):
        from mopar.runner.remote import request

        outputs = request(target, inputs, timeout_s=timeout_s)
    elif Path(target).is_dir():
        from mopar.runner.endpoint import Endpoint

        manifest = read_manifest(Path(target))
        manifest.check_inputs(inputs)  # before any function starts
        with Endpoint(manifest, transport=transport, timeout_s=timeout_s) as endpoint:
            outputs = endpoint.run(inputs)
    else:
        raise OptionError(
            f"{target!r} is neither an http:// URL nor a bundle folder; pass the URL `mopar "
            "serve` printed, or a folder `mopar compile` wrote"
        )
    if output:
        _write(Path(output), outputs)
    if as_json:
        from mopar.runtime.bodies import json_outputs

        emit_json(json_outputs(outputs))
    elif output:
        for name, array in outputs.items():
            stdout.print(f"{name}: {array.dtype} {list(array.shape)}", highlight=False)
        stdout.print(f"wrote {output}", highlight=False, soft_wrap=True)
    else:
        for name, array in outputs.items():
            values = ", ".join(f"{v:.6g}" for v in array.ravel()[:_SHOWN].tolist())
            more = ", ..." if array.size > _SHOWN else ""
            stdout.print(
                f"{name}: {array.dtype} {list(array.shape)} [{values}{more}]", highlight=False
            )


def _inputs(given: tuple[str, ...]) -> dict:
    """The arrays ``--input`` gives: one .npz or .json file, or specs."""
    from pathlib import Path

    from mopar.errors import InputSpecError

    if len(given) == 1 and given[0].endswith(".npz"):
        from mopar.runner.bundle import read_reference

        inputs, _ = read_reference(Path(given[0]))  # input.* (or bare) keys; output.* ignored
        return inputs
    if len(given) == 1 and given[0].endswith(".json"):
        return _json_inputs(Path(given[0]))
    if any(g.endswith((".npz", ".json")) for g in given):
        raise InputSpecError(
            "--input takes one .npz or .json file, or specs (NAME=DIMxDIM:DTYPE), not both"
        )
    from mopar.frontend.inputs import make_example_arrays, parse_input_spec

    return make_example_arrays(tuple(parse_input_spec(g) for g in given))


def _json_inputs(path) -> dict:
    """A JSON file's inputs: ``{"inputs": {name: nested lists}}`` (floats as float32, whole
    numbers as int64), or an Open Inference Protocol body (each input's datatype)."""
    import json

    import numpy as np

    from mopar.errors import InputSpecError
    from mopar.runtime.oip import DTYPES

    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputSpecError(
            f"--input {str(path)!r} is not a readable JSON file ({exc}); write "
            '{"inputs": {name: nested lists}}'
        ) from None
    given = doc.get("inputs") if isinstance(doc, dict) else None
    try:
        if isinstance(given, dict):
            arrays = {k: np.asarray(v) for k, v in given.items()}
            return {
                k: a.astype(np.float32 if a.dtype.kind == "f" else np.int64)
                if a.dtype.kind in "fiu"
                else a
                for k, a in arrays.items()
            }
        if isinstance(given, list):
            return {
                t["name"]: np.asarray(t["data"], DTYPES[t["datatype"]]).reshape(t["shape"])
                for t in given
            }
    except (KeyError, TypeError, ValueError) as exc:
        raise InputSpecError(f"--input {str(path)!r}: an input is malformed ({exc})") from None
    raise InputSpecError(
        f'--input {str(path)!r} holds no inputs; write {{"inputs": {{name: nested lists}}}} '
        'or an Open Inference Protocol body ({"inputs": [{"name", "shape", "datatype", "data"}]})'
    )


def _write(path, outputs: dict) -> None:
    from mopar.errors import OptionError
    from mopar.runtime.bodies import write_npz

    try:
        path.write_bytes(write_npz(outputs))
    except OSError as exc:
        raise OptionError(
            f"--output {str(path)!r} cannot be written ({exc.strerror or exc}); pick a "
            "writable path"
        ) from None
