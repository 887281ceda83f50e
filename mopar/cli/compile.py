"""``mopar compile``."""

from __future__ import annotations

from pathlib import Path

import click

from mopar.cli.child import hand_to_parent, role, run_child, worth_a_child
from mopar.cli.common import Number, emit_json, parse_inputs, progress_bar, stdout, stdout_to_stderr
from mopar.cli.options import BUDGET, INPUTS, Spec, json_output, options, planning, tolerance
from mopar.config import DEFAULT_GATEWAY, SPACING_UNITS, Tolerance, check_deploy
from mopar.pipeline import UNTIL, HandedOver

__all__ = ["compile_cmd"]


OUT = Spec(
    decls=("--out", "out"),
    help="Bundle folder to write (default: ./<model>-bundle).",
    type=click.Path(),
    arg="DIR",
    shown="`./<model>-bundle`",
)

CODECS: tuple[Spec, ...] = (
    Spec(
        decls=("--codec",),
        help="Codec at the cuts: none, auto (chosen per tensor within the budget), ae, zstd, "
        "fp16, bf16, int8, fp16+zstd, int8+zstd.",
        default="none",
    ),
    Spec(
        decls=("--calibration",),
        help="Samples codecs are trained and judged on: an .npz or a folder of .npz/images "
        "(default: the example input, augmented); for a mixture-of-experts model, token data "
        "its expert activations are measured on (default: uniform routing is assumed).",
        type=click.Path(exists=True),
        arg="PATH",
        shown="augmented example",
    ),
)

TRAINING: tuple[Spec, ...] = (
    Spec(
        decls=("--codec-budget-s",),
        help="Seconds for training all autoencoders together.",
        type=Number(min=0),
        default=60.0,
        arg="S",
    ),
    Spec(decls=("--seed",), help="Seed of calibration and training.", type=int, default=0, arg="N"),
    Spec(
        decls=("--until",),
        help="Stop after this stage and keep what it made: plan (plan.json), rewrite (and each "
        "function's FX code, functions/*/graph.py) or export (and the ONNX files). Such a "
        "bundle cannot run.",
        type=click.Choice(UNTIL),
        arg="STAGE",
    ),
    Spec(
        decls=("--check-latency/--no-check-latency",),
        help="Under --max-slowdown, serve the plan and the unsplit model side by side before "
        "writing the bundle, and plan again with the measured times if the plan is slower than "
        "the bound allows.",
        default=True,
    ),
    Spec(
        decls=("--measure",),
        help="Where each function's peak memory is measured, which sizes it: host (its deployed "
        "process here: the function server, or the Lambda handler) or containers (also its "
        "image under a memory limit, podman or docker: the cgroup's peak; builds the images, "
        "about doubling a small compile).",
        type=click.Choice(["host", "containers"]),
        default="host",
        arg="host|containers",
    ),
)

DEPLOYMENT: tuple[Spec, ...] = (
    Spec(
        decls=("--base-image",),
        help="With --measure containers: the image the functions' images build on (default: "
        "the public python ones the Dockerfiles name; `make base-image` makes "
        "localhost/mopar-base:bookworm). Env: MOPAR_BASE_IMAGE.",
        default="",
        metavar="IMAGE",
        shown="the Dockerfiles'",
        extra={"envvar": "MOPAR_BASE_IMAGE"},
    ),
    Spec(
        decls=("--image-prefix",),
        help="Registry and namespace of the function images in stack.yml, e.g. "
        "registry.example.com/team: image <prefix>/<model>-s0:latest (default: local images, "
        "<model>-s0:latest).",
        default="",
        metavar="REGISTRY/NAMESPACE",
        shown="none",
    ),
    Spec(
        decls=("--gateway",),
        help="The OpenFaaS gateway faas-cli deploys to: stack.yml's provider.gateway.",
        default=DEFAULT_GATEWAY,
        metavar="URL",
    ),
    Spec(
        decls=("--redis-url",),
        help="The Redis functions hand frames through, redis:// or rediss://: REDIS_URL in "
        "stack.yml and the default of template.yaml's RedisUrl (default: empty, set at deploy "
        "time; needed for redis cuts and Lambda's event chain).",
        default="",
        metavar="URL",
        shown="none",
    ),
    Spec(decls=("--force",), help="Replace --out if it exists.", extra={"is_flag": True}),
    json_output("Print the result as JSON."),
)


