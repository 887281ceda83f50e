"""``mopar plan --graph``: the plan graph as SVG, laid out so that boxes never overlap and every
edge is an arrow labelled with its bytes and transport."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from click.testing import CliRunner

from mopar.cli import cli
from mopar.plan import REQUEST, RESPONSE, Edge, Function, Plan
from mopar.plan.draw import graph_svg, write_graph_svg
from mopar.plan.draw import human_bytes as human

SVG = "{http://www.w3.org/2000/svg}"
MLP = ["tests.models:mlp", "--input", "x=1x16:float32"]


def _fn(name: str, **kw) -> Function:
    return Function(
        name=name,
        group=kw.pop("group", name),
        memory_mb=kw.pop("memory_mb", 256),
        time_ms=kw.pop("time_ms", 12.5),
        **kw,
    )


def _edge(src: str, dst: str, nbytes: int, transport: str = "shm", **kw) -> Edge:
    return Edge(
        src=src, dst=dst, tensors=(f"{src}_to_{dst}",), bytes=nbytes, transport=transport, **kw
    )


def chain_with_a_skip() -> Plan:
    """s0 -> s1 -> s2, and s0 -> s2 past s1 (a residual)."""
    return Plan(
        model="resnet-ish",
        strategy="mopar",
        target="openfaas",
        latency_ms=40.0,
        cost_per_1m_usd=1.25,
        functions=(
            _fn("s0", layers=("conv1", "relu1")),
            _fn("s1", layers=("conv2",)),
            _fn("s2", layers=("conv3", "fc")),
        ),
        edges=(
            _edge(REQUEST, "s0", 602112, "request"),
            _edge("s0", "s1", 802816),
            _edge("s1", "s2", 802816, "http"),
            _edge("s0", "s2", 401408, "redis"),
            _edge("s2", RESPONSE, 4000, "response"),
        ),
    )


def sharded() -> Plan:
    """s1 sharded in two sub-slices called by its join; s0 -> s2 skips it; s0 -> s1.p1 is
    taken a quarter of the time (assumed)."""
    shard = {"kind": "shard", "group": "s1", "parallel": 2, "memory_mb": 512}
    return Plan(
        model="cnn",
        strategy="mopar",
        target="lambda",
        latency_ms=81.5,
        cost_per_1m_usd=3.5,
        functions=(
            _fn("s0", layers=("conv1", "conv2")),
            _fn("s1.p0", **shard),
            _fn("s1.p1", **shard),
            _fn("s1", kind="join", group="s1", parallel=2, layers=("add",)),
            _fn("s2", layers=("pool", "fc")),
        ),
        edges=(
            _edge(REQUEST, "s0", 602112, "request"),
            _edge("s0", "s1.p0", 802816, "http"),
            _edge("s0", "s1.p1", 802816, "http", probability=0.25, probability_source="assumed"),
            _edge("s1.p0", "s1", 401408, "http"),
            _edge("s1.p1", "s1", 401408, "http"),
            _edge("s1", "s2", 802816, "http"),
            _edge("s0", "s2", 200704, "http"),
            _edge("s2", RESPONSE, 4000, "response"),
        ),
    )


def _parse(plan: Plan) -> ET.Element:
    return ET.fromstring(graph_svg(plan))


def _texts(root: ET.Element) -> list[str]:
    return [t.text or "" for t in root.iter(f"{SVG}text")]


def _boxes(root: ET.Element) -> list[tuple[float, float, float, float]]:
    return [
        tuple(float(r.get(k)) for k in ("x", "y", "width", "height"))
        for r in root.iter(f"{SVG}rect")
        if r.get("class") in ("node", "end")
    ]


def test_every_function_is_a_box_named_in_a_text():
    for plan in (chain_with_a_skip(), sharded()):
        root = _parse(plan)
        texts = _texts(root)
        for f in plan.functions:
            assert f.name in texts
        assert "request" in texts and "response" in texts
        assert len(_boxes(root)) == len(plan.functions) + 2


def test_one_arrow_per_edge_labelled_with_bytes_and_transport():
    for plan in (chain_with_a_skip(), sharded()):
        root = _parse(plan)
        arrows = [p for p in root.iter(f"{SVG}path") if p.get("class") == "arrow"]
        assert len(arrows) == len(plan.edges)
        assert all(p.get("marker-end") == "url(#arrowhead)" for p in arrows)
        labels = _texts(root)
        for e in plan.edges:
            assert any(t.startswith(f"{human(e.bytes)} · {e.transport}") for t in labels), e
    labels = _texts(_parse(chain_with_a_skip()))
    assert {"784.0 KB · shm", "784.0 KB · http", "392.0 KB · redis", "588.0 KB · request"} <= set(
        labels
    )


def test_an_edge_taken_with_a_probability_says_so_and_others_do_not():
    labels = " ".join(_texts(_parse(sharded())))
    assert "p = 25% (assumed)" in labels
    assert labels.count("p = ") == 1


def test_no_two_boxes_overlap():
    for plan in (chain_with_a_skip(), sharded()):
        boxes = _boxes(_parse(plan))
        for i, (x, y, w, h) in enumerate(boxes):
            for x2, y2, w2, h2 in boxes[i + 1 :]:
                assert x + w <= x2 or x2 + w2 <= x or y + h <= y2 or y2 + h2 <= y


def test_sub_slices_sit_side_by_side_between_producer_and_join():
    by_name = {}
    root = _parse(sharded())
    for g in root.iter(f"{SVG}g"):
        rect, texts = g.find(f"{SVG}rect"), [t.text for t in g.findall(f"{SVG}text")]
        if rect is not None and rect.get("class") == "node":
            by_name[texts[0]] = (float(rect.get("x")), float(rect.get("y")))
    assert by_name["s1.p0"][1] == by_name["s1.p1"][1]
    assert by_name["s1.p0"][0] < by_name["s1.p1"][0]
    assert by_name["s0"][1] < by_name["s1.p0"][1] < by_name["s1"][1] < by_name["s2"][1]


def test_the_title_gives_model_strategy_target_latency_and_cost():
    texts = _texts(_parse(sharded()))
    assert "cnn: mopar on lambda" in texts
    assert any("81.5 ms" in t and "$3.5000 per 1M requests" in t for t in texts)


def test_names_are_escaped(tmp_path):
    plan = Plan(
        model="a<b>&c",
        strategy="unsplit",
        functions=(_fn("s0", layers=("x",)),),
        edges=(_edge(REQUEST, "s0", 10, "request"), _edge("s0", RESPONSE, 10, "response")),
    )
    path = tmp_path / "g.svg"
    write_graph_svg(plan, path)
    assert "a<b>&c: unsplit on openfaas" in _texts(ET.parse(path).getroot())


def test_mopar_plan_graph_draws_every_function(tmp_path):
    svg = tmp_path / "out.svg"
    result = CliRunner().invoke(cli, ["plan", *MLP, "--slices", "2", "--graph", str(svg)])
    assert result.exit_code == 0, result.stderr
    assert f"wrote {svg}" in result.stdout
    texts = _texts(ET.parse(svg).getroot())
    doc = json.loads(CliRunner().invoke(cli, ["plan", *MLP, "--slices", "2", "--json"]).stdout)
    for f in doc["functions"]:
        assert f["name"] in texts
