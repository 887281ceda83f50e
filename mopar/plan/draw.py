"""Draw a plan's graph as SVG (``mopar plan --graph``).

Read in order: `graph_svg` (the entry point), `_rows` and `_layout` (where everything goes),
then the `_draw_*` helpers and `_document`.

The layout is layered, top to bottom. A node's row is its topological generation (networkx's
`topological_generations`: its longest-path depth from `REQUEST`); called functions
(``Kind.called``) then move down to just above their caller, so the sub-slices of a sharded slice
sit side by side in a row of their own, between the producer of the tensors they read and their
join. The nodes of a row spread out around the centre line x = 0. An edge between adjacent rows
is a straight line or a cubic Bézier from the producer's bottom to the consumer's top. An edge
that skips rows runs down a lane of its own right of the graph (shorter ones inside), so that it
crosses no box. Coordinates are SVG user units (px); the viewBox is fitted to what was drawn.
The document is built with ElementTree, which escapes every text and attribute.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import networkx as nx  # type: ignore[import-untyped]  # no stubs in the lock

from mopar._text import counted
from mopar.plan.graph import REQUEST, RESPONSE, Edge, Function, Plan

__all__ = ["format_usd", "graph_svg", "human_bytes", "write_graph_svg"]

FONT_PX = 11
NAME_FONT_PX = 13
TITLE_FONT_PX = 15
LINE_PX = 14
NODE_MIN_WIDTH_PX = 180
NODE_HEIGHT_PX = 58
NODE_PAD_PX = 10
END_WIDTH_PX = 96
END_HEIGHT_PX = 28
NODE_GAP_PX = 40
ROW_GAP_PX = 76
FRAME_PAD_PX = 12
FRAME_LABEL_PX = 18
LANE_GAP_PX = 24
CORNER_PX = 12
PORT_GAP_PX = 14
SIDE_PORT_GAP_PX = 8
MARGIN_PX = 20
EDGE_COLOUR = "#555555"
END_COLOUR = "#f2f2f2"
_ENDS = {REQUEST: "request", RESPONSE: "response"}


@dataclass(frozen=True, kw_only=True)
class _Box:
    """A rectangle: top-left corner and size, px."""

    x: float
    y: float
    w: float
    h: float

    @property
    def cx(self) -> float:
        return self.x + self.w / 2

    @property
    def cy(self) -> float:
        return self.y + self.h / 2

    @property
    def right(self) -> float:
        return self.x + self.w

    @property
    def bottom(self) -> float:
        return self.y + self.h


@dataclass(frozen=True, kw_only=True)
class _Layout:
    """Where everything goes.

    Attributes:
        boxes: each node's box.
        frames: a frame around the functions of each sharded slice, by group.
        lane_x: the x of the lane of each edge that skips rows, by (src, dst), px.
    """

    boxes: dict[str, _Box]
    frames: dict[str, _Box]
    lane_x: dict[tuple[str, str], float]


class _Extent:
    """The bounding box of what has been drawn, px."""

    def __init__(self) -> None:
        self.x0 = self.y0 = float("inf")
        self.x1 = self.y1 = float("-inf")

    def add(self, x0: float, y0: float, x1: float, y1: float) -> None:
        self.x0, self.y0 = min(self.x0, x0, x1), min(self.y0, y0, y1)
        self.x1, self.y1 = max(self.x1, x0, x1), max(self.y1, y0, y1)


def graph_svg(plan: Plan) -> str:
    """The plan's graph as an SVG document.

    Functions are boxes filled with their kind's colour, giving name, kind, memory (MB) and
    predicted time (ms); edges are arrows labelled with their bytes and transport (and their
    probability when it is not always taken, drawn dashed); the request and the response are
    small rounded ends; the functions of a sharded slice are framed together.
    """
    layout = _layout(plan)
    extent = _Extent()
    for b in (*layout.boxes.values(), *layout.frames.values()):
        extent.add(b.x, b.y, b.right, b.bottom)
    content = ET.Element("g")
    for group, frame in layout.frames.items():
        parallel = max(f.parallel for f in plan.functions if (f.group or f.name) == group)
        g = ET.SubElement(content, "g", {"class": "group"})
        _rect(g, frame, "group", rx="6", fill="none", stroke="#999999", dash="4 3")
        label = f"{group}: sharded in {parallel}"
        _text(g, frame.x + 6, frame.y + 12, label, FONT_PX - 1, anchor="start", fill="#666666")
    for e in plan.edges:
        if (e.src, e.dst) in layout.lane_x:
            _draw_skip_edge(content, e, plan, layout, extent)
        else:
            _draw_edge(content, e, plan, layout, extent)
    for name, box in layout.boxes.items():
        if name in _ENDS:
            g = ET.SubElement(content, "g", {"class": "end"})
            _rect(g, box, "end", rx=_n(box.h / 2), fill=END_COLOUR, stroke="#888888")
            _text(g, box.cx, box.cy + 4, _ENDS[name], FONT_PX, style="italic")
        else:
            _draw_function(content, plan, plan.function(name), box)
    return _document(plan, content, extent)


def write_graph_svg(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Write `graph_svg` of ``plan`` to ``path``."""
    Path(path).write_text(graph_svg(plan), encoding="utf-8")


