"""Compile measures without a local redis-server (issue 51, point 5): the cuts a plan hands
over through Redis go inline while compile measures, the Redis hops' cost from the profiles is
added, and the plan says so; `mopar run` still needs the real Redis and says how to get it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mopar.config import RunConfig
from mopar.runner.bundle import read_manifest, read_reference
from mopar.runner.chain import AS_PLANNED
from mopar.runner.local import run_bundles
from tests.conftest import SKIPNET_INPUT, mopar, needs_redis

NO_REDIS = {"PATH": str(Path(sys.executable).parent)}  # this venv's tools, no redis-server


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> Path:
    """SkipNet for Lambda in 2 functions handing over through Redis, compiled with no
    redis-server on PATH."""
    out = tmp_path_factory.mktemp("stand-in") / "bundle"
    args = ["compile", "tests.models:skipnet", "--input", SKIPNET_INPUT, "--target", "lambda"]
    proc = mopar(
        *args, "--slices", "2", "--transport", "redis", "--out", out, env=NO_REDIS, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    return out


def test_compile_without_redis_measures_the_redis_cuts_inline_and_says_so(stored):
    plan = json.loads((stored / "plan.json").read_text())["plan"]
    assert [e["transport"] for e in plan["edges"] if e["src"] == "s0"] == ["redis"]  # as planned
    notes = " ".join(n["text"] if isinstance(n, dict) else n for n in plan["notes"])
    assert "measured without Redis (redis-server is not on PATH" in notes
    assert "Redis hops'" in notes and "ms the profiles predict" in notes
    spec = json.loads((stored / "functions" / "s0" / "function.json").read_text())
    assert spec["transport"] == "redis"  # deployed, it hands over through Redis


def test_a_stand_in_run_adds_the_redis_hops_to_every_request(stored):
    from mopar.config import PROFILES_DIR
    from mopar.facts import load_platform
    from mopar.pipeline.serving import redis_hops_ms
    from mopar.plan import Plan

    lam = load_platform(PROFILES_DIR, "lambda")
    plan = Plan.from_dict(json.loads((stored / "plan.json").read_text())["plan"])
    hop = next(link for link in lam.links if link.name == "redis")
    nbytes = sum(e.bytes for e in plan.edges if e.transport == "redis")
    assert redis_hops_ms(plan, lam) == pytest.approx(hop.transfer_ms(nbytes)) and nbytes > 0
    inputs, expected = read_reference(stored / "reference.npz")
    for in_turn in (False, True):  # the chain at once, and one function at a time
        config = RunConfig(requests=2, redis_stand_in=True, in_turn=in_turn)
        (report,) = run_bundles(
            [read_manifest(stored)], inputs, config=config, expected=expected, transport=AS_PLANNED
        )
        assert report.errors == 0 and report.comparison.passed, report.error_messages


@needs_redis
def test_the_bundle_runs_through_a_real_redis_and_mopar_run_without_one_says_how(stored):
    done = mopar("run", stored, "--check", "--transport", "redis", "--requests", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    missing = mopar("run", stored, "--transport", "redis", "--requests", "1", env=NO_REDIS)
    assert missing.returncode == 1
    assert "redis-server is not on PATH; install it (apt-get install redis-server)" in (
        missing.stdout + missing.stderr
    )
