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
        decls=("--input", "input_file"),
        help="An .npz of the model inputs by name (a bundle's reference.npz works too).",
        type=click.Path(dir_okay=False),
        arg="F.npz",
        shown="required",
        extra={"required": True},
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


@click.command("invoke")
@click.argument("target", metavar="URL|BUNDLE")
@options(REQUEST)
def invoke_cmd(target, input_file, output, as_json, timeout_s, transport) -> None:
    """Send the inputs of --input to URL, or run BUNDLE once on them as `mopar run` does;
    write or print the outputs.

    URL is plain HTTP (one POST of an .npz, answered as .npz: `mopar serve`, a function, a
    Lambda Function URL), or Lambda's Invoke API (the JSON event {"inputs": ...}): AWS's
    emulator's http://HOST:PORT/2015-03-31/functions/function/invocations, or `sam local
    start-lambda`'s http://HOST:PORT/2015-03-31/functions/ENTRY/invocations.

    Exit codes: 0 ok; 1 a bad input file, an unreachable URL or a refused request."""
    from pathlib import Path

    from mopar.errors import OptionError
    from mopar.runner.bundle import read_manifest, read_reference

    inputs, _ = read_reference(Path(input_file))  # input.* (or bare) keys; output.* ignored
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
