"""Drawing a session's provenance graph, with a revocation's taint closure highlighted.

`sandboxd graph SESSION --format json|dot|svg` prints what `render` returns. JSON carries every
artifact and checkpoint in full, so `parse_json` gives the inputs back; DOT is for Graphviz; SVG is
laid out here, in pure Python, so the CLI draws a graph on a machine without Graphviz.

The SVG layout is layered: a column per observation step, split into sub-columns by dependency depth
within the step (a model turn, then its tool call, then ...), so every edge runs left to right; rows
follow recording order. Artifact text is untrusted (it is what an injection wrote), so every string
is escaped for its format and stripped of characters XML 1.0 cannot carry.

Why one module of this size: three renderings of one graph (JSON, DOT, SVG) share the escaping of
untrusted text and the layout's columns; most of its length is the SVG layout, which has no other user.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from typing import Any

import msgspec

from sandboxd.protocol import Artifact, CheckpointRecord

FORMATS = ("json", "dot", "svg")
EXCERPT_CHARS = 40

_CLOSURE_FILL = "#f6c1c1"
_CLOSURE_STROKE = "#b03030"
_PLAIN_FILL = "#ffffff"
_PLAIN_STROKE = "#555555"
_CHECKPOINT_FILL = "#9ab8d8"

# XML 1.0 forbids most C0 controls, lone surrogates and U+FFFE/U+FFFF even when escaped.
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def render(
    artifacts: list[Artifact],
    checkpoints: list[CheckpointRecord],
    closure: set[str],
    fmt: str,
    *,
    source: str | None = None,
    redact: set[str] | None = None,
    lanes: bool = False,
) -> str:
    """The provenance graph as json, dot or svg text; `source` defaults to the closure's roots.

    `lanes` (svg): time runs top to bottom and each artifact type has its own column, which stays
    readable at hundreds of nodes where the default left-to-right row grows too wide to see.

    Artifacts in `redact` are drawn by id, type and a digest of their text, never the text: a picture
    of what a revocation will take back must not carry what it takes back."""
    sources = {source} if source is not None else _roots(artifacts, closure)
    if redact:
        artifacts = [redacted(a) if a.artifact_id in redact else a for a in artifacts]
    if fmt == "json":
        return _render_json(artifacts, checkpoints, closure, sources)
    if fmt == "dot":
        return _render_dot(artifacts, checkpoints, closure, sources)
    if fmt == "svg":
        if lanes:
            return _render_svg_lanes(artifacts, checkpoints, closure, sources)
        return _render_svg(artifacts, checkpoints, closure, sources)
    raise ValueError(f"unknown graph format {fmt!r}; choose one of {', '.join(FORMATS)}")


def redacted(artifact: Artifact) -> Artifact:
    """The artifact with its text (and meta) replaced by its length and a digest of it."""
    digest = hashlib.sha256(artifact.content.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    note = f"[redacted: {len(artifact.content)} chars, sha256 {digest}]"
    return msgspec.structs.replace(artifact, content=note, meta={})


def parse_json(text: str) -> tuple[list[Artifact], list[CheckpointRecord], set[str]]:
    """Read `render(..., "json")` output back into artifacts, checkpoints and the closure."""
    data = json.loads(text)
    artifacts = [msgspec.convert(node["artifact"], Artifact) for node in data["nodes"]]
    checkpoints = [msgspec.convert(item, CheckpointRecord) for item in data["checkpoints"]]
    return artifacts, checkpoints, set(data["closure"])


def excerpt(content: str, limit: int = EXCERPT_CHARS) -> str:
    """A one-line excerpt of `content`: whitespace collapsed, control characters dropped, cut to `limit`."""
    flat = " ".join(_XML_INVALID.sub("", content).split())
    flat = "".join(ch for ch in flat if ch.isprintable())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _roots(artifacts: list[Artifact], closure: set[str]) -> set[str]:
    """Closure members none of whose parents is in the closure: where the taint entered."""
    return {a.artifact_id for a in artifacts if a.artifact_id in closure and not closure.intersection(a.parents)}


def _edges(artifacts: list[Artifact]) -> list[tuple[str, str]]:
    known = {a.artifact_id for a in artifacts}
    return [(parent, a.artifact_id) for a in artifacts for parent in dict.fromkeys(a.parents) if parent in known]


# JSON ---------------------------------------------------------------------------------------


def _render_json(
    artifacts: list[Artifact], checkpoints: list[CheckpointRecord], closure: set[str], sources: set[str]
) -> str:
    known = {a.artifact_id for a in artifacts}
    document: dict[str, Any] = {
        "nodes": [
            {
                "id": a.artifact_id,
                "in_closure": a.artifact_id in closure,
                "is_source": a.artifact_id in sources,
                "artifact": msgspec.to_builtins(a),
            }
            for a in artifacts
        ],
        "edges": [
            {"parent": p, "child": c, "in_closure": p in closure and c in closure} for p, c in _edges(artifacts)
        ],
        "missing_parents": sorted({p for a in artifacts for p in a.parents if p not in known}),
        "checkpoints": [msgspec.to_builtins(c) for c in checkpoints],
        "closure": sorted(closure),
        "sources": sorted(sources),
    }
    return json.dumps(document, indent=2, ensure_ascii=False)


# DOT ----------------------------------------------------------------------------------------


def _dot_string(text: str) -> str:
    """A double-quoted DOT string; newlines become DOT's centred line break."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\r", "").replace("\n", "\\n") + '"'


