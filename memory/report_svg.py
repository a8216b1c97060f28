"""Hand-drawn inline SVG plots of the session report (memory/report.py): no matplotlib, no script, no network.

Each plot is one `<svg class="plot" data-plot=NAME>` whose every text is HTML-escaped (artifact names
and rationales can carry text from the public feedback). The report's browser test counts the
marks inside each plot, so an empty plot is an empty `<svg>` with a caption saying why, never a
blank frame that looks drawn.
"""

from __future__ import annotations

import math
from html import escape as html_escape

from pydantic import BaseModel, Field

from core.display import shown


def escape(text: str) -> str:
    """HTML-escaped, control and bidi characters shown as escapes (an artifact name can quote public text)."""
    return html_escape(shown(text))


# One colour per job kind family (Okabe-Ito, legible to colour-blind readers); failures are always red.
KIND_COLOURS = {"training": "#0072B2", "evaluation": "#009E73", "merge": "#E69F00", "other": "#999999"}
FAILED = "#D55E00"
CHAIN = "#CC79A7"


class Segment(BaseModel):
    """One settled job attempt on the burn-down."""

    start_h: float = Field(description="Hours from the session's start to the attempt's start.")
    end_h: float = Field(description="Hours from the session's start to the attempt's end.")
    left_before: float = Field(description="GPU-hours left before the attempt was charged.")
    left_after: float = Field(description="GPU-hours left after.")
    family: str = Field(description="Colour family: training, evaluation, merge or other.")
    failed: bool = Field(description="Whether the attempt failed.")
    label: str = Field(description="Tooltip: job kind, id and cost.")
    href: str = Field(description="Anchor of the job's row in the jobs table.")


class Node(BaseModel):
    """One checkpoint in the lineage graph."""

    id: int = Field(description="Artifact id.")
    title: str = Field(description="First line: '#id name'.")
    detail: str = Field(description="Second line: method and job.")
    parents: list[int] = Field(description="Parent checkpoint ids drawn as edges.")
    chain: bool = Field(description="On the promoted (incumbent) chain.")


class DeltaRow(BaseModel):
    """One bar of a comparison: the paired delta, its CI, the noise-floor band and the verdict."""

    label: str = Field(description="suite/metric statistic op threshold.")
    delta: float | None = Field(description="Mean paired difference candidate - incumbent (None: not computable).")
    ci: tuple[float, float] | None = Field(description="95% CI of the delta (None: fewer than 2 pairs).")
    floor: float | None = Field(description="Noise floor (mean |delta| between incumbent replicates); None if none.")
    threshold: float | None = Field(description="The bar's threshold on the delta scale (delta bars only).")
    holds: bool = Field(description="The notebook's verdict.")


class DosePoint(BaseModel):
    """One position of a dose sweep or two-model soup."""

    alpha: float = Field(description="Position from the start model (0) to the end model (1).")
    value: float = Field(description="Metric of the first served replicate-0 eval.")
    artifact_id: int = Field(description="Artifact evaluated.")
    chosen: bool = Field(description="On the incumbent chain or nominated (directly or through a serving alternative).")


def _fmt(v: float) -> str:
    return f"{v + 0.0:.4g}"  # + 0.0: no "-0"


def _text(x: float, y: float, s: str, cls: str = "", anchor: str = "start") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"'
            f'{f" class={chr(34)}{cls}{chr(34)}" if cls else ""}>{escape(s)}</text>')


def _svg(name: str, width: int, height: int, body: list[str], caption: str) -> str:
    return (f'<figure><svg class="plot" data-plot="{name}" xmlns="http://www.w3.org/2000/svg" '
            f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
            f'aria-label="{escape(caption)}">{"".join(body)}</svg><figcaption>{escape(caption)}</figcaption></figure>')


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round tick values covering [lo, hi] (steps of 1, 2 or 5 times a power of ten)."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if raw <= m * step)
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 12) for i in range(int((hi - first) / step + 1e-9) + 1)]