# -- layout ---------------------------------------------------------------------------------------


def _rows(plan: Plan) -> dict[str, int]:
    """Each node's row: its topological generation, called functions just above their caller,
    the response last. Every edge then points at least one row down."""
    graph = nx.DiGraph([(e.src, e.dst) for e in plan.edges])
    graph.add_nodes_from([REQUEST, *(f.name for f in plan.functions)])
    graph.remove_nodes_from([RESPONSE])
    depth = {
        n: max(d, n != REQUEST)
        for d, ns in enumerate(nx.topological_generations(graph))
        for n in ns
    }
    depth[RESPONSE] = max(depth.values()) + 1
    for f in reversed(plan.functions):
        consumers = [depth[e.dst] for e in plan.edges_out(f.name)]
        if f.spec.called and consumers:
            depth[f.name] = min(consumers) - 1
    # moving called functions down may have emptied a row: number the rows left consecutively
    index = {d: i for i, d in enumerate(sorted(set(depth.values())))}
    return {name: index[d] for name, d in depth.items()}


def _layout(plan: Plan) -> _Layout:
    """Rows top to bottom, a row's nodes side by side around x = 0; a frame around each group of
    several functions (a sharded slice); a lane right of it all for each edge that skips rows."""
    rows = _rows(plan)
    order = [REQUEST, *(f.name for f in plan.functions), RESPONSE]
    boxes: dict[str, _Box] = {}
    y = 0.0
    for row in range(max(rows.values()) + 1):
        names = [n for n in order if rows[n] == row]
        sizes = [_size(plan, n) for n in names]
        height = max(h for _, h in sizes)
        x = -(sum(w for w, _ in sizes) + NODE_GAP_PX * (len(names) - 1)) / 2
        for n, (w, h) in zip(names, sizes):
            boxes[n] = _Box(x=x, y=y + (height - h) / 2, w=w, h=h)
            x += w + NODE_GAP_PX
        y += height + ROW_GAP_PX
    members: dict[str, list[_Box]] = {}
    for f in plan.functions:
        members.setdefault(f.group or f.name, []).append(boxes[f.name])
    frames = {}
    for group, bs in members.items():
        if len(bs) > 1:
            x0, y0 = min(b.x for b in bs) - FRAME_PAD_PX, min(b.y for b in bs) - FRAME_LABEL_PX
            x1 = max(b.right for b in bs) + FRAME_PAD_PX
            y1 = max(b.bottom for b in bs) + FRAME_PAD_PX
            frames[group] = _Box(x=x0, y=y0, w=x1 - x0, h=y1 - y0)
    skips = sorted(
        (e for e in plan.edges if rows[e.dst] - rows[e.src] > 1),
        key=lambda e: (rows[e.dst] - rows[e.src], rows[e.src]),
    )
    right = max(b.right for b in (*boxes.values(), *frames.values()))
    lane_x = {(e.src, e.dst): right + LANE_GAP_PX * (i + 1) for i, e in enumerate(skips)}
    return _Layout(boxes=boxes, frames=frames, lane_x=lane_x)


