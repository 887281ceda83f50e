"""``mopar profile calibrate``: measure handoff and hop costs into ``DIR/transports.json``."""

from __future__ import annotations

import click

from mopar.cli.checkout import need_checkout
from mopar.cli.common import USER_PROFILES, emit_json, profiles_out, stderr, stdout

__all__ = ["calibrate_cmd"]


@click.command("calibrate")
@click.option(
    "--out",
    "out",
    type=click.Path(file_okay=False),
    default=USER_PROFILES,
    show_default=True,
    help="Folder for transports.json; plan and compile with it: --profiles DIR (what it lacks "
    "comes from the shipped profiles).",
)
@click.option(
    "--quick",
    is_flag=True,
    help="3 sizes up to 16 MB, 7 requests per chain: about 30 s, for tests.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON.")
def calibrate_cmd(out, quick, as_json) -> None:
    """Measure shm, HTTP and Redis cuts on the real runtime, the hop and the runtime baseline.

    Every figure is a loopback measurement on this machine; redis is skipped (and said so) when
    redis-server or the redis package is missing. The file is replaced atomically.
    """
    need_checkout("profile calibrate", "tools")
    from tools.profiler.calibrate import QUICK, CalibrateConfig

    folder = profiles_out(out)
    profile = _run(QUICK if quick else CalibrateConfig())
    path = _save(profile, folder)
    if as_json:
        emit_json(profile)
        return
    stdout.print(_table(profile))
    stdout.print(
        f"hop {profile['hop_ms']:.3f} ms, runtime baseline "
        f"{profile['runtime_baseline_mb']:.1f} MB; wrote {path} (plan with it: "
        f"--profiles {folder})"
    )


def _run(config):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tools.profiler.calibrate import calibrate

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr,
        transient=True,
        disable=not stderr.is_terminal,
    ) as progress:
        task = progress.add_task("starting", total=None)

        def tell(phase: str, done: int, total: int) -> None:
            progress.update(task, description=phase, completed=done, total=total)

        return calibrate(config, progress=tell)


def _save(profile: dict, folder):
    """Write ``folder/transports.json`` atomically: a temporary file beside it, then rename."""
    import json
    import os
    import tempfile
    from pathlib import Path

    from mopar._files import as_if_made

    fd, tmp = tempfile.mkstemp(prefix=".transports.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(profile, f, indent=2, allow_nan=False)
            f.write("\n")
        as_if_made(tmp)  # mkstemp makes it 0600
        os.replace(tmp, folder / "transports.json")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return folder / "transports.json"


def _table(profile: dict):
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
