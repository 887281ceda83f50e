"""Draw a plan's graph as SVG (``mopar plan --graph``), with the standard library alone.

Read in order: `graph_svg` (the entry point), `_layout` with `_rows`, `_place`, `_frames` and
`_lanes` (where everything goes), then the `_draw_*` helpers and `_document`.

The layout is layered, top to bottom. A node's row is its longest-path depth from `REQUEST`;
called functions (``Kind.called``) then move down to just above their caller, so the sub-slices
of a sharded slice sit side by side in a row of their own, between the producer of the tensors
they read and their join. The nodes of a row spread out around the centre line x = 0. An edge
between adjacent rows is a straight line or a cubic Bézier from the producer's bottom to the
consumer's top. An edge that skips rows runs in a lane beside the graph, left or right, nested by
span, so that it crosses no box. Coordinates are SVG user units (px); the viewBox is fitted to
what was drawn. The document is built with ElementTree, which escapes every text and attribute.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from mopar.plan.graph import REQUEST, RESPONSE, Edge, Function, Plan

__all__ = ["graph_svg", "write_graph_svg"]

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

Lane = tuple[int, int]
"""A skip edge's lane: its side (+1 right, -1 left) and index (0 innermost)."""


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
        rows: each node's row (0: the request).
        boxes: each node's box.
        frames: a frame around the functions of each sharded slice, by group.
        lanes: the lane of each edge that skips rows, by (src, dst).
        lane_x: the x of each lane used, px.
    """

    rows: dict[str, int]
    boxes: dict[str, _Box]
    frames: dict[str, _Box]
    lanes: dict[tuple[str, str], Lane]
    lane_x: dict[Lane, float]


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
        _draw_frame(content, group, frame, plan)
    for e in plan.edges:
        if (e.src, e.dst) in layout.lanes:
            _draw_skip_edge(content, e, layout, extent)
        else:
            _draw_edge(content, e, plan, layout, extent)
    for name, box in layout.boxes.items():
        if name in _ENDS:
            _draw_end(content, _ENDS[name], box)
        else:
            _draw_function(content, plan, plan.function(name), box)
    return _document(plan, content, extent)


def write_graph_svg(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Write `graph_svg` of ``plan`` to ``path``."""
    Path(path).write_text(graph_svg(plan), encoding="utf-8")


# -- layout ---------------------------------------------------------------------------------------


def _layout(plan: Plan) -> _Layout:
    rows = _rows(plan)
    boxes = _place(plan, rows)
    frames = _frames(plan, boxes)
    lanes = _lanes(plan, rows)
    x0 = min(b.x for b in (*boxes.values(), *frames.values()))
    x1 = max(b.right for b in (*boxes.values(), *frames.values()))
    lane_x = {
        (side, i): (x1 if side > 0 else x0) + side * LANE_GAP_PX * (i + 1)
        for side, i in set(lanes.values())
    }
    return _Layout(rows=rows, boxes=boxes, frames=frames, lanes=lanes, lane_x=lane_x)


def _rows(plan: Plan) -> dict[str, int]:
    """Each node's row: its longest-path depth, called functions just above their caller.

    Functions are listed in a topological order of the edges, so one pass finds the depths.
    Every edge then points at least one row down.
    """
    depth = {REQUEST: 0}
    for f in plan.functions:
        depth[f.name] = max((depth.get(e.src, 0) + 1 for e in plan.edges_in(f.name)), default=1)
    depth[RESPONSE] = max(depth.values()) + 1
    for f in reversed(plan.functions):
        consumers = [depth[e.dst] for e in plan.edges_out(f.name) if e.dst in depth]
        if f.spec.called and consumers:
            depth[f.name] = min(consumers) - 1
    # moving called functions down may have emptied a row: number the rows left consecutively
    index = {d: i for i, d in enumerate(sorted(set(depth.values())))}
    return {name: index[d] for name, d in depth.items()}


def _place(plan: Plan, rows: dict[str, int]) -> dict[str, _Box]:
    """Each node's box: rows top to bottom, a row's nodes side by side around x = 0."""
    order = [REQUEST, *(f.name for f in plan.functions), RESPONSE]
    sizes = {name: _size(plan, name) for name in order}
    boxes: dict[str, _Box] = {}
    y = 0.0
    for row in range(max(rows.values()) + 1):
        names = [n for n in order if rows[n] == row]
        height = max(sizes[n][1] for n in names)
        x = -(sum(sizes[n][0] for n in names) + NODE_GAP_PX * (len(names) - 1)) / 2
        for n in names:
            w, h = sizes[n]
            boxes[n] = _Box(x=x, y=y + (height - h) / 2, w=w, h=h)
            x += w + NODE_GAP_PX
        y += height + ROW_GAP_PX
    return boxes


