"""What `mopar plan` prints, as a user reads it: within 80 columns when piped (COLUMNS where
set), bills a month at the stated traffic, and one table across several rates."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from click.testing import CliRunner

from mopar.bill import MONTH_S
from mopar.cli import cli
from tests.conftest import MOPAR, ROOT, SKIPNET_INPUT

PLAN = ("plan", "tests.models:skipnet", "--input", SKIPNET_INPUT, "--target", "lambda")


def _piped(*args: str, columns: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    if columns is not None:
        env["COLUMNS"] = columns
    return subprocess.run(
        [MOPAR, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )


@pytest.mark.parametrize("columns", [None, "100"])
def test_piped_output_fits_80_columns_or_columns_where_set(columns):
    done = _piped(*PLAN, columns=columns)
    assert done.returncode == 0, done.stderr
    width = int(columns or 80)
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= width
    if columns:  # the notes use the room they are given
        assert max(len(line) for line in lines) > 80
    words = done.stdout.split()
    assert "$/1M" in done.stdout and any(w.startswith("$") for w in words)
    month = [line for line in lines if line.startswith("bill a month")]
    assert month and "a month at 1 request/s" in " ".join(lines)


def test_one_table_across_rates_with_dollars_a_month_and_where_splitting_pays():
    done = _piped(*PLAN, "--rate", "0.1,10", "--json")
    assert done.returncode == 0, done.stderr
    across = json.loads(done.stdout)
    rows = across["rates"]
    assert [r["rate_rps"] for r in rows] == [0.1, 10.0]
    for r in rows:
        assert r["usd_per_month"] == pytest.approx(
            r["cost_per_1m_usd"] / 1e6 * r["rate_rps"] * MONTH_S
        )
        assert r["vs_unsplit"] == pytest.approx(r["usd_per_month"] / r["unsplit_usd_per_month"])
    pays = [r["rate_rps"] for r in rows if r["functions"] > 1 and r["vs_unsplit"] < 1]
    assert across["splitting_pays_from_rps"] == (pays[0] if pays else None)
    assert ("starts to pay" if pays else "unsplit is cheapest") in across["says"]
    # in process (the piped screen is the JSON run's): the table, and a bad rate
    text = CliRunner().invoke(cli, [*PLAN, "--rate", "10,0.1"])
    assert text.exit_code == 0, text.output
    assert "$/month" in text.stdout and "across rates" in text.stdout
    bad = CliRunner().invoke(cli, [*PLAN, "--rate", "1,x"])
    assert bad.exit_code != 0 and "'x' is not a rate above 0" in bad.output


def test_a_repriced_plan_states_its_new_bill_in_its_notes():
    """After compile resizes a function and prices the plan again, its notes give the bill
    the table gives, not the one planned."""
    from dataclasses import replace

    from mopar.config import PROFILES_DIR
    from mopar.facts import load_platform
    from mopar.plan.notes import BillIncludes, ChainMode, ModeBest
    from mopar.planner.cost import priced
    from tests.test_small_things import _plan

    platform = load_platform(PROFILES_DIR, "lambda")
    stale = replace(
        _plan(),
        chain="invoke",
        notes=(
            ChainMode(
                chain="invoke",
                best=(ModeBest(chain="invoke", cost_per_1m_usd=0.9896, within_bound=True),),
            ),
            BillIncludes(cost_per_1m_usd=0.9896, includes="the functions' own time 100%"),
        ),
    )
    plan = priced(stale, platform)
    assert plan.cost_per_1m_usd != 0.9896
    said = " ".join(map(str, plan.notes))
    assert "0.9896" not in said and f"${plan.cost_per_1m_usd:.4g}" in said
