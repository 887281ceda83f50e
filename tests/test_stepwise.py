"""Serving a bundle one function at a time (`mopar.runner.stepwise`), as compile measures a large
model: each function alone in the process it deploys as, fed the frames the one before handed
on by its plan's transport, its answers passed back as in the chain; the outputs are the
chain's, and no two functions' processes are alive at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from mopar.config import CompileConfig, RunConfig
from mopar.runner import chain as chain_module
from mopar.runner.bundle import read_manifest, read_reference
from mopar.runner.chain import AS_PLANNED
from mopar.runner.local import run_bundles
from mopar.runner.stepwise import serves_in_turn
from tests.conftest import needs_redis


def _served(bundle: Path, *, in_turn: bool, requests: int = 4):
    inputs, expected = read_reference(bundle / "reference.npz")
    (report,) = run_bundles(
        [read_manifest(bundle)],
        inputs,
        config=RunConfig(requests=requests, in_turn=in_turn),
        expected=expected,
        transport=AS_PLANNED,
        settle=2,
    )
    return report


@pytest.fixture
def alone(monkeypatch):
    """Each function server's process, as started; fails a start while another is alive."""
    started: list = []
    start = chain_module.ChainSession.start

    def checked(self, *, wait: bool = True) -> None:
        alive = [s.name for s in started if s.proc.poll() is None]
        assert not alive, f"{alive} still running as {self.manifest.slices[0].name} starts"
        start(self, wait=wait)
        started.extend(self.servers)

    monkeypatch.setattr(chain_module.ChainSession, "start", checked)
    return started


def _build(analysis, folder: Path, **config) -> Path:
    from mopar import api

    config = CompileConfig(slices=2, strategy="uniform", check_latency=False, **config)
    api.build_bundle(analysis, folder, config=config, force=True, progress=None)
    return folder


def test_openfaas_functions_served_in_turn_give_the_chain_outputs(skipnet_bundle, alone):
    report = _served(skipnet_bundle, in_turn=True)
    assert report.errors == 0 and report.comparison.passed
    assert [s.name for s in alone] == [s.name for s in report.slices]
    assert len(alone) == 3 and report.served_by == "server"
    assert all(s.calls == 4 and s.peak_rss_mb > 0 and s.p50_ms > 0 for s in report.slices)
    # a request's latency is its functions' times, each at least that function's own
    assert len(report.served) == 4
    for served in report.served:
        assert [span.function for span in served.invocations] == [s.name for s in alone]
        assert served.latency_ms >= sum(span.own_ms for span in served.invocations)


def test_a_function_in_turn_peaks_as_it_does_in_the_chain(skipnet_bundle):
    whole = {s.name: s.peak_rss_mb for s in _served(skipnet_bundle, in_turn=False).slices}
    alone = {s.name: s.peak_rss_mb for s in _served(skipnet_bundle, in_turn=True).slices}
    for name, peak in whole.items():  # the same process and requests: within a few MB
        assert abs(alone[name] - peak) <= 0.1 * peak, (name, alone[name], peak)


@needs_redis
def test_redis_handoffs_are_taken_out_and_handed_on_again(skipnet_analysis, tmp_path, alone):
    bundle = _build(skipnet_analysis, tmp_path / "b", transport="redis")
    alone.clear()  # compile's own measuring
    report = _served(bundle, in_turn=True)
    assert report.errors == 0 and report.comparison.passed, report.error_messages
    assert len(alone) == 2


@pytest.mark.parametrize("chain", ["invoke", pytest.param("stepfunctions", marks=needs_redis)])
def test_lambda_handlers_served_in_turn(skipnet_analysis, tmp_path, alone, chain):
    bundle = _build(skipnet_analysis, tmp_path / "b", target="lambda", chain=chain)
    alone.clear()  # compile's own measuring
    report = _served(bundle, in_turn=True)
    assert report.errors == 0 and report.comparison.passed, report.error_messages
    assert report.served_by == "lambda-handler" and report.chain == chain
    assert len(alone) == 2 and all(s.calls == 4 for s in report.slices)


BROKEN = """
from mopar.runtime.handler import SliceHandler as _Real


class SliceHandler(_Real):
    def handle(self, inputs):
        raise RuntimeError("broken on purpose")
"""


def test_a_failing_function_names_itself_and_ends_its_requests(
    skipnet_bundle, tmp_path, monkeypatch
):
    from tests.conftest import faulty

    for name, value in faulty(tmp_path / "faults", {"s1": BROKEN}).items():
        monkeypatch.setenv(name, value)
    report = _served(skipnet_bundle, in_turn=True)
    assert report.errors == 4 and not report.served
    assert any("slice s1" in m for m in report.error_messages), report.error_messages
    assert next(s for s in report.slices if s.name == "s2").calls == 0


def test_only_synchronous_chains_without_called_functions_are_served_in_turn(
    skipnet_bundle, moe_bundle, skipnet_analysis, tmp_path
):
    assert serves_in_turn(read_manifest(skipnet_bundle))
    assert not serves_in_turn(read_manifest(moe_bundle))  # its dispatches call experts
    bundle = _build(skipnet_analysis, tmp_path / "b", chain="callback")
    assert not serves_in_turn(read_manifest(bundle))


def test_compile_measures_a_large_model_one_function_at_a_time(
    skipnet_analysis, tmp_path, alone, monkeypatch
):
    from mopar.bundle.document import read_document
    from mopar.pipeline import serving

    monkeypatch.setattr(serving, "_large", lambda plan: True)  # as from 256 MB of weights
    bundle = _build(skipnet_analysis, tmp_path / "b", target="lambda")
    sizing = read_document(bundle).sizing
    assert [s.name for s in alone] == [s.function for s in sizing]  # each started alone
    assert all(s.measured_in == "lambda-handler" and s.peak_rss_mb > 0 for s in sizing)