def _size(plan: Plan, name: str) -> tuple[float, float]:
    if name in _ENDS:
        return END_WIDTH_PX, END_HEIGHT_PX
    heading, *rest = _function_lines(plan, plan.function(name))
    widest = max(_text_px(heading, NAME_FONT_PX), *(_text_px(line, FONT_PX) for line in rest))
    return max(NODE_MIN_WIDTH_PX, widest + 2 * NODE_PAD_PX), NODE_HEIGHT_PX


def _frames(plan: Plan, boxes: dict[str, _Box]) -> dict[str, _Box]:
    """A frame around the functions of each group of several (a sharded slice), by group."""
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
    return frames


def _lanes(plan: Plan, rows: dict[str, int]) -> dict[tuple[str, str], Lane]:
    """The lane of each edge that skips rows.

    Shorter edges take inner lanes. An edge takes the side where the innermost lane free over its
    rows is (the right on a tie), so nested skips alternate sides; two edges share a lane only
    where their rows do not meet.
    """
    skips = sorted(
        (e for e in plan.edges if rows[e.dst] - rows[e.src] > 1),
        key=lambda e: (rows[e.dst] - rows[e.src], rows[e.src]),
    )
    taken: dict[Lane, list[tuple[int, int]]] = {}
    lanes: dict[tuple[str, str], Lane] = {}
    for e in skips:
        lo, hi = rows[e.src], rows[e.dst]
        free = []
        for side in (1, -1):
            i = 0
            while any(a <= hi and lo <= b for a, b in taken.get((side, i), ())):
                i += 1
            free.append((side, i))
        lane = min(free, key=lambda lane: lane[1])  # min keeps the first, the right, on a tie
        taken.setdefault(lane, []).append((lo, hi))
        lanes[(e.src, e.dst)] = lane
    return lanes


def _ports(others: list[str], box: _Box, boxes: dict[str, _Box]) -> dict[str, float]:
    """The x where the edges to (or from) ``others`` meet ``box``, in the order of their x."""
    ordered = sorted(others, key=lambda n: boxes[n].cx)
    gap = min(PORT_GAP_PX, box.w / (len(ordered) + 1))
    return {n: box.cx + (i - (len(ordered) - 1) / 2) * gap for i, n in enumerate(ordered)}


def _side_offset(e: Edge, layout: _Layout, node: str) -> float:
    """The y offset where skip edge ``e`` meets ``node``'s side, apart from the others there."""
    side = layout.lanes[(e.src, e.dst)][0]
    there = sorted(k for k, (s, _) in layout.lanes.items() if s == side and node in k)
    return (there.index((e.src, e.dst)) - (len(there) - 1) / 2) * SIDE_PORT_GAP_PX


# -- drawing --------------------------------------------------------------------------------------


def _draw_edge(parent: ET.Element, e: Edge, plan: Plan, layout: _Layout, extent: _Extent) -> None:
    """An edge between adjacent rows: the producer's bottom to the consumer's top."""
    boxes, lanes = layout.boxes, layout.lanes
    src, dst = boxes[e.src], boxes[e.dst]
    outs = [o.dst for o in plan.edges if o.src == e.src and (o.src, o.dst) not in lanes]
    ins = [i.src for i in plan.edges if i.dst == e.dst and (i.src, i.dst) not in lanes]
    sx, tx = _ports(outs, src, boxes)[e.dst], _ports(ins, dst, boxes)[e.src]
    sy, ty = src.bottom, dst.y
    my = (sy + ty) / 2
    d = (
        f"M {sx:.1f} {sy:.1f} L {tx:.1f} {ty:.1f}"
        if abs(sx - tx) < 0.5
        else f"M {sx:.1f} {sy:.1f} C {sx:.1f} {my:.1f} {tx:.1f} {my:.1f} {tx:.1f} {ty:.1f}"
    )
    heading = (tx > sx + 0.5) - (tx < sx - 0.5)
    if heading and len(outs) > 1 and len(ins) == 1:
        # a fan out: the curves part near their heads, so each label goes by its head, reading
        # away from the curve, above the frame label of a sharded slice
        _draw_arrow(
            parent, e, d, tx + heading * 6, ty - FRAME_LABEL_PX - 4, heading, "above", extent
        )
    elif heading and len(ins) > 1 and len(outs) == 1:
        # a fan in: the curves part near their tails, so each label goes by its tail
        _draw_arrow(parent, e, d, sx - heading * 6, sy + 4, -heading, "below", extent)
    else:
        # left of the centre line a label reads leftwards, so that a fan's labels stay apart; it
        # sits where the curve's half heading its way is behind it
        mx, side = (sx + tx) / 2, -1 if (sx + tx) / 2 < -0.5 else 1
        place = "middle" if heading == 0 else "above" if heading == side else "below"
        _draw_arrow(parent, e, d, mx + side * 6, my, side, place, extent)