class _Scale:
    """Linear map from data [lo, hi] to pixels [a, b]."""

    def __init__(self, lo: float, hi: float, a: float, b: float):
        self.lo, self.hi, self.a, self.b = lo, hi if hi > lo else lo + 1.0, a, b

    def __call__(self, v: float) -> float:
        return self.a + (v - self.lo) / (self.hi - self.lo) * (self.b - self.a)


def _axes(x: _Scale, y: _Scale, xlabel: str, ylabel: str) -> list[str]:
    out = [f'<line class="axis" x1="{x.a}" y1="{y.a}" x2="{x.b}" y2="{y.a}"/>',
           f'<line class="axis" x1="{x.a}" y1="{y.a}" x2="{x.a}" y2="{y.b}"/>']
    for t in nice_ticks(x.lo, x.hi):
        out += [f'<line class="tick" x1="{x(t):.1f}" y1="{y.a}" x2="{x(t):.1f}" y2="{y.a + 4}"/>',
                _text(x(t), y.a + 16, _fmt(t), "tick", "middle")]
    for t in nice_ticks(y.lo, y.hi):
        out += [f'<line class="grid" x1="{x.a}" y1="{y(t):.1f}" x2="{x.b}" y2="{y(t):.1f}"/>',
                _text(x.a - 6, y(t) + 4, _fmt(t), "tick", "end")]
    out += [_text((x.a + x.b) / 2, y.a + 32, xlabel, "label", "middle"),
            f'<text class="label" transform="translate(14,{(y.a + y.b) / 2:.1f}) rotate(-90)" '
            f'text-anchor="middle">{escape(ylabel)}</text>']
    return out


def burn_down(segments: list[Segment], budget: float, reserve: float, caption: str) -> str:
    """GPU-hours left against hours since the session started; one coloured segment per settled attempt."""
    width, height = 760, 300
    if not segments:
        return _svg("burn-down", width, 40, [_text(8, 24, "no settled job: nothing charged yet", "empty")], caption)
    end = max(s.end_h for s in segments)
    low = min(s.left_after for s in segments)
    # Zoom onto the spent part when it is a sliver of the budget; the ticks keep the scale honest.
    y_lo = 0.0 if low < budget / 2 else max(0.0, low - (budget - low) * 0.15)
    x, y = _Scale(0, end * 1.02, 70, width - 20), _Scale(y_lo, budget, height - 45, 15)
    body = _axes(x, y, "hours since the session started", "GPU-hours left")
    if reserve >= y_lo:
        body += [f'<line class="reserve" x1="{x.a}" y1="{y(reserve):.1f}" x2="{x.b}" y2="{y(reserve):.1f}"/>',
                 _text(x.b, y(reserve) - 4, f"reserve {_fmt(reserve)}", "note", "end")]
    for s in segments:
        colour = FAILED if s.failed else KIND_COLOURS[s.family]
        x1, x2 = x(s.start_h), max(x(s.end_h), x(s.start_h) + 2)
        body.append(f'<a href="{s.href}"><line class="mark seg" stroke="{colour}" x1="{x1:.1f}" y1="{y(s.left_before):.1f}" '
                    f'x2="{x2:.1f}" y2="{y(s.left_after):.1f}"><title>{escape(s.label)}</title></line></a>')
        if s.failed:
            cx, cy = x2, y(s.left_after)
            body.append(f'<path class="mark fail" d="M{cx - 5:.1f},{cy - 5:.1f}L{cx + 5:.1f},{cy + 5:.1f}'
                        f'M{cx - 5:.1f},{cy + 5:.1f}L{cx + 5:.1f},{cy - 5:.1f}"><title>{escape(s.label)}</title></path>')
    legend = [*KIND_COLOURS.items(), ("failed", FAILED)]
    for i, (name, colour) in enumerate(legend):
        lx = x.a + 10 + i * 110
        body += [f'<rect x="{lx}" y="4" width="12" height="4" fill="{colour}"/>', _text(lx + 16, 10, name, "legend")]
    return _svg("burn-down", width, height, body, caption)


