"""Transports and targets are types, each registered in one place.

A made-up transport (``spool``: frames as files in a folder) and a made-up target (``acme``:
one package, tests/acme_target/, with prices given in code and an emitter of its own) are
registered here, in the test only; a model is then planned, emitted and run through them
without touching any other module (tests/test_targets.py takes the target further: bill,
simulate, images, ``mopar run``). This keeps docs/architecture.md's "Where to touch" true.
"""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import mopar
from mopar.config import PROFILES_DIR, RunConfig, load_profile
from mopar.errors import PlanError
from mopar.facts import (
    Link,
    Target,
    deploy_targets,
    load_facts,
    register_target,
    target_named,
    target_names,
    unregister_target,
)
from mopar.runner.bundle import read_manifest, read_reference
from mopar.runner.chain import ChainSession
from mopar.runner.local import run_bundles
from mopar.runtime.server import app_from_env, create_function_server
from mopar.runtime.transports import (
    Hop,
    Transport,
    Where,
    handing_on,
    inline,
    names,
    register,
    transport_named,
    unregister,
)
from mopar.runtime.transports.http import Body, body_parts
from tests import models
from tests.acme_target.facts import ENTRY

# --- the made-up transport and target -------------------------------------------------------------


class SpoolStore:
    """Frames as files in a folder: put by the sender, taken (read and removed) by the receiver."""

    scheme = "spool"

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, key: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{32}", key):
            raise ValueError(f"spool reference {key!r} is not a frame name")
        return self.folder / key

    def put(self, data: Body) -> str:
        key = uuid.uuid4().hex
        self._path(key).write_bytes(b"".join(body_parts(data)))
        return key

    def take(self, key: str) -> bytes:
        path = self._path(key)
        data = path.read_bytes()
        path.unlink()
        return data

    def discard(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


class Spool(Transport):
    """The made-up transport: every function reaches the spool folder."""

    name = "spool"

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def sender(self, where: Where) -> SpoolStore:
        return SpoolStore(self.folder)

    def receiver(self, where: Where) -> SpoolStore:
        return SpoolStore(self.folder)


ACME = "tests.acme_target"
"""A target mopar has no code or profile for, as one package (tests/acme_target/): 64 MB steps
from 128 MB, one vCPU, an emitter of its own."""


@pytest.fixture
def spool(tmp_path) -> Spool:
    folder = tmp_path / "spool"
    folder.mkdir()
    transport = register(Spool(folder))
    yield transport
    unregister(transport.name)


@pytest.fixture
def acme() -> Target:
    target = register_target(ACME)
    yield target
    unregister_target(target.name)


@pytest.fixture
def profiles(tmp_path) -> Path:
    """A profiles folder whose transports.json has measured the spool too."""
    folder = tmp_path / "profiles"
    folder.mkdir()
    measured = copy.deepcopy(load_profile(PROFILES_DIR, "transports"))  # the loader caches
    measured["transports"]["spool"] = {"measured": True, "latency_ms": 0.5, "mb_per_s": 500.0}
    (folder / "transports.json").write_text(json.dumps(measured))
    return folder


# --- the registries -------------------------------------------------------------------------------


def test_the_built_in_transports_say_what_they_are():
    assert names() == ("shm", "http", "redis")
    shm, http, redis = (transport_named(n) for n in names())
    assert shm.colocated and not shm.inline and not shm.stores
    assert http.inline and not http.colocated and inline() is http
    assert redis.stores and redis.needs_redis and not redis.inline
    assert handing_on("response") is http and handing_on("") is http


def test_a_transport_allows_a_target_by_what_the_target_offers():
    openfaas = load_facts(target="openfaas", colocate=True).platform
    stock = load_facts(target="openfaas").platform  # Community Edition: nothing co-located
    lam = load_facts(target="lambda").platform
    assert openfaas.colocates and not stock.colocates and not lam.colocates
    assert stock.colocation and not lam.colocation  # what asking for it needs, in words
    assert transport_named("shm").allows(openfaas) and not transport_named("shm").allows(lam)
    assert not transport_named("shm").allows(stock)
    assert all(transport_named(n).allows(lam) for n in ("http", "redis"))
    assert [x.name for x in openfaas.links] == ["shm", "http", "redis"]
    assert [x.name for x in stock.links] == [x.name for x in lam.links] == ["http", "redis"]


def test_an_unknown_transport_or_target_names_the_registered_ones():
    with pytest.raises(ValueError, match=r"transport 'pigeon' is not one of \['shm', 'http'"):
        transport_named("pigeon")
    with pytest.raises(ValueError, match="transport 'pigeon' is not one of"):
        Hop("http://127.0.0.1:1/", "pigeon")
    with pytest.raises(PlanError, match="unknown --target 'acme'; choose one of openfaas, lambda"):
        target_named("acme")


def test_a_name_is_registered_once(spool, acme):
    with pytest.raises(ValueError, match="'spool' is already registered"):
        register(Spool(spool.folder))
    with pytest.raises(ValueError, match="'acme' is already registered"):
        register_target(ACME)


def test_the_cli_and_the_api_take_their_choices_from_the_registries():
    from mopar.cli.compile import compile_cmd
    from mopar.cli.run import run_cmd

    def choices(command, name):
        return next(p for p in command.params if p.name == name).type.choices

    assert tuple(choices(compile_cmd, "target")) == tuple(target_names())
    assert tuple(choices(compile_cmd, "transport")) == names()
    assert tuple(choices(run_cmd, "transport")) == names()


def test_a_pricing_only_target_added_to_platforms_json_is_planned_for(tmp_path):
    folder = tmp_path / "profiles"
    folder.mkdir()
    listed = copy.deepcopy(load_profile(PROFILES_DIR, "platforms"))  # the loader caches
    listed["tinycloud"] = {**ENTRY, "colocates": True}
    (folder / "platforms.json").write_text(json.dumps(listed))
    assert target_names(folder) == ("openfaas", "lambda", "tinycloud")
    assert not target_named("tinycloud", folder).deploys  # pricing only: no files
    platform = load_facts(folder, target="tinycloud").platform
    assert platform.target == "tinycloud" and platform.memory_options(100) == (128,)
    assert [x.name for x in platform.links] == ["shm", "http", "redis"]
    plan = mopar.partition(
        models.mlp(), (torch.randn(1, 16),), target="tinycloud", profiles_dir=folder, slices=2
    )
    assert plan.target == "tinycloud" and len(plan.functions) == 2


# --- end to end: plan, emit and run through the made-up ones --------------------------------------


class InProcessChain(ChainSession):
    """`mopar run`'s http chain, with each function server a thread of this process (where the
    made-up transport is registered) rather than a process of its own."""

    def _launch(self, s, env: dict[str, str]) -> _Server:
        env = {**env, "MOPAR_FUNCTION_DIR": str(self.manifest.function_dir(s))}
        return _Server(env, self._bound.pop(s.name))


class _Server:
    """What `ChainSession` reads of a server process, for a server thread of this one."""

    def __init__(self, env: dict[str, str], sock: socket.socket) -> None:
        self.proc = SimpleNamespace(pid=os.getpid(), poll=lambda: None)
        self.load_ms = 0.0
        app = app_from_env(env)
        self.server = create_function_server(  # on the socket the chain bound for it
            app, host="127.0.0.1", port=0, threads=4, max_body=app.max_body, sock=sock
        )
        self.url = f"http://127.0.0.1:{self.server.effective_port}/"
        self.stopping = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            self.server.run()
        except OSError:  # stop() closed the sockets under the loop's select()
            if not self.stopping:
                raise

    def wait_ready(self) -> None:  # ready once made
        pass

    def terminate(self) -> None:
        self.stop()

    def stop(self) -> None:
        self.stopping = True
        self.server.close()


def test_a_made_up_transport_and_target_plan_emit_and_run_end_to_end(
    spool, acme, profiles, tmp_path
):
    assert acme in deploy_targets()
    model, x = models.mlp(), torch.randn(1, 16, generator=torch.Generator().manual_seed(5))
    facts = load_facts(profiles, target="acme", transport="spool")
    assert facts.platform.links == (Link(name="spool", latency_ms=0.5, mb_per_s=500.0),)

    bundle = mopar.compile(
        model,
        (x,),
        out=tmp_path / "b",
        target="acme",
        transport="spool",
        profiles_dir=profiles,
        slices=2,
        strategy="uniform",
    )
    plan = json.loads((bundle.path / "plan.json").read_text())["plan"]
    assert plan["target"] == "acme"
    cut = [e for e in plan["edges"] if e["src"] == "s0"]
    assert [e["transport"] for e in cut] == ["spool"]
    emitted = json.loads((bundle.path / "acme.json").read_text())
    assert emitted == {
        "target": "acme",
        "functions": {f["name"]: f["memory_mb"] for f in plan["functions"]},
    }
    assert all(m % 64 == 0 for m in emitted["functions"].values())
    # acme's files alone: a bundle holds the files of the target it was planned for
    assert not (bundle.path / "stack.yml").exists() and not (bundle.path / "template.yaml").exists()

    inputs, expected = read_reference(bundle.path / "reference.npz")
    config = RunConfig(requests=3)
    (report,) = run_bundles(
        [read_manifest(bundle.path)],
        inputs,
        config=config,
        expected=expected,
        session_for=lambda m, i, redis_url: InProcessChain(m, config, transport="spool"),
    )
    assert report.errors == 0 and report.comparison.passed
    assert not list(spool.folder.iterdir())  # every frame was taken once


def test_without_the_registration_the_made_up_ones_are_unknown():
    assert "spool" not in names() and "acme" not in target_names()
    assert all(t.name != "acme" for t in deploy_targets())