def _draw_skip_edge(parent: ET.Element, e: Edge, layout: _Layout, extent: _Extent) -> None:
    """An edge that skips rows: out of the producer's side, down its lane, into the consumer's."""
    side, i = layout.lanes[(e.src, e.dst)]
    x = layout.lane_x[(side, i)]
    src, dst = layout.boxes[e.src], layout.boxes[e.dst]
    sx, sy = (src.right if side > 0 else src.x), src.cy + _side_offset(e, layout, e.src)
    tx, ty = (dst.right if side > 0 else dst.x), dst.cy + _side_offset(e, layout, e.dst)
    r, bx = CORNER_PX, x - side * CORNER_PX
    d = (
        f"M {sx:.1f} {sy:.1f} L {bx:.1f} {sy:.1f} Q {x:.1f} {sy:.1f} {x:.1f} {sy + r:.1f} "
        f"L {x:.1f} {ty - r:.1f} Q {x:.1f} {ty:.1f} {bx:.1f} {ty:.1f} L {tx:.1f} {ty:.1f}"
    )
    extent.add(x, sy, x, ty)
    _draw_arrow(parent, e, d, x + side * 6, (sy + ty) / 2, side, "middle", extent)


def _draw_arrow(
    parent: ET.Element,
    e: Edge,
    d: str,
    lx: float,
    ly: float,
    side: int,
    place: str,
    extent: _Extent,
) -> None:
    """Edge ``e`` as path ``d`` with an arrowhead.

    Its label starts at x = ``lx`` and reads towards ``side`` (+1 right, -1 left); it sits
    ``place`` (``above``, ``middle`` or ``below``) y = ``ly``.
    """
    g = ET.SubElement(parent, "g", {"class": "edge"})
    taken = e.probability_source != "always"
    ET.SubElement(
        g, "title"
    ).text = (
        f"{e.src} -> {e.dst}: {', '.join(e.tensors)} ({_human_bytes(e.bytes)} by {e.transport})"
    )
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
    lines = [" · ".join([_human_bytes(e.bytes), e.transport, *codecs])]
    if taken:
        lines.append(f"p = {e.probability:.0%} ({e.probability_source})")
    top = {
        "above": ly - 5 - LINE_PX * (len(lines) - 1),
        "below": ly + FONT_PX + 2,
        "middle": ly + 4 - LINE_PX * (len(lines) - 1) / 2,
    }[place]
    for k, line in enumerate(lines):
        _text(
            g,
            lx,
            top + k * LINE_PX,
            line,
            FONT_PX,
            anchor="start" if side > 0 else "end",
            cls="edge-label",
            halo=True,
        )
        width = _text_px(line, FONT_PX)
        extent.add(lx, top + k * LINE_PX - FONT_PX, lx + side * width, top + k * LINE_PX + 4)


def _draw_function(parent: ET.Element, plan: Plan, f: Function, box: _Box) -> None:
    g = ET.SubElement(parent, "g", {"class": "function"})
    layers = f"{f.layers[0]} .. {f.layers[-1]}, " if f.layers else ""
    ET.SubElement(g, "title").text = (
        f"{f.name} ({f.kind}): {len(f.layers)} layers {layers}{_human_bytes(f.param_bytes)} of "
        f"parameters, {f.memory_mb} MB, {f.vcpus:g} vCPU, {f.time_ms:.3g} ms"
    )
    ET.SubElement(
        g,
        "rect",
        {
            "class": "node",
            "x": _n(box.x),
            "y": _n(box.y),
            "width": _n(box.w),
            "height": _n(box.h),
            "rx": "4",
            "fill": f.spec.colour,
            "stroke": "#4a4a4a",
        },
    )
    name, label, figures = _function_lines(plan, f)
    top = box.y + (box.h - 2 * LINE_PX) / 2 + 4
    _text(g, box.cx, top, name, NAME_FONT_PX, weight="bold")
    _text(g, box.cx, top + LINE_PX, label, FONT_PX, fill="#444444")
    _text(g, box.cx, top + 2 * LINE_PX, figures, FONT_PX)