def _depths(nodes: list[Node]) -> dict[int, int]:
    ids, depth = {n.id for n in nodes}, {}
    for n in sorted(nodes, key=lambda n: n.id):  # parents always have smaller ids (they existed first)
        depth[n.id] = 1 + max((depth.get(p, 0) for p in n.parents if p in ids), default=-1)
    return depth


def lineage(nodes: list[Node], caption: str) -> str:
    """Checkpoints in columns by generation, edges to their parents, the incumbent chain highlighted."""
    if not nodes:
        return _svg("lineage", 760, 40, [_text(8, 24, "no checkpoint recorded", "empty")], caption)
    depth = _depths(nodes)
    columns: dict[int, list[Node]] = {}
    for n in nodes:
        columns.setdefault(depth[n.id], []).append(n)
    box_w, box_h, gap_x, gap_y = 190, 44, 50, 16
    top = 40  # room for the arcs of edges that skip a generation
    pos = {n.id: (10 + d * (box_w + gap_x), top + i * (box_h + gap_y)) for d, col in columns.items() for i, n in enumerate(col)}
    width = 20 + len(columns) * (box_w + gap_x)
    height = top + 10 + max(len(c) for c in columns.values()) * (box_h + gap_y)
    chain = {n.id for n in nodes if n.chain}
    body = []
    for n in nodes:
        for p in n.parents:
            if p in pos:
                (px, py), (cx, cy) = pos[p], pos[n.id]
                cls = "edge chain" if p in chain and n.chain else "edge"
                if depth[n.id] - depth[p] > 1:  # over the boxes between: top centre to top centre, arched
                    lift = min(py, cy) - top + 8 + 10 * (depth[n.id] - depth[p])
                    d = (f"M{px + box_w / 2},{py} C{px + box_w / 2},{py - lift} {cx + box_w / 2},{cy - lift} "
                         f"{cx + box_w / 2},{cy}")
                else:
                    d = (f"M{px + box_w},{py + box_h / 2} C{px + box_w + gap_x / 2},{py + box_h / 2} "
                         f"{cx - gap_x / 2},{cy + box_h / 2} {cx},{cy + box_h / 2}")
                body.append(f'<path class="mark {cls}" d="{d}"/>')
    for n in nodes:
        bx, by = pos[n.id]
        cls = "node chain" if n.chain else "node"
        body.append(f'<a href="#artifact-{n.id}"><g class="mark {cls}"><rect x="{bx}" y="{by}" width="{box_w}" '
                    f'height="{box_h}" rx="6"/>{_text(bx + 8, by + 18, n.title[:30], "node-title")}'
                    f'{_text(bx + 8, by + 35, n.detail[:34], "node-detail")}<title>{escape(n.title)}: '
                    f'{escape(n.detail)}</title></g></a>')
    return _svg("lineage", width, height, body, caption)


