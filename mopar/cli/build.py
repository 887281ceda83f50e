"""``mopar build``: one container image per function of a bundle, from its own Dockerfiles."""

from __future__ import annotations

import click

from mopar.cli.common import emit_json, progress_bar, stdout
from mopar.cli.options import CONTAINER_BUILD, Spec, json_output, options

__all__ = ["build_cmd"]


IMAGES: tuple[Spec, ...] = (
    Spec(
        decls=("--kind",),
        help="Which images: the OpenFaaS function's (template Dockerfile, in every bundle), "
        "the Lambda function's (Dockerfile.lambda, in a bundle compiled for Lambda) or all "
        "the bundle has (default: the plan's target's).",
        type=click.Choice(["openfaas", "lambda", "all"]),
        shown="the plan's target's",
    ),
    Spec(
        decls=("--function", "functions"),
        help="Build only this function's image (repeatable).",
        metavar="NAME",
        shown="every function",
        extra={"multiple": True},
    ),
    Spec(
        decls=("--watchdog",),
        help="Build the OpenFaaS image's last stage, with the of-watchdog (what faas-cli "
        "builds; its image must be pullable) instead of the function server alone.",
        extra={"is_flag": True},
    ),
    json_output("Print the images as JSON."),
)


@click.command("build")
@click.argument("bundle", type=click.Path(file_okay=False))
@options(CONTAINER_BUILD, IMAGES)
def build_cmd(
    bundle, engine, base_image, wheelhouse, offline, kind, functions, watchdog, as_json
) -> None:
    """Build BUNDLE's images: one per function, offline from a wheelhouse, tagged by a digest of
    what goes in (an unchanged function is not built again); report each one's size above its
    base."""
    from pathlib import Path

    from mopar.cli.render import images_table
    from mopar.container.build import bundle_kinds, default_kind, images_for
    from mopar.runner.bundle import read_manifest

    manifest = read_manifest(Path(bundle))
    if kind is None:
        kind = default_kind(manifest.document.plan.get("target"))
    count = len(functions or manifest.slices) * (
        len(bundle_kinds(manifest.root)) if kind == "all" else 1
    )
    with progress_bar(quiet=as_json) as progress:
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