def _draw_end(parent: ET.Element, label: str, box: _Box) -> None:
    g = ET.SubElement(parent, "g", {"class": "end"})
    ET.SubElement(
        g,
        "rect",
        {
            "class": "end",
            "x": _n(box.x),
            "y": _n(box.y),
            "width": _n(box.w),
            "height": _n(box.h),
            "rx": _n(box.h / 2),
            "fill": END_COLOUR,
            "stroke": "#888888",
        },
    )
    _text(g, box.cx, box.cy + 4, label, FONT_PX, style="italic")


def _draw_frame(parent: ET.Element, group: str, frame: _Box, plan: Plan) -> None:
    parallel = max(f.parallel for f in plan.functions if (f.group or f.name) == group)
    g = ET.SubElement(parent, "g", {"class": "group"})
    ET.SubElement(
        g,
        "rect",
        {
            "class": "group",
            "x": _n(frame.x),
            "y": _n(frame.y),
            "width": _n(frame.w),
            "height": _n(frame.h),
            "rx": "6",
            "fill": "none",
            "stroke": "#999999",
            "stroke-dasharray": "4 3",
        },
    )
    _text(
        g,
        frame.x + 6,
        frame.y + 12,
        f"{group}: sharded in {parallel}",
        FONT_PX - 1,
        anchor="start",
        fill="#666666",
    )


def _document(plan: Plan, content: ET.Element, extent: _Extent) -> str:
    """The SVG root around ``content``: a title above it, the viewBox fitted to both."""
    title = f"{plan.model}: {plan.strategy} on {plan.target}"
    bound = f", bound {plan.bound_ms:.1f} ms" if plan.bound_ms is not None else ""
    summary = (
        f"predicted latency {plan.latency_ms:.1f} ms{bound}, "
        f"{_usd(plan.cost_per_1m_usd)} per 1M requests, {len(plan.functions)} functions"
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
    defs = ET.SubElement(svg, "defs")
    marker = ET.SubElement(
        defs,
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
    ET.SubElement(
        svg,
        "rect",
        {
            "class": "background",
            "x": _n(x0),
            "y": _n(y0),
            "width": _n(w),
            "height": _n(h),
            "fill": "white",
        },
    )
    heading = ET.SubElement(svg, "g", {"class": "title"})
    _text(
        heading,
        extent.x0,
        y0 + MARGIN_PX + TITLE_FONT_PX - 2,
        title,
        TITLE_FONT_PX,
        anchor="start",
        weight="bold",
    )
    _text(
        heading,
        extent.x0,
        y0 + MARGIN_PX + TITLE_FONT_PX + LINE_PX + 2,
        summary,
        FONT_PX,
        anchor="start",
        fill="#444444",
    )
    svg.append(content)
    ET.indent(svg)
    return ET.tostring(svg, encoding="unicode", xml_declaration=True) + "\n"


# -- text -----------------------------------------------------------------------------------------


def _function_lines(plan: Plan, f: Function) -> tuple[str, str, str]:
    """A function box's lines: its name, its kind's label, its memory and predicted time."""
    k = 0
    if f.spec.called:
        consumers = {e.dst for e in plan.edges_out(f.name)}
        caller = next((c.name for c in plan.functions if c.name in consumers), None)
        callees = [c.name for c in plan.callees(caller)] if caller else [f.name]
        k = callees.index(f.name)
    label = f.label(k)
    label = label.removeprefix(f.name).strip(" ()") or f.kind
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


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _usd(x: float) -> str:
    return f"${x:.4f}" if x < 10 else f"${x:,.2f}"


def _n(x: float) -> str:
    """A coordinate as SVG wants it: short, no trailing zeros."""
    return f"{x:.1f}".rstrip("0").rstrip(".")
