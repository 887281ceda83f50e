"""Compile sizes every function from the process it deploys as: the function server for
OpenFaaS, the Lambda handler for Lambda. Served that way after compile, no function peaks above
its allocation less compile's margin, and ``plan.json`` says which process was measured."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from mopar.bundle.document import read_document
from mopar.config import CompileConfig, RunConfig
from mopar.runner.bundle import read_manifest, read_reference
from mopar.runner.chain import AS_PLANNED
from mopar.runner.local import run_bundles


def _served(bundle: Path, transport: str, **config):
    inputs, expected = read_reference(bundle / "reference.npz")
    (report,) = run_bundles(
        [read_manifest(bundle)],
        inputs,
        config=RunConfig(requests=config.pop("requests", 9), **config),
        expected=expected,
        transport=transport,
    )
    assert report.errors == 0 and report.comparison.passed
    return report


def _covers(bundle: Path, report) -> None:
    """Each function's allocation holds the peak ``report`` saw, and the peak compile sized it
    from is that process's (within 5 %: a second serve's peak differs by a little; the shm
    worker's, which compile measured before, is ~13 % below the server's here)."""
    sizing = {s.function: s for s in read_document(bundle).sizing}
    for s in report.slices:
        sized = sizing[s.name]
        assert s.peak_rss_mb <= sized.memory_mb, (s.name, s.peak_rss_mb, sized)
        assert sized.peak_rss_mb >= 0.95 * s.peak_rss_mb, (s.name, s.peak_rss_mb, sized)


def test_openfaas_functions_are_sized_from_their_function_server(skipnet_bundle):
    sizing = read_document(skipnet_bundle).sizing
    assert {s.measured_in for s in sizing} == {"server"}
    report = _served(skipnet_bundle, "http")  # each slice's function server, chained by HTTP
    assert report.served_by == "server"
    _covers(skipnet_bundle, report)
    # the server holds more than the shm runner's worker: the old rule sized from the worker
    worker = {s.name: s.peak_rss_mb for s in _served(skipnet_bundle, "shm").slices}
    assert all(s.peak_rss_mb > worker[s.name] for s in report.slices)


def test_lambda_functions_are_sized_from_their_lambda_handler(skipnet_analysis, tmp_path):
    from mopar import api

    config = CompileConfig(target="lambda", slices=2, strategy="uniform", check_latency=False)
    api.build_bundle(skipnet_analysis, tmp_path / "b", config=config, force=True, progress=None)
    bundle = tmp_path / "b"
    sizing = read_document(bundle).sizing
    assert {s.measured_in for s in sizing} == {"lambda-handler"}
    assert all(s.peak_rss_mb > 0 and not math.isnan(s.p50_ms) for s in sizing)
    report = _served(bundle, AS_PLANNED)  # the handlers behind emulate's LambdaHost
    assert report.served_by == "lambda-handler" and report.chain == "invoke"
    _covers(bundle, report)
    # started cold, each handler's INIT comes with its first invocation, as on Lambda; the
    # entry warms the other up as its own begins (prewarm), or not
    for prewarm in (True, False):
        cold = _served(bundle, AS_PLANNED, requests=2, start_cold=True, prewarm=prewarm)
        assert cold.cold is not None and cold.cold["first_request_ms"] > 0
        first, second = cold.served
        assert all(s.init_ms > 0 for s in first.invocations), first
        assert all(s.init_ms == 0 for s in second.invocations), second


@pytest.mark.parametrize("transport", ["shm", "http"])
def test_a_run_report_names_the_process_it_measured(skipnet_bundle, transport):
    report = _served(skipnet_bundle, transport)
    assert report.to_dict()["served_by"] == {"shm": "worker", "http": "server"}[transport]
