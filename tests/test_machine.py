"""The machine factor (`mopar.profile.machine`): derived from injected probe timings, cached per
machine, given by the environment, and carried into predictions and plans. No test here times
anything: every probe is a stand-in that answers what the test chose."""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from mopar import api
from mopar._files import write_text_atomic
from mopar.config import PROFILES_DIR, CompileConfig
from mopar.facts import load_facts
from mopar.planner import priced
from mopar.profile import machine
from mopar.profile.machine import (
    ENV_FACTOR,
    MachineFactor,
    MachineFactorError,
    OpTiming,
    derive,
    machine_factor,
    machine_key,
)
from tests.conftest import plan_of

NO_ENV: dict[str, str] = {}  # an environment without MOPAR_MACHINE_FACTOR: the probe runs


@pytest.fixture(scope="module")
def predictors():
    from mopar.profile.features import FEATURE_NAMES
    from mopar.profile.store import load_predictors

    return load_predictors(PROFILES_DIR, feature_names=FEATURE_NAMES)


@pytest.fixture(autouse=True)
def _loaded_once(predictors, monkeypatch):
    """Facts loaded here take the module's predictors instead of reading the boosters again."""
    monkeypatch.setattr("mopar.profile.store.load_predictors", lambda *a, **k: predictors)


def _op(ratio: float, name: str = "op") -> OpTiming:
    return OpTiming(name=name, family="gemm", predicted_ms=2.0, measured_ms=2.0 * ratio)


class Probe:
    """A stand-in probe: every operator measures ``ratio`` x its prediction; counts its calls."""

    def __init__(self, predictors, ratio: float) -> None:
        self.predictors, self.ratio, self.calls = predictors, ratio, 0

    def __call__(self, threads: int) -> dict[str, float]:
        self.calls += 1
        ones = dict.fromkeys(machine.probe_samples(), 1.0)
        return {t.name: t.predicted_ms * self.ratio for t in machine.timings(self.predictors, ones)}


def _factor(predictors, probe, cache: Path, load: float = 0.5) -> MachineFactor:
    return machine_factor(
        predictors, probe=probe, cache=cache, environ=NO_ENV, loadavg=lambda: load
    )


# --- deriving the factor ----------------------------------------------------------------------


def test_the_factor_is_the_geometric_mean_of_measured_over_predicted():
    assert derive([_op(2.0), _op(0.5)]) == pytest.approx((1.0, 2.0))
    factor, spread = derive([_op(3.0, "a"), _op(3.0, "b"), _op(3.0, "c")])
    assert factor == pytest.approx(3.0) and spread == pytest.approx(1.0)


@pytest.mark.parametrize("timings", [[], [_op(0.0)], [replace(_op(1.0), predicted_ms=math.inf)]])
def test_no_timings_or_a_nonpositive_one_derive_no_factor(timings):
    with pytest.raises(ValueError):
        derive(timings)


def test_the_probe_covers_the_families_slices_spend_their_time_in(predictors):
    ones = dict.fromkeys(machine.probe_samples(), 1.0)
    families = {t.family for t in machine.timings(predictors, ones)}
    assert {"gemm", "conv", "attention", "batched_matmul", "layer_norm", "elementwise"} <= families
    assert "embedding" in families


def test_a_probe_that_runs_twice_as_long_as_predicted_gives_a_factor_of_two(predictors, tmp_path):
    found = _factor(predictors, Probe(predictors, 2.0), tmp_path)
    assert found.source == "probe" and found.factor == pytest.approx(2.0)
    assert len(found.ops) == len(machine.PROBE) and found.load == 0.5


# --- the cache ----------------------------------------------------------------------------------