def _size(plan: Plan, name: str) -> tuple[float, float]:
    if name in _ENDS:
        return END_WIDTH_PX, END_HEIGHT_PX
    heading, *rest = _function_lines(plan, plan.function(name))
    widest = max(_text_px(heading, NAME_FONT_PX), *(_text_px(line, FONT_PX) for line in rest))
    return max(NODE_MIN_WIDTH_PX, widest + 2 * NODE_PAD_PX), NODE_HEIGHT_PX


def _ports(others: list[str], box: _Box, boxes: dict[str, _Box]) -> dict[str, float]:
    """The x where the edges to (or from) ``others`` meet ``box``, in the order of their x."""
    ordered = sorted(others, key=lambda n: boxes[n].cx)
    gap = min(PORT_GAP_PX, box.w / (len(ordered) + 1))
    return {n: box.cx + (i - (len(ordered) - 1) / 2) * gap for i, n in enumerate(ordered)}


# -- drawing --------------------------------------------------------------------------------------


def _draw_edge(parent: ET.Element, e: Edge, plan: Plan, layout: _Layout, extent: _Extent) -> None:
    """An edge between adjacent rows: the producer's bottom to the consumer's top. Left of the
    centre line its label reads leftwards, so that a fan's labels stay apart."""
    boxes, lanes = layout.boxes, layout.lane_x
    src, dst = boxes[e.src], boxes[e.dst]
    outs = [o.dst for o in plan.edges_out(e.src) if (o.src, o.dst) not in lanes]
    ins = [i.src for i in plan.edges_in(e.dst) if (i.src, i.dst) not in lanes]
    sx, tx = _ports(outs, src, boxes)[e.dst], _ports(ins, dst, boxes)[e.src]
    sy, ty = src.bottom, dst.y
    my = (sy + ty) / 2
    d = (
        f"M {sx:.1f} {sy:.1f} L {tx:.1f} {ty:.1f}"
        if abs(sx - tx) < 0.5
        else f"M {sx:.1f} {sy:.1f} C {sx:.1f} {my:.1f} {tx:.1f} {my:.1f} {tx:.1f} {ty:.1f}"
    )
    mx = (sx + tx) / 2
    side = -1 if mx < -0.5 else 1
    _draw_arrow(parent, e, d, mx + side * 6, my, side, extent)


def _draw_skip_edge(
    parent: ET.Element, e: Edge, plan: Plan, layout: _Layout, extent: _Extent
) -> None:
    """An edge that skips rows: out of the producer's right side, down its lane, into the
    consumer's, apart from the other skip edges at each."""

    def port_y(node: str) -> float:
        there = [k for k in layout.lane_x if node in k]
        offset = (there.index((e.src, e.dst)) - (len(there) - 1) / 2) * SIDE_PORT_GAP_PX
        return layout.boxes[node].cy + offset

    x = layout.lane_x[(e.src, e.dst)]
    sx, sy = layout.boxes[e.src].right, port_y(e.src)
    tx, ty = layout.boxes[e.dst].right, port_y(e.dst)
    r, bx = CORNER_PX, x - CORNER_PX
    d = (
        f"M {sx:.1f} {sy:.1f} L {bx:.1f} {sy:.1f} Q {x:.1f} {sy:.1f} {x:.1f} {sy + r:.1f} "
        f"L {x:.1f} {ty - r:.1f} Q {x:.1f} {ty:.1f} {bx:.1f} {ty:.1f} L {tx:.1f} {ty:.1f}"
    )
    extent.add(x, sy, x, ty)
    _draw_arrow(parent, e, d, x + 6, (sy + ty) / 2, 1, extent)