def deltas(rows: list[DeltaRow], caption: str) -> str:
    """One row per bar: the delta's CI as a whisker over the noise-floor band, the threshold dashed."""
    width, row_h, left = 760, 34, 260
    values = [0.0] + [v for r in rows for v in (r.delta, r.threshold, r.floor, -(r.floor or 0)) if v is not None]
    values += [c for r in rows if r.ci for c in r.ci]
    span = max(abs(v) for v in values) or 1.0
    x = _Scale(-span * 1.1, span * 1.1, left, width - 70)
    height = 40 + row_h * len(rows)
    body = [f'<line class="zero" x1="{x(0):.1f}" y1="8" x2="{x(0):.1f}" y2="{height - 28}"/>']
    for t in nice_ticks(x.lo, x.hi):
        body.append(_text(x(t), height - 10, _fmt(t), "tick", "middle"))
    for i, r in enumerate(rows):
        cy = 20 + i * row_h
        body.append(_text(8, cy + 4, r.label[:40], "row-label"))
        if r.floor is not None:
            body.append(f'<rect class="mark band" x="{x(-r.floor):.1f}" y="{cy - 10}" width="{x(r.floor) - x(-r.floor):.1f}" '
                        f'height="20"><title>noise floor +/- {_fmt(r.floor)}</title></rect>')
        if r.threshold is not None:
            body.append(f'<line class="threshold" x1="{x(r.threshold):.1f}" y1="{cy - 12}" x2="{x(r.threshold):.1f}" '
                        f'y2="{cy + 12}"><title>threshold {_fmt(r.threshold)}</title></line>')
        if r.ci is not None:
            body.append(f'<line class="mark ci" x1="{x(r.ci[0]):.1f}" y1="{cy}" x2="{x(r.ci[1]):.1f}" y2="{cy}">'
                        f'<title>95% CI [{_fmt(r.ci[0])}, {_fmt(r.ci[1])}]</title></line>')
        if r.delta is not None:
            body.append(f'<circle class="mark delta" cx="{x(r.delta):.1f}" cy="{cy}" r="4"><title>delta '
                        f'{_fmt(r.delta)}</title></circle>')
        verdict = "holds" if r.holds else "fails"
        body.append(_text(width - 8, cy + 4, verdict, f"verdict {verdict}", "end"))
    return _svg("deltas", width, height, body, caption)


def dose_curve(series: dict[str, list[DosePoint]], caption: str) -> str:
    """Metric against alpha, one line per suite/metric, the chosen point ringed."""
    width, height = 760, 280
    points = [p for ps in series.values() for p in ps]
    if not points:
        return _svg("dose", width, 40, [_text(8, 24, "no evaluated dose point", "empty")], caption)
    lo_a, hi_a = min(0.0, *(p.alpha for p in points)), max(1.0, *(p.alpha for p in points))
    lo_v, hi_v = min(p.value for p in points), max(p.value for p in points)
    pad = (hi_v - lo_v) * 0.1 or 0.05
    x, y = _Scale(lo_a, hi_a, 70, width - 170), _Scale(lo_v - pad, hi_v + pad, height - 45, 15)
    body = _axes(x, y, "alpha (0 = start model, 1 = end model)", "metric")
    palette = ["#0072B2", "#009E73", "#E69F00", "#56B4E9", "#F0E442", "#000000"]
    for i, (name, ps) in enumerate(series.items()):
        colour, ps = palette[i % len(palette)], sorted(ps, key=lambda p: p.alpha)
        path = " ".join(f"{'M' if j == 0 else 'L'}{x(p.alpha):.1f},{y(p.value):.1f}" for j, p in enumerate(ps))
        body.append(f'<path class="mark curve" stroke="{colour}" d="{path}"/>')
        for p in ps:
            body.append(f'<a href="#artifact-{p.artifact_id}"><circle class="mark dot" fill="{colour}" cx="{x(p.alpha):.1f}" '
                        f'cy="{y(p.value):.1f}" r="4"><title>{escape(name)} at alpha {_fmt(p.alpha)}: {_fmt(p.value)} '
                        f'(#{p.artifact_id})</title></circle></a>')
            if p.chosen:
                body += [f'<circle class="mark chosen" cx="{x(p.alpha):.1f}" cy="{y(p.value):.1f}" r="9"/>',
                         _text(x(p.alpha) + 11, y(p.value) - 8, "chosen", "note")]
        body += [f'<rect x="{width - 160}" y="{14 + i * 16}" width="12" height="4" fill="{colour}"/>',
                 _text(width - 144, 20 + i * 16, name[:22], "legend")]
    return _svg("dose", width, height, body, caption)
