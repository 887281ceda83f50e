"""``mopar serve``: a bundle as one local HTTP endpoint, until Ctrl-C."""

from __future__ import annotations

from typing import Any

import click

from mopar._text import counted
from mopar.cli.options import REDIS_URL, Spec, options, timeout, transport

__all__ = ["serve_cmd"]


SERVER: tuple[Spec, ...] = (
    Spec(
        decls=("--port",),
        help="Port to listen on (0: a free one, printed; 8000, as Triton's HTTP endpoint: not the "
        "OpenFaaS gateway's 8080).",
        type=click.IntRange(0, 65535),
        default=8000,
        arg="P",
    ),
    Spec(
        decls=("--host",),
        help="Address to listen on. 127.0.0.1 is this machine only; 0.0.0.0 serves anyone who "
        "can reach it, with no authentication.",
        default="127.0.0.1",
        arg="H",
    ),
    transport(help="How the functions hand tensors to each other (as `mopar run --transport`)."),
    REDIS_URL,
    Spec(
        decls=("--threads",),
        help="Requests served at once.",
        type=click.IntRange(min=1),
        default=4,
        arg="N",
    ),
    timeout(default=60.0, help="Seconds a function may take to answer."),
)


@click.command("serve")
@click.argument("bundle", type=click.Path(file_okay=False))
@options(SERVER)
def serve_cmd(bundle, port, host, transport, redis_url, threads, timeout_s) -> None:
    """Serve BUNDLE as one HTTP endpoint until Ctrl-C: POST / the model inputs as JSON
    ({"inputs": {name: nested lists}}), .npy, .npz or a frame; the answer follows Accept
    (application/json, application/x-npz, application/x-npy; default: JSON); the Open
    Inference Protocol (KServe v2) at /v2/models/NAME/infer, with its metadata and health.

    Each function runs as its own function server, as `mopar run --transport` runs them."""
    import signal
    import sys
    from pathlib import Path

    from mopar.errors import OptionError
    from mopar.runner.bundle import read_manifest
    from mopar.runner.endpoint import Endpoint

    manifest = read_manifest(Path(bundle))
    generates = manifest.document.generation is not None
    if generates and transport == "redis":
        raise OptionError(
            "a --generate bundle's main function calls its expert functions over shm or http; "
            "use --transport shm or http"
        )
    if generates:  # the generation loop, not its step
        from mopar.runner.completions import CompletionsEndpoint

        endpoint: Any = CompletionsEndpoint(
            manifest, threads=threads, transport=transport, timeout_s=timeout_s
        )
    else:
        endpoint = Endpoint(
            manifest,
            transport=transport,
            redis_url=redis_url,
            threads=threads,
            timeout_s=timeout_s,
        )
    try:  # listen first: a port in use fails before any function starts
        server = endpoint.server(host=host, port=port)
    except OSError as exc:
        raise OptionError(
            f"--host {host} --port {port} cannot be listened on ({exc.strerror or exc}); "
            "pick another --port, or --port 0 for a free one"
        ) from None
    # a plain `kill` cleans up as Ctrl-C does: through the endpoint's close
    before = {
        signal.SIGTERM: signal.signal(
            signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt())
        ),
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
    }
    try:
        with endpoint:
            url = f"http://{host}:{server.effective_port}/"
            click.echo(
                f"serving {manifest.model} ({counted(len(manifest.slices), 'function')}, {transport}) "
                f"at {url}; Ctrl-C stops"
            )
            for line in _banner(endpoint, manifest.model, url, generates):
                click.echo(f"  {line}")
            sys.stdout.flush()
            try:
                server.run()
            except KeyboardInterrupt:
                click.echo("stopped", err=True)
    finally:
        server.close()
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _banner(endpoint, model: str, url: str, generates: bool) -> list[str]:
    """How to call what is served: each route, and each input's shape and dtype."""
    if generates:
        return [
            f"POST {url}generate, or OpenAI's {url}v1/completions (model {model!r}: "
            f"openai.OpenAI(base_url='{url}v1', api_key='none'))"
        ]
    inputs = ", ".join(f"{t.name} {t.describe()}" for t in endpoint.receives)
    return [
        f"curl -H 'Content-Type: application/json' -d '{{\"inputs\": {{...}}}}' {url}"
        f"   (inputs: {inputs})",
        f"Open Inference Protocol (KServe v2, tritonclient): {url}v2/models/{model}/infer",
    ]