def _draw_arrow(
    parent: ET.Element, e: Edge, d: str, lx: float, ly: float, side: int, extent: _Extent
) -> None:
    """Edge ``e`` as path ``d`` with an arrowhead; its label starts at x = ``lx``, reads towards
    ``side`` (+1 right, -1 left) and is centred on y = ``ly``."""
    g = ET.SubElement(parent, "g", {"class": "edge"})
    taken = e.probability_source != "always"
    ET.SubElement(
        g, "title"
    ).text = f"{e.src} -> {e.dst}: {', '.join(e.tensors)} ({human_bytes(e.bytes)} by {e.transport})"
    attrs = {
        "class": "arrow",
        "d": d,
        "fill": "none",
        "stroke": EDGE_COLOUR,
        "stroke-width": "1.3",
        "marker-end": "url(#arrowhead)",
    }
    if taken:
        attrs["stroke-dasharray"] = "5 3"
    ET.SubElement(g, "path", attrs)
    codecs = sorted(set(e.codecs.values()))
    lines = [" · ".join([human_bytes(e.bytes), e.transport, *codecs])]
    if taken:
        lines.append(f"p = {e.probability:.0%} ({e.probability_source})")
    top = ly + 4 - LINE_PX * (len(lines) - 1) / 2
    for k, line in enumerate(lines):
        y = top + k * LINE_PX
        anchor = "start" if side > 0 else "end"
        _text(g, lx, y, line, FONT_PX, anchor=anchor, cls="edge-label", halo=True)
        extent.add(lx, y - FONT_PX, lx + side * _text_px(line, FONT_PX), y + 4)


def _draw_function(parent: ET.Element, plan: Plan, f: Function, box: _Box) -> None:
    g = ET.SubElement(parent, "g", {"class": "function"})
    layers = f"{f.layers[0]} .. {f.layers[-1]}, " if f.layers else ""
    ET.SubElement(g, "title").text = (
        f"{f.name} ({f.kind}): {len(f.layers)} layers {layers}{human_bytes(f.param_bytes)} of "
        f"parameters, {f.memory_mb} MB, {f.vcpus:g} vCPU, {f.time_ms:.3g} ms"
    )
    _rect(g, box, "node", rx="4", fill=f.spec.colour, stroke="#4a4a4a")
    name, label, figures = _function_lines(plan, f)
    top = box.y + (box.h - 2 * LINE_PX) / 2 + 4
    _text(g, box.cx, top, name, NAME_FONT_PX, weight="bold")
    _text(g, box.cx, top + LINE_PX, label, FONT_PX, fill="#444444")
    _text(g, box.cx, top + 2 * LINE_PX, figures, FONT_PX)


def _rect(parent: ET.Element, box: _Box, cls: str, *, dash: str = "", **attrs: str) -> None:
    """``box`` as a rect of class ``cls``; ``attrs``: its ``rx``, ``fill`` and ``stroke``."""
    size = {"x": _n(box.x), "y": _n(box.y), "width": _n(box.w), "height": _n(box.h)}
    dashes = {"stroke-dasharray": dash} if dash else {}
    ET.SubElement(parent, "rect", {"class": cls, **size, **attrs, **dashes})


