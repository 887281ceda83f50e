"""``mopar profile collect|train|report|calibrate``: measure operators and layers, fit the
predictors, say how good they are, and measure the transports.

The commands are the lab's: the wheel lists their names and help
(`mopar.cli.checkout.LabCommand`) and loads them from here, in a checkout, when one is invoked.
The profiles they write are read by the package (`mopar.profile.store`, `mopar.profile.calibrate`).
"""

from __future__ import annotations

from pathlib import Path

import click

from mopar.cli.checkout import need_checkout
from mopar.cli.common import (
    Number,
    emit_json,
    progress_bar,
    stderr,
    stdout,
    stdout_to_stderr,
)

__all__ = [
    "USER_PROFILES",
    "calibrate_cmd",
    "collect_cmd",
    "profiles_out",
    "report_cmd",
    "train_cmd",
]


USER_PROFILES = "mopar-profiles"
"""Where ``mopar profile calibrate`` and ``train`` write unless told: a folder of the user's
own, which ``--profiles`` then names (what it lacks comes from the shipped profiles)."""


def profiles_out(out: str) -> Path:
    """The folder a profile command writes to, created; never inside the installed package
    (a reinstall would replace it, and it may not be the user's to write).

    Raises:
        MoparError: ``out`` is in the package, or cannot be created or written, in one line.
    """
    import os

    import mopar
    from mopar.errors import MoparError

    folder = Path(out)
    package = Path(mopar.__file__).resolve().parent
    if folder.resolve() == package or package in folder.resolve().parents:
        raise MoparError(
            f"--out {out!r} is inside the installed mopar package ({package}), which a "
            f"reinstall replaces; write to a folder of your own (default ./{USER_PROFILES}) and "
            "plan with --profiles DIR"
        )
    try:  # before measuring or training, not after
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MoparError(
            f"cannot create --out {out!r} ({exc.strerror}); pass a writable folder"
        ) from None
    if not os.access(folder, os.W_OK):
        raise MoparError(f"--out {out!r} is not writable; pass a writable folder")
    return folder


def _names(
    value: str | None, known: dict, what: str, param: str, aliases: dict | None = None
) -> tuple[str, ...] | None:
    """Comma-separated names, aliases expanded, each checked against ``known`` (None: all)."""
    if value is None:
        return None
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    out: list[str] = []
    for name in names:
        resolved = (aliases or {}).get(name, (name,))
        for n in resolved:
            if n not in known:
                raise click.BadParameter(
                    f"unknown {what} {name!r}; choose from {', '.join(known)}", param_hint=param
                ) from None
            if n not in out:
                out.append(n)
    return tuple(out)


@click.command("collect")
@click.option(
    "--out",
    "out",
    type=click.Path(dir_okay=False),
    default="dataset.csv",
    show_default=True,
    help="CSV file to write; an existing one is resumed (its samples are skipped).",
)
@click.option(
    "--quick", is_flag=True, help="Two small samples per op variant, and the examples' tiny models."
)
@click.option(
    "--ops",
    default=None,
    metavar="OP,OP",
    help="Sweep only these ops (conv, gemm, batched_matmul, attention, lstm, gru, "
    "layer_norm, batch_norm, pool, embedding, softmax, elementwise; aliases: "
    "matmul, linear, bmm, gather, rnn, norm). Default: all.",
)
@click.option("--no-ops", is_flag=True, help="Measure no operator samples, only model layers.")
@click.option(
    "--models",
    default=None,
    metavar="NAME,NAME",
    help="Measure the layers of only these example models. Default: all.",
)
@click.option("--no-models", is_flag=True, help="Measure no model layers, only operators.")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=None,
    help="Measure at most N new samples, then stop (resume later).",
)
@click.option(
    "--scale",
    type=Number(min=0.01),
    default=1.0,
    show_default=True,
    help="Operator samples per variant, as a multiple of the full sweep's count.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="onnxruntime intra-op threads for memory and time_ms_nt (0: its default, as slices run).",
)
@click.option("--json", "as_json", is_flag=True, help="Print a summary as JSON.")
def collect_cmd(out, quick, ops, no_ops, models, no_models, limit, scale, threads, as_json) -> None:
    """Measure memory and time of operators and example layers into a CSV dataset.

    Each sample runs in a separate onnxruntime process with the runtime's session options; rows
    are appended as they are measured, so an interrupted run loses nothing and resumes.
    """
    from tools.profiler.collect import CollectConfig
    from tools.profiler.measure import MeasureConfig
    from tools.profiler.sweep import OP_ALIASES, SWEEP

    examples = need_checkout("profile collect", "examples")  # its list is read, even for none

    config = CollectConfig(
        out=Path(out),
        quick=quick,
        ops=() if no_ops else _names(ops, SWEEP, "op", "--ops", OP_ALIASES),
        models=() if no_models else _names(models, examples.EXAMPLES, "example model", "--models"),
        limit=limit,
        scale=scale,
        measure=MeasureConfig(threads=threads),
    )
    summary = _collect(config)
    if as_json:
        emit_json(summary.to_dict())
        return
    stdout.print(_collect_table(summary))
    stdout.print(
        f"wrote {summary.written} rows ({summary.failed} failed), skipped "
        f"{summary.skipped} already in {summary.out}, in {summary.wall_s:.0f} s"
        + (" -- stopped at --limit" if summary.limited else "")
    )