def test_a_measured_factor_is_cached_and_read_back_without_probing(predictors, tmp_path):
    probe = Probe(predictors, 2.0)
    _factor(predictors, probe, tmp_path)
    again = _factor(predictors, probe, tmp_path)
    assert probe.calls == 1
    assert again.source == "cache" and again.factor == pytest.approx(2.0)
    (entry,) = tmp_path.glob("machine-*.json")
    assert json.loads(entry.read_text())["key"]["cpu"] == machine_key(predictors).cpu


def test_a_corrupt_cache_entry_is_measured_again_and_replaced(predictors, tmp_path):
    probe = Probe(predictors, 2.0)
    _factor(predictors, probe, tmp_path)
    (entry,) = tmp_path.glob("machine-*.json")
    for garbage in (
        "{not json",
        json.dumps({"key": {}, "factor": 1}),
        '{"factor": {"factor": -1}}',
    ):
        entry.write_text(garbage)
        assert _factor(predictors, probe, tmp_path).source == "probe"
    assert probe.calls == 4
    assert _factor(predictors, probe, tmp_path).source == "cache"  # replaced by a good one


def test_a_factor_cached_under_another_load_is_measured_again(predictors, tmp_path):
    probe = Probe(predictors, 2.0)
    cores = machine_key(predictors).cores
    _factor(predictors, probe, tmp_path, load=0.0)
    assert _factor(predictors, probe, tmp_path, load=0.2 * cores).source == "cache"
    assert _factor(predictors, probe, tmp_path, load=1.0 * cores).source == "probe"


def test_the_cache_key_covers_machine_runtime_and_predictors(predictors):
    key = machine_key(predictors)
    others = [
        replace(key, cpu="another CPU"),
        replace(key, cores=key.cores + 1),
        replace(key, quota=0.5),
        replace(key, onnxruntime="0.0.1"),
        replace(key, predictors="0" * 12),
        replace(key, threads=key.threads + 1),
        replace(key, probe=key.probe + 1),
    ]
    assert len({k.digest() for k in [key, *others]}) == len(others) + 1
    retrained = replace(predictors, meta={**predictors.meta, "samples": -1})
    assert machine_key(retrained).predictors != key.predictors