def _document(plan: Plan, content: ET.Element, extent: _Extent) -> str:
    """The SVG root around ``content``: a title above it, the viewBox fitted to both."""
    title = f"{plan.model}: {plan.strategy} on {plan.target}"
    bound = f", bound {plan.bound_ms:.1f} ms" if plan.bound_ms is not None else ""
    summary = (
        f"predicted latency {plan.latency_ms:.1f} ms{bound}, "
        f"{format_usd(plan.cost_per_1m_usd)} per 1M requests, {counted(len(plan.functions), 'function')}"
    )
    title_h = 2 * LINE_PX + 14
    width = max(extent.x1 - extent.x0, _text_px(title, TITLE_FONT_PX), _text_px(summary, FONT_PX))
    x0, y0 = extent.x0 - MARGIN_PX, extent.y0 - title_h - MARGIN_PX
    w, h = width + 2 * MARGIN_PX, extent.y1 - y0 + MARGIN_PX
    svg = ET.Element(
        "svg",
        {
            "xmlns": "http://www.w3.org/2000/svg",
            "width": _n(w),
            "height": _n(h),
            "viewBox": f"{_n(x0)} {_n(y0)} {_n(w)} {_n(h)}",
            "font-family": "Helvetica, Arial, sans-serif",
        },
    )
    ET.SubElement(svg, "title").text = f"{title} ({summary})"
    marker = ET.SubElement(
        ET.SubElement(svg, "defs"),
        "marker",
        {
            "id": "arrowhead",
            "viewBox": "0 0 10 10",
            "refX": "10",
            "refY": "5",
            "markerWidth": "7",
            "markerHeight": "7",
            "orient": "auto",
        },
    )
    ET.SubElement(marker, "path", {"d": "M 0 0 L 10 5 L 0 10 z", "fill": EDGE_COLOUR})
    _rect(svg, _Box(x=x0, y=y0, w=w, h=h), "background", fill="white")
    heading = ET.SubElement(svg, "g", {"class": "title"})
    y = y0 + MARGIN_PX + TITLE_FONT_PX - 2
    _text(heading, extent.x0, y, title, TITLE_FONT_PX, anchor="start", weight="bold")
    y += LINE_PX + 4
    _text(heading, extent.x0, y, summary, FONT_PX, anchor="start", fill="#444444")
    svg.append(content)
    ET.indent(svg)
    return ET.tostring(svg, encoding="unicode", xml_declaration=True) + "\n"


# -- text -----------------------------------------------------------------------------------------


def _function_lines(plan: Plan, f: Function) -> tuple[str, str, str]:
    """A function box's lines: its name, its kind's label, its memory and predicted time."""
    k = 0
    if f.spec.called and plan.edges_out(f.name):
        k = [c.name for c in plan.callees(plan.caller(f.name).name)].index(f.name)
    label = f.label(k).removeprefix(f.name).strip(" ()") or f.kind
    if f.layers:
        label += f", {len(f.layers)} layer{'s' if len(f.layers) != 1 else ''}"
    return f.name, label, f"{f.memory_mb} MB · {f.time_ms:.3g} ms"


def _text(
    parent: ET.Element,
    x: float,
    y: float,
    text: str,
    size: int,
    *,
    anchor: str = "middle",
    weight: str = "normal",
    style: str = "normal",
    fill: str = "#111111",
    cls: str = "",
    halo: bool = False,
) -> None:
    attrs = {"x": _n(x), "y": _n(y), "font-size": str(size), "text-anchor": anchor, "fill": fill}
    if weight != "normal":
        attrs["font-weight"] = weight
    if style != "normal":
        attrs["font-style"] = style
    if cls:
        attrs["class"] = cls
    if halo:  # a white outline under the glyphs keeps a label legible where a line crosses it
        attrs.update(
            {
                "stroke": "white",
                "stroke-width": "3",
                "paint-order": "stroke",
                "stroke-linejoin": "round",
            }
        )
    ET.SubElement(parent, "text", attrs).text = text


def _text_px(text: str, size: int) -> float:
    """A generous estimate of the width of ``text`` at ``size`` px in a sans-serif font."""
    return 0.6 * size * len(text)


def human_bytes(n: float) -> str:
    """``n`` bytes as people read them (``1.5 MB``): the SVG's and the command line's tables'."""
    for unit in ("B", "KB", "MB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def format_usd(x: float) -> str:
    """Dollars as the SVG and the command line's tables show them."""
    return f"${x:.4f}" if x < 10 else f"${x:,.2f}"


def _n(x: float) -> str:
    """A coordinate as SVG wants it: short, no trailing zeros."""
    return f"{x:.1f}".rstrip("0").rstrip(".")
