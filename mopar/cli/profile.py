"""``mopar profile``: measure operators and layers, fit the predictors, measure the transports
(the lab's ``collect``, ``train``, ``report`` and ``calibrate``, in ``tools/profiler/cli.py``),
and trace a mixture-of-experts model's experts (``experts``)."""

from __future__ import annotations

import click

from mopar.cli.checkout import LabCommand, LabGroup
from mopar.cli.experts import experts_cmd

__all__ = ["profile_group"]


@click.group("profile", cls=LabGroup)
def profile_group() -> None:
    """Measure operators and layers under onnxruntime, for the memory and time predictors."""


for _name, _help in (
    ("collect", "Measure memory and time of operators and example layers into a CSV dataset."),
    ("train", "Train the XGBoost memory and time predictors on a collected dataset."),
    (
        "report",
        "Accuracy of the predictors: per-op CV, leave-one-model-family-out, baselines, slices.",
    ),
    (
        "calibrate",
        "Measure shm, HTTP and Redis cuts, the hop and the runtime baseline; or, with --speed, a CPU.",
    ),
):
    profile_group.add_command(LabCommand(_name, "tools.profiler.cli", f"{_name}_cmd", _help))
profile_group.add_command(experts_cmd)