def _render_dot(
    artifacts: list[Artifact], checkpoints: list[CheckpointRecord], closure: set[str], sources: set[str]
) -> str:
    lines = [
        "digraph provenance {",
        "  rankdir=LR;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10, '
        f'fillcolor="{_PLAIN_FILL}", color="{_PLAIN_STROKE}"];',
        "  edge [color=\"#777777\"];",
    ]
    for a in artifacts:
        label = f"{a.type}\n{a.artifact_id}\n{excerpt(a.content)}" if a.content else f"{a.type}\n{a.artifact_id}"
        attrs = [f"label={_dot_string(label)}"]
        if a.artifact_id in closure:
            attrs.append(f'fillcolor="{_CLOSURE_FILL}", color="{_CLOSURE_STROKE}"')
        if a.artifact_id in sources:
            attrs.append("penwidth=3")
        if not a.committed:
            attrs.append('style="rounded,filled,dashed"')
        lines.append(f"  {_dot_string(a.artifact_id)} [{', '.join(attrs)}];")
    for c in checkpoints:
        lines.append(
            f"  {_dot_string('checkpoint:' + c.checkpoint_id)} [shape=diamond, width=0.25, height=0.25, "
            f'fixedsize=true, label="", xlabel={_dot_string(c.checkpoint_id)}, fontsize=8, '
            f'fillcolor="{_CHECKPOINT_FILL}", tooltip={_dot_string(f"{c.reason} step {c.step} turn {c.turn}")}];'
        )
    for parent, child in _edges(artifacts):
        style = f' [color="{_CLOSURE_STROKE}", penwidth=2]' if parent in closure and child in closure else ""
        lines.append(f"  {_dot_string(parent)} -> {_dot_string(child)}{style};")
    for step, members in sorted(_by_step(artifacts, checkpoints).items()):
        lines.append(f"  subgraph {_dot_string(f'step_{step}')} {{ rank=same; {' '.join(members)} }}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _by_step(artifacts: list[Artifact], checkpoints: list[CheckpointRecord]) -> dict[int, list[str]]:
    # Only checkpoints are pinned to their step's rank: pinning artifacts too would force a turn and
    # the tool call it emits into one rank, drawing the edge between them vertically.
    steps: dict[int, list[str]] = {}
    for c in checkpoints:
        steps.setdefault(c.step, []).append(_dot_string("checkpoint:" + c.checkpoint_id))
    for a in artifacts:
        if a.type in ("user", "memory", "observation") and a.step in steps:
            steps[a.step].append(_dot_string(a.artifact_id))
    return steps


# SVG ----------------------------------------------------------------------------------------

_NODE_W, _NODE_H = 190, 46
_COL_GAP, _ROW_GAP = 50, 22
_MARGIN, _HEADER = 20, 46
_LEGEND_H = 70


def _xml(text: str) -> str:
    """Text safe inside an XML element or a double-quoted attribute."""
    clean = _XML_INVALID.sub("", text)
    return clean.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _layout(artifacts: list[Artifact]) -> tuple[dict[str, tuple[int, int]], dict[int, int]]:
    """Grid cell (column, row) of every artifact, and the first column of every step."""
    by_id = {a.artifact_id: a for a in artifacts}
    depth: dict[str, int] = {}
    for a in artifacts:
        # Recording order puts parents first; a parent not yet seen (or in another step) adds nothing.
        same_step = [depth[p] + 1 for p in a.parents if p in depth and by_id[p].step == a.step]
        depth[a.artifact_id] = max(same_step, default=0)
    widths: dict[int, int] = {}
    for a in artifacts:
        widths[a.step] = max(widths.get(a.step, 0), depth[a.artifact_id] + 1)
    first: dict[int, int] = {}
    column = 0
    for step in sorted(widths):
        first[step] = column
        column += widths[step]
    rows: dict[int, int] = {}
    cells: dict[str, tuple[int, int]] = {}
    for a in artifacts:
        col = first[a.step] + depth[a.artifact_id]
        cells[a.artifact_id] = (col, rows.get(col, 0))
        rows[col] = rows.get(col, 0) + 1
    return cells, first


def _xy(cell: tuple[int, int]) -> tuple[int, int]:
    return _MARGIN + cell[0] * (_NODE_W + _COL_GAP), _MARGIN + _HEADER + cell[1] * (_NODE_H + _ROW_GAP)


def _svg_node(a: Artifact, x: int, y: int, tainted: bool, is_source: bool) -> str:
    fill, stroke = (_CLOSURE_FILL, _CLOSURE_STROKE) if tainted else (_PLAIN_FILL, _PLAIN_STROKE)
    width = 3 if is_source else 1
    dash = ' stroke-dasharray="4 2"' if not a.committed else ""
    classes = "node" + (" closure" if tainted else "") + (" source" if is_source else "")
    title = f"{a.artifact_id} ({a.type}, step {a.step}, turn {a.turn})\n{excerpt(a.content, 400)}"
    return (
        f'<g class="{classes}" data-artifact="{_xml(a.artifact_id)}"><title>{_xml(title)}</title>'
        f'<rect x="{x}" y="{y}" width="{_NODE_W}" height="{_NODE_H}" rx="6" fill="{fill}" stroke="{stroke}" '
        f'stroke-width="{width}"{dash}/>'
        f'<text x="{x + 8}" y="{y + 18}" font-size="11" font-weight="bold">'
        f"{_xml(excerpt(f'{a.type} · {a.artifact_id}', 28))}</text>"
        f'<text x="{x + 8}" y="{y + 36}" font-size="10" fill="#333333">{_xml(excerpt(a.content, 30))}</text></g>'
    )


def _svg_edge(start: tuple[int, int], end: tuple[int, int], tainted: bool) -> str:
    x1, y1 = start[0] + _NODE_W, start[1] + _NODE_H // 2
    x2, y2 = end[0], end[1] + _NODE_H // 2
    bend = max(20, (x2 - x1) // 2)
    colour, marker = (_CLOSURE_STROKE, "arrow-tainted") if tainted else ("#888888", "arrow")
    return (
        f'<path class="edge{" closure" if tainted else ""}" d="M{x1},{y1} C{x1 + bend},{y1} {x2 - bend},{y2} '
        f'{x2},{y2}" fill="none" stroke="{colour}" stroke-width="{2 if tainted else 1}" marker-end="url(#{marker})"/>'
    )


def _svg_checkpoints(checkpoints: list[CheckpointRecord], first: dict[int, int]) -> Iterable[str]:
    """Small diamonds along the top, at the column where the checkpoint's step begins."""
    placed: dict[int, int] = {}
    for c in checkpoints:
        # A checkpoint at step s sits before o_{s+1}; with no artifact at s, use the nearest step before it.
        column = first.get(c.step, max((col for step, col in first.items() if step <= c.step), default=0))
        index = placed.get(column, 0)
        placed[column] = index + 1
        cx, cy = _MARGIN + column * (_NODE_W + _COL_GAP) + 8 + index * 20, _MARGIN + 12
        yield (
            f'<g class="checkpoint" data-checkpoint="{_xml(c.checkpoint_id)}"><title>'
            f"{_xml(f'checkpoint {c.checkpoint_id}: {c.reason}, step {c.step}, turn {c.turn}')}</title>"
            f'<polygon points="{cx},{cy - 7} {cx + 7},{cy} {cx},{cy + 7} {cx - 7},{cy}" fill="{_CHECKPOINT_FILL}" '
            f'stroke="#335577"/></g>'
        )


def _svg_legend(y: int) -> str:
    items = [
        (f'<rect width="18" height="12" fill="{_CLOSURE_FILL}" stroke="{_CLOSURE_STROKE}"/>', "in the taint closure"),
        (f'<rect width="18" height="12" fill="{_PLAIN_FILL}" stroke="{_PLAIN_STROKE}"/>', "untainted"),
        (f'<rect width="18" height="12" fill="{_CLOSURE_FILL}" stroke="{_CLOSURE_STROKE}" stroke-width="3"/>',
         "source of the revoked input"),
        (f'<polygon points="9,0 16,6 9,12 2,6" fill="{_CHECKPOINT_FILL}" stroke="#335577"/>', "checkpoint"),
    ]
    parts = [f'<g class="legend" transform="translate({_MARGIN},{y})">']
    for i, (shape, text) in enumerate(items):
        x = i * 200
        parts.append(f'<g transform="translate({x},0)">{shape}<text x="26" y="11" font-size="11">{text}</text></g>')
    parts.append("</g>")
    return "".join(parts)


def _render_svg(
    artifacts: list[Artifact], checkpoints: list[CheckpointRecord], closure: set[str], sources: set[str]
) -> str:
    cells, first = _layout(artifacts)
    columns = max((col for col, _ in cells.values()), default=0) + 1
    rows = max((row for _, row in cells.values()), default=-1) + 1
    width = max(2 * _MARGIN + columns * (_NODE_W + _COL_GAP), 4 * 200 + 2 * _MARGIN)
    legend_y = _MARGIN + _HEADER + rows * (_NODE_H + _ROW_GAP) + 10
    height = legend_y + _LEGEND_H
    positions = {aid: _xy(cell) for aid, cell in cells.items()}
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif">',
        "<defs>",
        *(
            f'<marker id="{name}" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
            f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{colour}"/></marker>'
            for name, colour in (("arrow", "#888888"), ("arrow-tainted", _CLOSURE_STROKE))
        ),
        "</defs>",
        f'<rect width="{width}" height="{height}" fill="#fafafa"/>',
    ]
    for step, column in sorted(first.items()):
        x = _MARGIN + column * (_NODE_W + _COL_GAP)
        parts.append(f'<text class="step" x="{x + 30}" y="{_MARGIN + 16}" font-size="12" fill="#555555">'
                     f"step {step}</text>")
    parts.extend(_svg_checkpoints(checkpoints, first))
    for parent, child in _edges(artifacts):
        parts.append(_svg_edge(positions[parent], positions[child], parent in closure and child in closure))
    for a in artifacts:
        x, y = positions[a.artifact_id]
        parts.append(_svg_node(a, x, y, a.artifact_id in closure, a.artifact_id in sources))
    parts.append(_svg_legend(legend_y))
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


# SVG in lanes: time top to bottom, one column per artifact type ------------------------------

LANES = ("system", "user", "memory", "model_turn", "plan", "tool_call", "observation", "reply", "summary")
_LANE_LABEL_W = 70


def _layout_lanes(artifacts: list[Artifact]) -> tuple[dict[str, tuple[int, int]], dict[int, int]]:
    """Grid cell (lane, row) of every artifact, and the first row of every step.

    A step's artifacts take as many rows as its dependency depth needs (a turn, then its call), and
    artifacts of one type at one depth stack in extra rows, so every edge runs downwards."""
    cells_by_layer: dict[tuple[int, int], list[Artifact]] = {}
    by_id = {a.artifact_id: a for a in artifacts}
    depth: dict[str, int] = {}
    for a in artifacts:
        same_step = [depth[p] + 1 for p in a.parents if p in depth and by_id[p].step == a.step]
        depth[a.artifact_id] = max(same_step, default=0)
        cells_by_layer.setdefault((a.step, depth[a.artifact_id]), []).append(a)
    cells: dict[str, tuple[int, int]] = {}
    first: dict[int, int] = {}
    row = 0
    for step, layer in sorted(cells_by_layer):
        first.setdefault(step, row)
        stacked: dict[int, int] = {}
        for a in cells_by_layer[(step, layer)]:
            lane = LANES.index(a.type) if a.type in LANES else len(LANES)
            cells[a.artifact_id] = (lane, row + stacked.get(lane, 0))
            stacked[lane] = stacked.get(lane, 0) + 1
        row += max(stacked.values())
    return cells, first


def _lane_xy(cell: tuple[int, int]) -> tuple[int, int]:
    return (_MARGIN + _LANE_LABEL_W + cell[0] * (_NODE_W + _COL_GAP),
            _MARGIN + _HEADER + cell[1] * (_NODE_H + _ROW_GAP))


def _svg_edge_down(start: tuple[int, int], end: tuple[int, int], tainted: bool) -> str:
    x1, y1 = start[0] + _NODE_W // 2, start[1] + _NODE_H
    x2, y2 = end[0] + _NODE_W // 2, end[1]
    bend = max(12, (y2 - y1) // 2)
    colour, marker = (_CLOSURE_STROKE, "arrow-tainted") if tainted else ("#888888", "arrow")
    return (
        f'<path class="edge{" closure" if tainted else ""}" d="M{x1},{y1} C{x1},{y1 + bend} {x2},{y2 - bend} '
        f'{x2},{y2}" fill="none" stroke="{colour}" stroke-width="{2 if tainted else 1}" marker-end="url(#{marker})"/>'
    )


def _render_svg_lanes(
    artifacts: list[Artifact], checkpoints: list[CheckpointRecord], closure: set[str], sources: set[str]
) -> str:
    cells, first = _layout_lanes(artifacts)
    used = sorted({lane for lane, _ in cells.values()})
    # Only lanes that hold something take room.
    compact = {lane: i for i, lane in enumerate(used)}
    cells = {aid: (compact[lane], row) for aid, (lane, row) in cells.items()}
    rows = max((row for _, row in cells.values()), default=-1) + 1
    width = max(2 * _MARGIN + _LANE_LABEL_W + len(used) * (_NODE_W + _COL_GAP), 4 * 200 + 2 * _MARGIN)
    legend_y = _MARGIN + _HEADER + rows * (_NODE_H + _ROW_GAP) + 10
    height = legend_y + _LEGEND_H
    positions = {aid: _lane_xy(cell) for aid, cell in cells.items()}
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif">',
        "<defs>",
        *(
            f'<marker id="{name}" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
            f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{colour}"/></marker>'
            for name, colour in (("arrow", "#888888"), ("arrow-tainted", _CLOSURE_STROKE))
        ),
        "</defs>",
        f'<rect width="{width}" height="{height}" fill="#fafafa"/>',
    ]
    for lane, i in compact.items():
        name = LANES[lane] if lane < len(LANES) else "other"
        x = _MARGIN + _LANE_LABEL_W + i * (_NODE_W + _COL_GAP)
        parts.append(f'<text class="lane" x="{x + 8}" y="{_MARGIN + 16}" font-size="12" fill="#555555">{name}</text>')
    for step, row in sorted(first.items()):
        y = _MARGIN + _HEADER + row * (_NODE_H + _ROW_GAP)
        parts.append(f'<line x1="{_MARGIN}" y1="{y - _ROW_GAP // 2}" x2="{width - _MARGIN}" y2="{y - _ROW_GAP // 2}" '
                     'stroke="#e4e4e4"/>')
        parts.append(f'<text class="step" x="{_MARGIN}" y="{y + 18}" font-size="12" fill="#555555">step {step}</text>')
    for c in checkpoints:
        row = first.get(c.step, max((r for step, r in first.items() if step <= c.step), default=0))
        cx, cy = _MARGIN + 56, _MARGIN + _HEADER + row * (_NODE_H + _ROW_GAP) + 34
        parts.append(
            f'<g class="checkpoint" data-checkpoint="{_xml(c.checkpoint_id)}"><title>'
            f"{_xml(f'checkpoint {c.checkpoint_id}: {c.reason}, step {c.step}, turn {c.turn}')}</title>"
            f'<polygon points="{cx},{cy - 7} {cx + 7},{cy} {cx},{cy + 7} {cx - 7},{cy}" fill="{_CHECKPOINT_FILL}" '
            f'stroke="#335577"/></g>'
        )
    for parent, child in _edges(artifacts):
        parts.append(_svg_edge_down(positions[parent], positions[child], parent in closure and child in closure))
    for a in artifacts:
        x, y = positions[a.artifact_id]
        parts.append(_svg_node(a, x, y, a.artifact_id in closure, a.artifact_id in sources))
    parts.append(_svg_legend(legend_y))
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
