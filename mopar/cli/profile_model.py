"""``mopar profile train`` and ``mopar profile report``: fit the predictors, and say how good they are."""

from __future__ import annotations

import click

from mopar.cli.checkout import need_checkout
from mopar.cli.common import USER_PROFILES, emit_json, profiles_out, stdout

__all__ = ["train_cmd", "report_cmd"]


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
    need_checkout("profile train", "tools")
    folder = profiles_out(out)  # at once: refused before anything is imported or trained
    from dataclasses import asdict
    from pathlib import Path

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
    need_checkout("profile report", "tools")
    from pathlib import Path

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