def _collect(config):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from tools.profiler.collect import collect

    with (
        stdout_to_stderr(),
        Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=stderr,
            transient=True,
            disable=not stderr.is_terminal,
        ) as progress,
    ):
        task = progress.add_task("starting", total=None)

        def tell(phase: str, done: int, total: int) -> None:
            progress.update(task, description=phase, completed=done, total=total)

        return collect(config, progress=tell)


def _collect_table(summary):
    from rich.table import Table

    table = Table(title=f"mopar profile collect: {summary.out}")
    for col in ("op", "written", "failed", "skipped"):
        table.add_column(col, justify="left" if col == "op" else "right")
    for name, counts in sorted(summary.by_op.items()):
        table.add_row(name, str(counts["written"]), str(counts["failed"]), str(counts["skipped"]))
    return table


def _dataset_option(fn):
    return click.option(
        "--dataset",
        type=click.Path(dir_okay=False),
        default=None,
        help="Measured samples (default: profiles/dataset.csv).",
    )(fn)


@click.command("train")
@_dataset_option
@click.option(
    "--out",
    "out",
    type=click.Path(file_okay=False),
    default=USER_PROFILES,
    show_default=True,
    help="Folder for memory.json, time.json, predictors.json; plan and compile with them: "
    "--profiles DIR.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Training seed.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def train_cmd(dataset, out, seed, as_json) -> None:
    """Train the XGBoost memory and time predictors on a collected dataset."""
    folder = profiles_out(out)  # at once: refused before anything is imported or trained
    from dataclasses import asdict

    from mopar.config import PROFILES_DIR, load_profile
    from mopar.profile.features import FEATURE_NAMES
    from mopar.profile.store import save_predictors
    from tools.profiler.predict import TrainConfig
    from tools.profiler.train import load_dataset, parallel_fractions, train_predictors

    config = TrainConfig(seed=seed)
    data = load_dataset(Path(dataset) if dataset else PROFILES_DIR / "dataset.csv")
    copies = float(load_profile(PROFILES_DIR, "runtime")["weight_copies"])
    trained = train_predictors(data, config, weight_copies=copies)
    fractions, threads = parallel_fractions(data)
    save_predictors(
        folder,
        trained.memory,
        trained.time,
        feature_names=FEATURE_NAMES,
        memory_margin=trained.memory_margin,
        weight_copies=trained.weight_copies,
        roofline=trained.roofline,
        extra={
            "samples": len(data.rows),
            # the CPU the samples were measured on (`machine` is the one that trained)
            "measured_on": ", ".join(sorted({str(r.get("cpu_model", "")) for r in data.rows})),
            "train_config": asdict(config),
            "threads": threads,
            "parallel_fraction": fractions,
        },
    )
    margin, roofline = trained.memory_margin, trained.roofline
    summary = {
        "out": str(folder),
        "samples": len(data.rows),
        "memory_margin": margin,
        "roofline": asdict(roofline),
    }
    if as_json:
        emit_json(summary)
    else:
        stdout.print(
            f"trained on {len(data.rows)} samples; memory margin x{margin:.3f}; roofline "
            f"{roofline.flops_per_ms / 1e6:.1f} GFLOP/s, "
            f"{roofline.bytes_per_ms / 1e6:.1f} GB/s, {roofline.overhead_ms:g} ms "
            f"overhead; wrote {folder}/memory.json, time.json, predictors.json (plan with "
            f"them: --profiles {folder})"
        )


@click.command("report")
@_dataset_option
@click.option(
    "--profiles",
    "profiles_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Trained predictors whose margin to apply (default: profiles/).",
)
@click.option(
    "--bundle",
    "bundles",
    multiple=True,
    type=click.Path(file_okay=False),
    help="A compiled bundle whose planned vs measured slices to include (repeatable).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def report_cmd(dataset, profiles_dir, bundles, as_json) -> None:
    """Accuracy of the predictors: per-op CV, leave-one-model-family-out, baselines, slices."""
    from mopar.config import PROFILES_DIR
    from mopar.profile.features import FEATURE_NAMES
    from mopar.profile.store import load_predictors
    from tools.profiler.predict import TrainConfig
    from tools.profiler.report import report_table, slice_errors
    from tools.profiler.train import evaluate, load_dataset

    folder = Path(profiles_dir) if profiles_dir else PROFILES_DIR
    predictors = load_predictors(folder, feature_names=FEATURE_NAMES)
    data = load_dataset(Path(dataset) if dataset else folder / "dataset.csv")
    report = evaluate(
        data,
        TrainConfig(),
        margin=predictors.memory_margin,
        weight_copies=predictors.weight_copies,
    )
    report.update(slice_errors([Path(b) for b in bundles]))
    if as_json:
        emit_json(report)
    else:
        stdout.print(report_table(report))


@click.command("calibrate")
@click.option(
    "--out",
    "out",
    type=click.Path(file_okay=False),
    default=USER_PROFILES,
    show_default=True,
    help="Folder for transports.json (with --speed: platforms.json); plan and compile with "
    "it: --profiles DIR (what it lacks comes from the shipped profiles).",
)
@click.option(
    "--quick",
    is_flag=True,
    help="3 sizes up to 16 MB, 7 requests per chain: about 30 s, for tests.",
)
@click.option(
    "--speed",
    "speed_target",
    metavar="TARGET",
    help="Instead of the transports, measure this machine's CPU as TARGET's (a probe of 9 "
    "operators, 1-3 s): the factor on every predicted time goes into TARGET's speed in "
    "DIR/platforms.json. Run it where the functions run, on a quiet machine.",
)
@click.option(
    "--bundle",
    "bundle",
    type=click.Path(file_okay=False, exists=True),
    help="With --speed and --url: measure this bundle's functions where they are deployed, "
    "not the probe here.",
)
@click.option(
    "--url",
    "url",
    metavar="URL",
    help="With --bundle: its entry function as deployed at its planned CPU (OpenFaaS: "
    "http://GATEWAY/function/NAME), sent the bundle's example request.",
)
@click.option(
    "--requests",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="With --url: requests measured (after 3 warm-up).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON.")
def calibrate_cmd(out, quick, speed_target, bundle, url, requests, as_json) -> None:
    """Measure shm, HTTP and Redis cuts, the hop and the runtime baseline; or, with --speed, a CPU.

    Every figure is a measurement on this machine; redis is skipped (and said so) when
    redis-server or the redis package is missing. The file is replaced atomically.
    """
    from mopar.errors import MoparError
    from tools.profiler.calibrate import QUICK, CalibrateConfig

    if (bundle is None) != (url is None) or (url is not None and speed_target is None):
        raise MoparError(
            "--bundle and --url go together, with --speed TARGET: the TARGET's speed measured "
            "from a bundle's function deployed there"
        )
    if speed_target is not None:
        _speed(speed_target, out, as_json, bundle=bundle, url=url, requests=requests)
        return
    folder = profiles_out(out)
    profile = _calibrate(QUICK if quick else CalibrateConfig())
    path = _save(profile, folder, "transports.json")
    if as_json:
        emit_json(profile)
        return
    stdout.print(_calibrate_table(profile))
    stdout.print(
        f"hop {profile['hop_ms']:.3f} ms, runtime baseline "
        f"{profile['runtime_baseline_mb']:.1f} MB; wrote {path} (plan with it: "
        f"--profiles {folder})"
    )


def _speed(
    target: str, out: str, as_json: bool, *, bundle: str | None, url: str | None, requests: int
) -> None:
    """``--speed TARGET``: probe this CPU (or, with ``bundle`` and ``url``, measure that bundle's
    function where it is deployed) and write TARGET's speed into ``out/platforms.json`` (a copy
    of the folder's own, else of the shipped one, with that entry changed)."""
    from mopar.config import PROFILES_DIR, load_profile
    from mopar.errors import MoparError
    from mopar.profile.features import FEATURE_NAMES
    from mopar.profile.store import load_predictors
    from tools.profiler.speed import measure, speed_of

    profiles = load_profile(Path(out), "platforms")
    if not isinstance(profiles.get(target), dict):
        known = ", ".join(k for k, v in profiles.items() if isinstance(v, dict))
        raise MoparError(
            f"--speed {target!r} is no target of platforms.json; choose one of {known}"
        )
    folder = profiles_out(out)
    if bundle is not None:  # with --url, checked by calibrate_cmd
        from tools.profiler.speed import measure_function

        with progress_bar() as progress:
            progress.add_task(f"{requests} requests to {url}", total=None)
            measured = measure_function(Path(bundle), url, requests=requests)
        _write_speed(profiles, target, measured.entry(), folder, as_json)
        return
    own = folder if (folder / "predictors.json").is_file() else PROFILES_DIR
    predictors = load_predictors(own, feature_names=FEATURE_NAMES)
    with progress_bar() as progress:
        progress.add_task(f"probing this CPU as {target}'s", total=None)
        found = speed_of(predictors, measure(max(int(round(predictors.threads)), 1)))
    _write_speed(profiles, target, found.entry(), folder, as_json)


def _write_speed(profiles: dict, target: str, entry: dict, folder: Path, as_json: bool) -> None:
    """Write ``entry`` as ``target``'s speed into ``folder/platforms.json``, and say so."""
    profiles[target] = {**profiles[target], "speed": entry}
    path = _save(profiles, folder, "platforms.json")
    if as_json:
        emit_json({"target": target, **entry})
        return
    stdout.print(
        f"{target}: predicted times x{entry['time_factor']:.3g} ({entry['source']}); wrote "
        f"{path} (plan with it: --profiles {folder})"
    )


def _calibrate(config):
    from tools.profiler.calibrate import calibrate

    with progress_bar() as progress:
        task = progress.add_task("starting", total=None)

        def tell(phase: str, done: int, total: int) -> None:
            progress.update(task, description=phase, completed=done, total=total)

        return calibrate(config, progress=tell)


def _save(profile: dict, folder, name: str):
    """Write ``folder/name`` atomically: a temporary file beside it, then rename."""
    import json
    import os
    import tempfile

    from mopar._files import as_if_made

    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(profile, f, indent=2, allow_nan=False)
            f.write("\n")
        as_if_made(tmp)  # mkstemp makes it 0600
        os.replace(tmp, folder / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return folder / name


def _calibrate_table(profile: dict):
    from rich.table import Table

    from mopar.profile.calibrate import transfer_ms

    table = Table(title=f"mopar profile calibrate: {profile['measured']['machine']}")
    for col in ("transport", "latency ms", "MB/s", "1 MB ms", "64 MB ms", "max fit err"):
        table.add_column(col, justify="left" if col == "transport" else "right")
    for name, entry in profile["transports"].items():
        if not entry["measured"]:
            table.add_row(name, f"not measured: {entry['reason']}", "", "", "", "")
            continue
        table.add_row(
            name,
            f"{entry['latency_ms']:.3f}",
            f"{entry['mb_per_s']:.0f}",
            *(f"{transfer_ms(profile, name, n << 20):.2f}" for n in (1, 64)),
            f"{entry['max_rel_err']:.0%}",
        )
    return table