@click.command("compile")
@click.argument("model")
@options(
    INPUTS,
    [OUT],
    planning(deploy=True),
    tolerance(
        decided=f"by each output's type: {Tolerance()} for float32; for float16 and bfloat16, "
        f"{SPACING_UNITS} of its rounding steps (np.spacing) per element and at the output's "
        "largest value; one of them given, the other is float32's",
        shown="by each output's type",
    ),
    CODECS,
    BUDGET,
    TRAINING,
    DEPLOYMENT,
)
def compile_cmd(
    model,
    input_specs,
    example_npz,
    trust_pickle,
    out,
    rtol,
    atol,
    calibration,
    until,
    force,
    as_json,
    **given,  # the options CompileConfig takes as they are
) -> None:
    """Compile MODEL (.pt2, TorchScript .pt, package.module:factory) into a bundle.

    The stages: capture, profile, plan, rewrite, compress (with --codec), export, verify,
    measure, emit; --verbose shows each one's seconds, and plan.json records them."""
    from mopar.emit.bundle import check_out

    if out:  # before torch is imported, so at once
        check_out(Path(out), force=force)
    check_deploy(**{k: given[k] for k in ("image_prefix", "gateway", "redis_url")})
    from mopar import api
    from mopar.cli.common import compile_config

    config = compile_config(
        given,
        tolerance=Tolerance.given(rtol, atol),
        calibration=Path(calibration) if calibration else None,
    )
    staged = None
    if role() == "parent" and worth_a_child(model):  # torch goes in a child
        code, staged = run_child()
        if code:
            raise click.exceptions.Exit(code)  # the child said why
        if staged is None:
            return  # the child wrote the bundle and said so
    facts = api.facts_for(config, predictors=staged is None)  # measuring needs none
    with stdout_to_stderr(), progress_bar(count=False, spinner=True) as progress:
        task = progress.add_task("load", total=None)

        def tell(phase: str, done: int, total: int) -> None:
            progress.update(task, description=phase, completed=done, total=total)

        if staged is not None:
            from mopar.pipeline.finish import finish

            bundle = finish(staged, config=config, facts=facts, progress=tell)
        else:
            inputs = parse_inputs(input_specs, example_npz)
            analysis = api.analyze_for(
                config, model, inputs, trust_pickle=trust_pickle, progress=tell
            )
            out_dir = Path(out) if out else Path(f"{analysis.captured.name}-bundle")
            if not out:  # the default folder, known only now
                check_out(out_dir, force=force)
            bundle = api.build_bundle(
                analysis,
                out_dir,
                config=config,
                force=force,
                progress=tell,
                facts=facts,
                until=until,
                hand_over=role() == "child",
            )
    if isinstance(bundle, HandedOver):  # the child: the parent carries it out
        hand_to_parent(bundle.staged)
        return
    _report(bundle, as_json)


def _report(bundle, as_json: bool) -> None:
    from dataclasses import asdict

    from mopar.cli.render import codec_table, experts_table, plan_table, quantize_table

    if as_json:
        emit_json(
            {
                "bundle": str(bundle.path),
                "plan": bundle.plan.to_dict(),
                "max_abs_err": bundle.max_abs_err,
                "max_rel_err": bundle.max_rel_err,
                "rtol": bundle.tolerance.rtol,
                "atol": bundle.tolerance.atol,
                "until": bundle.until,
                "stages": [asdict(t) for t in bundle.stages],
            }
        )
        return
    stdout.print(plan_table(bundle.plan))
    if (experts := experts_table(bundle.plan)) is not None:
        stdout.print(experts)
    if any(f.codecs for f in bundle.plan.functions):
        stdout.print(codec_table(bundle.plan))
    if any(f.quantized for f in bundle.plan.functions):
        stdout.print(quantize_table(bundle.plan))
    if bundle.until is None:
        stdout.print(
            f"verified: onnxruntime slices vs the model, max abs error "
            f"{bundle.max_abs_err:.2e}, max relative error {bundle.max_rel_err:.2e} "
            f"(allclose, {bundle.tolerance})"
        )
    for note in bundle.plan.notes:
        stdout.print(f"note: {note}")
    if bundle.until is not None:
        stdout.print(
            f"stopped after stage {bundle.until} (--until {bundle.until}): not "
            "verified, and `mopar run` will not run it"
        )
    stdout.print(f"wrote {bundle.path}/", soft_wrap=True)
