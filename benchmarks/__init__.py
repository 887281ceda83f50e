"""The evaluation harness (`mopar bench`): every strategy, side by side, measured.

For each model of the suite (`suite.SUITE`) and each strategy or ablation, compile a bundle,
serve all of a model's bundles through the real local runtime with their requests interleaved,
and compute the paper's metrics from the measurements (`metrics`): MC, memory utilisation, OOMs,
cost per request on OpenFaaS and Lambda, latency, error, and the ideal.

Read in this order: `config.BenchConfig`, `suite`, `runner.run_bench` (raw records),
`metrics`, `results.results_doc` (``results.json``), `report.write_results` (the files), `charts`.
Importing this package stays light: torch is imported only when a bench runs.
"""

from __future__ import annotations

from mopar.bench.config import BenchConfig
from mopar.bench.suite import ABLATIONS, DEFAULT_VARIANTS, QUICK, SUITE

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
    """Run the bench (`mopar.bench.runner.run_bench`); returns `BenchResults`."""
    from mopar.bench.runner import run_bench as run

    return run(config, progress=progress)


def write_results(results, out):
    """Write ``results.json``, ``results.md`` and the charts
    (`mopar.bench.report.write_results`)."""
    from mopar.bench.report import write_results as write

    return write(results, out)
