"""``mopar build``: one container image per function of a bundle, from its own Dockerfiles."""

from __future__ import annotations

import click

from mopar.cli.common import emit_json, stderr, stdout

__all__ = ["build_cmd", "container_options"]


def container_options(fn):
    """``--engine``, ``--base-image``, ``--wheelhouse`` and ``--offline`` (build and run)."""
    fn = click.option(
        "--offline",
        is_flag=True,
        help="Take every wheel from --wheelhouse; never reach a package index.",
    )(fn)
    fn = click.option(
        "--wheelhouse",
        type=click.Path(file_okay=False),
        default=None,
        help="Folder of wheels the images install from (default: mopar's cache; "
        "what is missing is downloaded into it, unless --offline).",
    )(fn)
    fn = click.option(
        "--base-image",
        envvar="MOPAR_BASE_IMAGE",
        default=None,
        metavar="IMAGE",
        help="The image the Dockerfiles start from (default: the public "
        "python:3.11-slim ones they name; `make base-image` makes "
        "localhost/mopar-base:bookworm where no registry is reachable). "
        "Env: MOPAR_BASE_IMAGE.",
    )(fn)
    fn = click.option(
        "--engine",
        type=click.Choice(["podman", "docker"]),
        default=None,
        help="Container engine (default: whichever is installed and answers).",
    )(fn)
    return fn


@click.command("build")
@click.argument("bundle", type=click.Path(file_okay=False))
@container_options
@click.option(
    "--kind",
    type=click.Choice(["openfaas", "lambda", "all"]),
    default=None,
    help="Which images: the OpenFaaS function's (template Dockerfile), the Lambda "
    "function's (Dockerfile.lambda) or both (default: the plan's target's).",
)
@click.option(
    "--function",
    "functions",
    multiple=True,
    metavar="NAME",
    help="Build only this function's image (repeatable).",
)
@click.option(
    "--watchdog",
    is_flag=True,
    help="Build the OpenFaaS image's last stage, with the of-watchdog (what faas-cli "
    "builds; its image must be pullable) instead of the function server alone.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the images as JSON.")
def build_cmd(
    bundle, engine, base_image, wheelhouse, offline, kind, functions, watchdog, as_json
) -> None:
    """Build BUNDLE's images: one per function, offline from a wheelhouse, tagged by a digest of
    what goes in (an unchanged function is not built again); report each one's size above its
    base."""
    from pathlib import Path

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mopar.cli.render import images_table
    from mopar.container.build import default_kind, images_for
    from mopar.runner.bundle import read_manifest

    manifest = read_manifest(Path(bundle))
    if kind is None:
        kind = default_kind(manifest.document.plan.get("target"))
    count = len(functions or manifest.slices) * (2 if kind == "all" else 1)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr,
        transient=True,
        disable=as_json or not stderr.is_terminal,
    ) as progress:
        task = progress.add_task(f"building {manifest.model}'s images", total=count)
        engine_used, images = images_for(
            manifest,
            engine=engine,
            base_image=base_image,
            kind=kind,
            functions=functions,
            wheelhouse=Path(wheelhouse) if wheelhouse else None,
            offline=offline,
            watchdog=watchdog,
            on_image=lambda _: progress.advance(task),
        )
    for note in engine_used.notes:
        click.echo(note, err=True)
    if as_json:
        emit_json({"engine": engine_used.name, "images": [i.to_dict() for i in images]})
        return
    stdout.print(
        images_table(images, f"{manifest.model}: {len(images)} images ({engine_used.name})")
    )
