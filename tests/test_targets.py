"""A target is a package: a made-up one goes the whole way without touching another module.

``acme`` (tests/acme_target/) is a package with the modules every target has (`mopar.target`):
its facts given in code, one chain mode, an emitter, an entry point that runs its own emulation
of its platform around the function server, and an image recipe. Registered by name here, it is
planned for, emitted, billed, simulated (``mopar simulate``), given images, and run (``mopar
run``) through the registry alone. The module set is the one docs/architecture.md's "Where to
touch" lists for a target platform, and the one each built-in target has.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import mopar
from mopar.bill import bill_plan, invocation_usd
from mopar.cli import cli
from mopar.config import PROFILES_DIR
from mopar.container.build import default_kind, image_kinds, plan_images
from mopar.facts import load_platform, target_named, target_names
from mopar.runner.bundle import read_manifest
from mopar.runtime.chains import MODES, SERVER
from mopar.target import (
    BUILT_IN,
    PackageTarget,
    Target,
    deploy_targets,
    register_target,
    registered,
    target_or_default,
    unregister_target,
)
from tests import models

ROOT = Path(__file__).resolve().parent.parent
ACME_DIR = Path(__file__).resolve().parent / "acme_target"


def _modules(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*.py")}


@pytest.fixture
def acme() -> Target:
    target = register_target("tests.acme_target")
    yield target
    unregister_target(target.name)


# --- the protocol: every target the same modules ----------------------------------------------


def test_every_target_package_has_the_same_modules_and_the_doc_lists_them():
    built_in = [ROOT / "mopar" / "targets" / p.rsplit(".", 1)[-1] for p in BUILT_IN]
    # optional: facts.py (the built-in targets' facts are their platforms.json entries) and
    # client.py (a platform API of its own: Lambda's Invoke API)
    optional = {"facts.py", "client.py"}
    assert [_modules(p) - optional for p in built_in] == [_modules(ACME_DIR) - optional] * len(
        built_in
    )
    doc = (ROOT / "docs" / "architecture.md").read_text()
    where = doc[doc.index("- **A target platform**") :]
    where = where[: where.index("\n## ")]
    listed = set(re.findall(r"`([a-z_]+\.py)`", where))
    assert listed == _modules(ACME_DIR) | optional, "docs/architecture.md lists other files"


def test_the_built_in_targets_answer_for_themselves():
    openfaas, lam = target_or_default("openfaas"), target_or_default("lambda")
    assert [t.name for t in registered()] == ["openfaas", "lambda"] == list(target_names())
    assert target_or_default(None) is openfaas and target_or_default("tinycloud") is openfaas
    http, event = MODES["http"], MODES["event"]
    assert openfaas.entry(http, deployed=True).module == "mopar.runtime.server"
    assert lam.entry(event, deployed=False).module == "mopar.targets.aws_lambda.emulate"
    assert lam.entry(event, deployed=False).events
    # where no handler is needed, the function server plays a Lambda mode's counterpart
    played = lam.entry(MODES["invoke"], deployed=False)
    assert played.door == SERVER and played.mode.name == "http" and not played.events
    assert image_kinds() == ("openfaas", "lambda")
    assert openfaas.image().dockerfile == "template/mopar-onnx/Dockerfile"
    assert lam.image().dockerfile == "Dockerfile.lambda" and lam.image().tag_suffix == "-lambda"
    assert default_kind("lambda") == "lambda" and default_kind("tinycloud") == "openfaas"


def test_a_target_is_registered_by_its_package_once(acme):
    assert isinstance(acme, PackageTarget) and acme.name == "acme"
    assert "acme" in target_names() and acme in deploy_targets()
    with pytest.raises(ValueError, match="'acme' is already registered"):
        register_target("tests.acme_target")


# --- the made-up target, end to end -----------------------------------------------------------


@pytest.fixture
def acme_bundle(acme, tmp_path) -> Path:
    model, x = models.mlp(), torch.randn(1, 16, generator=torch.Generator().manual_seed(3))
    bundle = mopar.compile(
        model, (x,), out=tmp_path / "b", target="acme", slices=2, strategy="uniform"
    )
    return bundle.path


def test_a_made_up_target_is_planned_and_billed_at_its_own_prices(acme):
    plan = mopar.partition(models.mlp(), (torch.randn(1, 16),), target="acme", slices=2)
    assert plan.target == "acme" and len(plan.functions) == 2
    assert all(f.memory_mb % 64 == 0 and f.memory_mb >= 128 for f in plan.functions)
    platform = load_platform(PROFILES_DIR, "acme")
    assert platform is not None and [c.name for c in platform.chains] == ["http"]
    assert target_named("acme").chain_modes() == (MODES["http"],)
    bill = bill_plan(plan, platform)
    assert bill.chain in ("", "http") and bill.usd > 0
    assert bill.fees_usd == pytest.approx(2 * 1e-7)  # acme's fee, once per function
    from mopar.bill import Invocation

    one = invocation_usd(platform, "http", Invocation(function="s0", memory_mb=1024, own_ms=1))
    assert one == pytest.approx(1.0 * 0.010 * 1e-5 + 1e-7)  # billed in acme's 10 ms steps


def test_a_made_up_target_emits_its_files_and_gets_its_images(acme_bundle):
    plan = json.loads((acme_bundle / "plan.json").read_text())["plan"]
    emitted = json.loads((acme_bundle / "acme.json").read_text())
    assert emitted == {
        "target": "acme",
        "functions": {f["name"]: f["memory_mb"] for f in plan["functions"]},
    }
    # acme's files alone: a bundle holds the files of the target it was planned for
    assert not (acme_bundle / "stack.yml").exists() and not (acme_bundle / "template.yaml").exists()
    manifest = read_manifest(acme_bundle)
    assert default_kind("acme") == "acme" and "acme" in image_kinds()
    builds = plan_images(manifest, kinds=("acme",), base_image="base:1", base_id="sha256:1")
    assert [b.function for b in builds] == ["s0", "s1"]
    for b in builds:
        assert b.kind == "acme" and re.search(r"-acme:[0-9a-f]{12}$", b.tag)
        assert b.dockerfile == "Dockerfile.acme" and "function/model.onnx" in b.files
        assert b.build_args == {"BASE_IMAGE": "base:1"}


def test_a_made_up_target_is_simulated_on_its_platform(acme_bundle):
    result = CliRunner().invoke(
        cli, ["simulate", str(acme_bundle), "--rate", "5", "--duration", "20", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["target"] == "acme" and data["cost_per_1m_usd"] > 0
    assert [f["name"] for f in data["functions"]] == ["s0", "s1"]


def test_mopar_run_serves_a_made_up_target_through_its_own_entry(
    acme_bundle, tmp_path, monkeypatch
):
    log = tmp_path / "acme-log"
    log.mkdir()
    monkeypatch.setenv("ACME_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # its entry is tests.acme_target.emulate
    result = CliRunner().invoke(
        cli,
        ["run", str(acme_bundle), "--transport", "http", "--requests", "3", "--check", "--json"],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{") :])
    assert report["errors"] == 0 and report["requests"] == 3
    # each function was started by acme's emulation, in acme's mode
    assert {p.name: p.read_text() for p in log.iterdir()} == {"s0": "http", "s1": "http"}