def test_the_cache_lives_under_xdg_cache_home(tmp_path):
    assert machine.cache_folder({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "mopar"
    assert machine.cache_folder({}) == Path.home() / ".cache" / "mopar"


def test_an_atomic_write_leaves_the_old_file_whole_when_it_fails(tmp_path, monkeypatch):
    path = tmp_path / "entry.json"
    write_text_atomic(path, "old\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()  # not mkstemp's 0600

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        write_text_atomic(path, "new\n")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["entry.json"]  # no temporary file left


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --- a given factor -----------------------------------------------------------------------------


def test_a_factor_in_the_environment_is_taken_without_probing(predictors, tmp_path):
    probe = Probe(predictors, 2.0)
    found = machine_factor(predictors, probe=probe, cache=tmp_path, environ={ENV_FACTOR: "0.5"})
    assert (found.factor, found.source, probe.calls) == (0.5, "given", 0)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("value", ["fast", "0", "-1", "nan"])
def test_a_factor_in_the_environment_that_is_no_positive_number_is_refused(predictors, value):
    with pytest.raises(MachineFactorError, match=f"{ENV_FACTOR}='{value}' is not a positive"):
        machine_factor(predictors, environ={ENV_FACTOR: value})


# --- the factor reaches predictions and plans -----------------------------------------------------


def test_the_factor_multiplies_every_predicted_time(predictors):
    x = np.stack(
        [machine.feature_vector(machine.feature_row(s)) for s in machine.probe_samples().values()]
    )
    fast, found = machine.calibrated(
        predictors, MachineFactor(machine="m", trained_on="t", factor=0.25)
    )
    assert found.factor == 0.25
    np.testing.assert_allclose(fast.predict_time_ms(x), predictors.predict_time_ms(x) * 0.25)
    np.testing.assert_array_equal(fast.predict_memory_mb(x), predictors.predict_memory_mb(x))


def test_load_facts_calibrates_only_when_asked(monkeypatch):
    monkeypatch.setenv(ENV_FACTOR, "3")
    on = load_facts(PROFILES_DIR, calibrate=True)
    off = load_facts(PROFILES_DIR)
    assert (on.predictors.time_factor, on.machine.source) == (3.0, "given")
    assert (off.predictors.time_factor, off.machine.source) == (1.0, "off")
    assert "calibration off" in off.machine.note()


def test_the_plan_says_which_machine_it_was_priced_for():
    found = MachineFactor(
        machine="CPU X, 2 usable cores",
        trained_on="CPU Y, 2 cores",
        factor=0.5,
        source="probe",
        spread=1.3,
        load=1.0,
        ops=(_op(0.5),),
    )
    facts = replace(load_facts(PROFILES_DIR), machine=found)
    plan = priced(plan_of([["a"], ["b"]]), facts)
    assert plan.priced_for["time_factor"] == 0.5 and plan.priced_for["source"] == "probe"
    assert str(plan.notes[-1]).startswith("priced for this machine (CPU X, 2 usable cores): ")
    assert "x0.5" in str(plan.notes[-1]) and "CPU Y" in str(plan.notes[-1])
    assert priced(plan, facts).notes == plan.notes  # said once however often it is priced
    assert type(plan).from_dict(plan.to_dict()).priced_for == plan.priced_for


def test_a_plan_priced_on_a_slower_machine_predicts_it_slower(skipnet_analysis, monkeypatch):
    latency = {}
    for factor in ("1", "4"):
        monkeypatch.setenv(ENV_FACTOR, factor)
        config = CompileConfig(slices=1)
        facts = api.facts_for(config)
        plan = api.plan_from(
            skipnet_analysis,
            config,
            api.predict(skipnet_analysis.layers, config, facts=facts),
            facts=facts,
        )
        assert plan.priced_for["time_factor"] == float(factor)
        latency[factor] = plan.latency_ms
    assert latency["4"] > 2 * latency["1"]


def test_no_calibrate_reaches_the_facts_as_calibration_off():
    from mopar.cli.common import compile_config

    config = compile_config({"calibrate": False})
    assert CompileConfig().calibrate and not config.calibrate
    assert api.facts_for(config).machine.source == "off"


def test_each_family_factor_is_recorded_and_one_factor_applied(predictors, tmp_path):
    ops = [
        replace(_op(4.0, "conv"), family="conv"),
        replace(_op(2.0, "a"), family="gemm"),
        replace(_op(8.0, "b"), family="gemm"),
    ]
    families = machine.by_family(ops)
    assert families == pytest.approx({"conv": 4.0, "gemm": 4.0})
    found = _factor(predictors, Probe(predictors, 2.0), tmp_path)
    assert set(found.families) == {t.family for t in found.ops}
    assert found.summary()["family_factors"] == pytest.approx(dict.fromkeys(found.families, 2.0))


def test_the_prediction_bench_rates_cost_and_latency_against_the_goals():
    from benchmarks.predict import markdown, row

    plan = {"functions": 3, "cost_per_1m_usd": 1.0, "latency_ms": 100.0, "priced_for": {}}
    r = {
        "model": "m",
        "load_before": 1.0,
        "compile_s": 9.0,
        "first": plan,
        "written": {**plan, "functions": 1, "cost_per_1m_usd": 1.3},
        "first_measured_ms": 110.0,
        "first_measured_functions": 3,
    }
    got = row(r)
    assert (got["cost_ratio"], got["cost_ok"]) == (1.3, False)
    assert (got["latency_ratio"], got["latency_ok"]) == (1.1, True)
    # a measurement of another plan than the first is no measurement of the first
    assert "latency_ratio" not in row({**r, "first_measured_functions": 1})
    assert (
        markdown([got, row({"model": "big", "error": "compile: out of memory"})]).count("\n") == 4
    )
