"""mopar's benchmarks, beside the package in its repository (not in the wheel): the evaluation
harness of ``mopar bench`` and the one-off experiments, each a ``python -m benchmarks.NAME``
script run from the root of a checkout (docs/benchmarks.md and the pages it links quote them).

The harness: every strategy, side by side, measured.

For each model of the suite (`suite.SUITE`) and each strategy or ablation, compile a bundle,
serve all of a model's bundles through the real local runtime with their requests interleaved,
and compute the paper's metrics from the measurements (`metrics`): MC, memory utilisation, OOMs,
cost per request on OpenFaaS and Lambda, latency, error, and the ideal.

Read in this order: `config.BenchConfig`, `suite`, `runner.run_bench` (raw records),
`metrics`, `results.results_doc` (``results.json``), `report.write_results` (the files), `charts`.
``mopar bench --traffic``, ``--rate``, ``--containers``, ``--moe`` and ``--hops`` are `traffic`,
`serving`, `containers`, `moe` and `hops`.

The experiments: `compile_memory` (with `caps`), `predict`, `generation`, `codecs`, `quantize`,
`codec_activations`, `partition_speed`, `sim_validate` and `regime`; `torch_ref` and `floor`
serve the harness. mopar never imports this package at module level: ``mopar bench`` imports it inside the
command (`mopar.cli.checkout`). Importing it stays light: torch is imported only when a bench
runs.
"""

from __future__ import annotations

from benchmarks.config import BenchConfig
from benchmarks.suite import ABLATIONS, DEFAULT_VARIANTS, QUICK, SUITE

__all__ = [
    "BenchConfig",
    "SUITE",
    "ABLATIONS",
    "DEFAULT_VARIANTS",
    "QUICK",
    "run_bench",
    "write_results",
]


def run_bench(config: BenchConfig, *, progress=None):
    """Run the bench (`benchmarks.runner.run_bench`); returns `BenchResults`."""
    from benchmarks.runner import run_bench as run

    return run(config, progress=progress)


def write_results(results, out):
    """Write ``results.json``, ``results.md`` and the charts
    (`benchmarks.report.write_results`)."""
    from benchmarks.report import write_results as write

    return write(results, out)
