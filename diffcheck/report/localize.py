"""The report of `diffcheck localize`: the terminal table, the JSON document and the HTML heatmap.

Knows a `LocalizeReport`: a `diffcheck.judging.localize.Localization` (the first site beyond
its floor, the worst others, the per-site floors) and how it was reached (the onset step and
its source, the capture times). Judges nothing: the one thing the heatmap derives is the own or
inherited mark of the cells no finding judged, by the judging's rule (`site_inputs`) on the numbers
the map shows (`_causes`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from diffcheck.judging.localize import OPS, site_inputs, site_label
from diffcheck.report import escape_html as _e


@dataclass(frozen=True)
class LocalizeReport:
    localization: Any  # diffcheck.judging.localize.Localization
    step: int
    around: int
    onset_source: str
    timings: dict = field(default_factory=dict)  # seconds per captured configuration (forced replay with taps)
    kind: ClassVar[str] = "localize"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "step": self.step, "around": self.around, "onset_source": self.onset_source,
                "capture_s": dict(self.timings), **self.localization.to_dict()}


def _cause(f) -> str:
    return "inherited a bad input" if f.inherited else "in this op (its inputs inside their floors)"


# The report's sentences, plain text: the terminal escapes them for rich, the HTML page for HTML.

def _header_text(report: LocalizeReport) -> str:
    loc = report.localization
    return (f"localize {loc.candidate} against {loc.reference}: steps {loc.steps[0]}..{loc.steps[-1]} "
            f"(onset {report.step}, from {report.onset_source}); floor from "
            f"{', '.join(loc.floor_replicas) or 'no replica'}; beyond = relative error > "
            f"max({loc.factor:g} x floor, {loc.minimum:g})")


NOTHING = "nothing beyond its floor"
NOTHING_TEXT = "no layer or op of the candidate left the reference's noise floor at these steps"
FIRST = "first beyond its floor"


def _first_text(f) -> str:
    return (f"step {f.step}, {f.site} (seq {f.seq}): relative error {f.relative_error:.3g}, {f.ratio:.3g}x its margin "
            f"{f.margin:.3g} (floor {f.floor:.3g}); {_cause(f)}")


def _inputs_text(f) -> str:
    return "its inputs at that step: " + "; ".join(
        f"{s} {e:.3g} ({'beyond' if e > m else 'inside'} margin {m:.3g})" for s, e, m in f.inputs)


def _count_text(loc) -> str:
    return f"{loc.beyond_sites} of {len(loc.sites)} sites beyond their floor at some step"


def _timings_text(report: LocalizeReport) -> str:
    return "capture time: " + ", ".join(f"{k} {v:.1f}s" for k, v in report.timings.items())


TABLE_COLUMNS = ("", "step", "site", "seq", "rel. error", "floor", "margin", "x margin", "cause")
_NUMERIC = ("step", "seq", "rel. error", "floor", "margin", "x margin")


def _table_rows(loc) -> list[tuple[str, Any, tuple[str, ...]]]:
    """(tag, finding, cells) of the first site and the worst others, as the terminal and the page show them."""
    rows = ([("first", loc.first)] if loc.first else []) + [(f"w{i}", f) for i, f in enumerate(loc.worst, 1)]
    return [(tag, f, (tag if tag == "first" else "", str(f.step), f.site, str(f.seq), f"{f.relative_error:.3g}",
                      f"{f.floor:.3g}", f"{f.margin:.3g}", f"{f.ratio:.3g}", "inherited" if f.inherited else "own"))
            for tag, f in rows]


def render_terminal(report: LocalizeReport, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    loc = report.localization
    console.print(escape(_header_text(report)))
    if loc.first is None:
        console.print(f"[green]{NOTHING}[/]: {escape(NOTHING_TEXT)}")
    else:
        console.print(f"[bold red]{FIRST}[/]: {escape(_first_text(loc.first))}")
    table = Table(title="first and worst sites", title_justify="left")
    for col in TABLE_COLUMNS:
        table.add_column(col, justify="right" if col in _NUMERIC else "left")
    rows = _table_rows(loc)
    for _, _, cells in rows:
        table.add_row(*(escape(c) for c in cells))
    if rows:
        console.print(table)
    if loc.first is not None and loc.first.inputs:
        console.print(escape(_inputs_text(loc.first)))
    console.print(escape(_count_text(loc)))
    for note in loc.notes:
        console.print(f"note: {escape(note)}")
    if report.timings:
        console.print(escape(_timings_text(report)))


def render_json(report: LocalizeReport) -> str:
    return json.dumps(report.to_dict(), indent=1, sort_keys=True) + "\n"


# ---------------------------------------------------------------- the HTML heatmap
#
# One self-contained page (no script, font or stylesheet from anywhere; the compare report's page
# style, `diffcheck.report.html`): the terminal's sentences, a legend, then per captured step a
# table with a row per site group (the embedding, then each decoder layer) and a column per op.
# A cell's colour is its relative error over its margin (the largest over the sequences at that
# step, `Localization.worst_by_step`) on a log scale: blues inside the margin, yellow to dark red
# beyond it. Its title holds the exact numbers.

OP_LABELS = {"input_layernorm": "in_ln", "self_attn": "attn", "post_attention_layernorm": "post_ln", "mlp": "mlp",
             "residual": "resid"}
LOG_LOW, LOG_HIGH = -4.0, 5.0  # the colour scale's ends, in log10(relative error / margin); clamped beyond
FIRST_COLOUR = "#e000e0"  # the outline of the first beyond cell: in no colour of the scale
ZERO_COLOUR = "#ffffff"  # relative error exactly 0: bit-identical
NA_COLOUR = "#d9d9d9"  # not captured on both sides
_INSIDE = ((0.0, (0xf3, 0xf6, 0xfa)), (1.0, (0x4f, 0x86, 0xc6)))
_BEYOND = ((0.0, (0xfd, 0xe6, 0x8a)), (0.3, (0xf9, 0x73, 0x16)), (0.65, (0xc0, 0x1c, 0x1c)), (1.0, (0x4a, 0x00, 0x00)))


def _interpolate(stops, t: float) -> tuple[int, int, int]:
    t = min(max(t, 0.0), 1.0)
    for (t0, c0), (t1, c1) in zip(stops, stops[1:]):
        if t <= t1:
            u = (t - t0) / (t1 - t0)
            return tuple(round(a + (b - a) * u) for a, b in zip(c0, c1))
    return stops[-1][1]


def ratio_colour(ratio: float | None) -> str:
    """The cell colour of relative error / margin: None not captured, 0 white, else the log scale."""
    if ratio is None or math.isnan(ratio):
        return NA_COLOUR
    if ratio <= 0:
        return ZERO_COLOUR
    log = math.log10(ratio) if math.isfinite(ratio) else LOG_HIGH
    rgb = (_interpolate(_INSIDE, (log - LOG_LOW) / -LOG_LOW) if ratio <= 1
           else _interpolate(_BEYOND, log / LOG_HIGH))
    return "#%02x%02x%02x" % rgb


def _dark(colour: str) -> bool:
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return 0.299 * r + 0.587 * g + 0.114 * b < 140


def _num(x: float) -> str:
    return f"{x:.6g}"


def _causes(loc):
    """Per [step, site] of every beyond cell: (inherited, judged seq or None).

    The first site and the worst others carry the judged cause (`Finding.inherited`, per
    sequence). Every other beyond cell gets the same rule applied to the numbers the map shows
    (the largest over the sequences): inherited when one of its inputs is beyond at that step,
    or, for an attention, its input at an earlier captured step.
    """
    beyond = np.nan_to_num(loc.worst_by_step, nan=0.0) > loc.margins
    names = loc.sites
    causes: dict[tuple[int, int], tuple[bool, int | None]] = {}
    for k, i in np.argwhere(beyond):
        inputs = site_inputs(int(i))
        inherited = any(beyond[k, j] for j in inputs)
        if names[i][1] == "self_attn":
            inherited |= bool(beyond[:k, inputs[0]].any())
        causes[(int(k), int(i))] = (bool(inherited), None)
    for f in ([loc.first] if loc.first else []) + list(loc.worst):
        causes[(loc.steps.index(f.step), names.index((f.layer, f.op)))] = (f.inherited, f.seq)
    return beyond, causes


def _cell(loc, k: int, i: int, beyond, causes, tags) -> str:
    layer, op = loc.sites[i]
    value = loc.worst_by_step[k, i]
    margin, floor = float(loc.margins[i]), float(loc.floors[i])
    site = site_label(layer, op)
    lines = [f"step {loc.steps[k]} · {site}"]
    classes = ["cell"]
    if value is None or math.isnan(value):
        ratio = None
        lines.append("not captured")
        classes.append("na")
    else:
        value = float(value)
        ratio = value / margin if margin else math.inf
        lines += [f"relative error {_num(value)} (the largest over the sequences)",
                  f"floor {_num(floor)} · margin {_num(margin)} · {_num(ratio)} x margin"]
    tag = tags.get((k, i))
    if beyond[k, i]:
        inherited, seq = causes[(k, i)]
        if seq is not None:
            lines.append(f"beyond its margin: {'inherited a bad input' if inherited else 'in this op'} "
                         f"(judged, sequence {seq})")
        else:
            lines.append("beyond its margin: " + ("inherited (an input is beyond too in these numbers)" if inherited
                                                  else "own (its inputs inside their margins in these numbers)"))
        classes += ["beyond", "inherited" if inherited else "own"]
    elif ratio is not None:
        lines.append("inside its margin" if ratio else "inside its margin (bit-identical)")
    if tag == "first":
        classes.append("first")
        lines.insert(0, "FIRST BEYOND ITS FLOOR")
    elif tag:
        lines.insert(0, f"worst other site {tag}")
    colour = ratio_colour(ratio)
    if _dark(colour):
        classes.append("dark")
    label = {"first": "1st"}.get(tag, tag or "")
    return (f'<td class="{" ".join(classes)}" data-site="{_e(site)}" data-step="{loc.steps[k]}" '
            f'style="background-color:{colour}" title="{_e(chr(10).join(lines))}">{_e(label)}</td>')


def _heatmap(report: LocalizeReport, k: int, beyond, causes, tags) -> str:
    loc = report.localization
    step = loc.steps[k]
    notes = []
    if step == report.step:
        notes.append("onset")
    if loc.first is not None and loc.first.step == step:
        notes.append("first beyond")
    n_beyond = int(beyond[k].sum())
    head = "".join(f'<th title="{_e(op)}">{_e(OP_LABELS[op])}</th>' for op in OPS)
    rows = []
    embed = f'<td class="void" colspan="{len(OPS) - 1}"></td>' + _cell(loc, k, 0, beyond, causes, tags)
    rows.append(f'<tr><th class="row" title="the embedding output: the stream into layer 0">embed</th>{embed}</tr>')
    for layer in range(loc.n_layers):
        cells = "".join(_cell(loc, k, 1 + layer * len(OPS) + j, beyond, causes, tags) for j in range(len(OPS)))
        rows.append(f'<tr><th class="row">{layer}</th>{cells}</tr>')
    caption = f"step {step}" + (f" ({', '.join(notes)})" if notes else "")
    return (f'<div class="step" id="step-{step}"><table class="heat"><caption>{_e(caption)}'
            f'<br><span class="sub">{n_beyond} beyond</span></caption>'
            f'<thead><tr><th class="row">layer</th>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></div>')


def _legend() -> str:
    n = 45
    bar = "".join(f'<span style="background:{ratio_colour(10 ** (LOG_LOW + (LOG_HIGH - LOG_LOW) * (j + 0.5) / n))}">'
                  "</span>" for j in range(n))
    ticks = "".join(f'<span style="left:{(p - LOG_LOW) / (LOG_HIGH - LOG_LOW) * 100:.2f}%">'
                    f'{"margin" if p == 0 else f"1e{p:+d}".replace("+", "")}</span>'
                    for p in range(int(LOG_LOW), int(LOG_HIGH) + 1))
    ops = ", ".join(f"{OP_LABELS[op]} = {op}" for op in OP_LABELS)
    swatch = '<span class="sw {cls}" style="background-color:{c}">{t}</span>'
    return (
        '<section id="legend"><h2>Legend</h2>'
        '<p>Colour: relative error / margin, the largest over the sequences at that step, on a log scale '
        f"(clamped to 1e{int(LOG_LOW)}..1e{int(LOG_HIGH)}); blue is inside the margin, yellow to dark red beyond it. "
        "Hover a cell for its exact numbers.</p>"
        f'<div class="bar">{bar}</div><div class="ticks">{ticks}</div>'
        '<ul class="keys">'
        f'<li>{swatch.format(cls="cell first", c=ratio_colour(1e4), t="1st")} the first site beyond its floor '
        "(in model order: steps, then the embedding and layer by layer)</li>"
        f'<li>{swatch.format(cls="cell beyond own", c=ratio_colour(1e3), t="")} beyond, own: its inputs inside '
        "their margins</li>"
        f'<li>{swatch.format(cls="cell beyond inherited", c=ratio_colour(1e3), t="")} beyond, hatched: inherited '
        "(an input beyond too at that step, or for an attention at an earlier one)</li>"
        f'<li>{swatch.format(cls="cell", c=ratio_colour(1e3), t="w1")} the worst other sites, as in the table below '
        "(their cause is judged per sequence; other cells' from the numbers shown)</li>"
        f'<li>{swatch.format(cls="cell", c=ZERO_COLOUR, t="")} exactly 0 (bit-identical) '
        f'{swatch.format(cls="cell na", c=NA_COLOUR, t="")} not captured</li>'
        f"<li>columns: {_e(ops)}</li></ul></section>"
    )


def _findings_table(loc) -> str:
    rows = _table_rows(loc)
    if not rows:
        return ""
    head = "".join(f"<th>{_e(c)}</th>" for c in TABLE_COLUMNS)
    body = "".join(
        f'<tr class="{_e(tag)}">' + "".join(
            f'<td class="{"num" if col in _NUMERIC else ""}">'
            + (f'<a href="#step-{f.step}">{_e(cell)}</a>' if col == "step" else _e(cell)) + "</td>"
            for col, cell in zip(TABLE_COLUMNS, cells)) + "</tr>"
        for tag, f, cells in rows)
    return (f'<section id="sites"><h2>First and worst sites</h2><table class="grid findings"><tr>{head}</tr>{body}'
            "</table></section>")


_HEAT_CSS = """
.lines{margin:4px 0 8px;padding:0;list-style:none;font-size:13px}.lines li{margin:2px 0}
.lines .verdict{font-weight:600}.ok{color:#1b7f3b}.bad{color:#c00000}
.maps{display:flex;flex-wrap:wrap;gap:14px;align-items:flex-start}
table.heat{border-collapse:separate;border-spacing:1px;font-size:10px}
table.heat caption{font-weight:600;font-size:13px;text-align:left;padding-bottom:2px}
table.heat .sub{font-weight:400;color:#666;font-size:11px}
table.heat th{font-weight:500;color:#444;padding:0 3px}table.heat th.row{text-align:right}
td.cell{width:30px;height:14px;padding:0;text-align:center;font:600 9px/14px monospace;color:#222;
border:1px solid #e2e2e2;box-sizing:border-box}
td.cell.dark{color:#fff}td.void{background:none;border:none}
td.cell.inherited{background-image:repeating-linear-gradient(135deg,rgba(255,255,255,.6) 0 2px,transparent 2px 6px)}
td.cell.na{background-image:repeating-linear-gradient(45deg,#bbb 0 1px,transparent 1px 4px)}
td.cell.first{outline:3px solid FIRST;outline-offset:0;position:relative;z-index:1}
.bar{display:flex;width:540px;height:14px;border:1px solid #bbb}.bar span{flex:1}
.ticks{position:relative;width:540px;height:16px;font-size:11px;color:#444}
.ticks span{position:absolute;transform:translateX(-50%)}
ul.keys{list-style:none;padding:0;margin:8px 0;font-size:13px}ul.keys li{margin:3px 0}
.sw{display:inline-block;width:30px;height:14px;vertical-align:middle;text-align:center;font:600 9px/14px monospace;
border:1px solid #e2e2e2;box-sizing:border-box;margin-right:4px}
.sw.inherited{background-image:repeating-linear-gradient(135deg,rgba(255,255,255,.6) 0 2px,transparent 2px 6px)}
.sw.na{background-image:repeating-linear-gradient(45deg,#bbb 0 1px,transparent 1px 4px)}
.sw.first{outline:3px solid FIRST;color:#fff}
table.findings td.num{text-align:right}table.findings tr.first td{font-weight:600}
""".replace("FIRST", FIRST_COLOUR)


def render_html(report: LocalizeReport) -> str:
    """The heatmap page (layer x op, one map per captured step) as one self-contained HTML string."""
    from diffcheck.report.html import _CSS  # the compare report's page style: one look for diffcheck's pages

    loc = report.localization
    beyond, causes = _causes(loc)
    names = loc.sites
    tags = {}
    for n, f in enumerate(loc.worst, 1):
        tags[(loc.steps.index(f.step), names.index((f.layer, f.op)))] = f"w{n}"
    if loc.first is not None:
        tags[(loc.steps.index(loc.first.step), names.index((loc.first.layer, loc.first.op)))] = "first"
    if loc.first is None:
        badge, verdict = ('<span class="badge" style="background:#1b7f3b">nothing beyond its floor</span>',
                          f'<li class="verdict"><span class="ok">{NOTHING}</span>: {_e(NOTHING_TEXT)}</li>')
    else:
        badge = f'<span class="badge" style="background:#c00000">first beyond: {_e(loc.first.site)}</span>'
        verdict = f'<li class="verdict"><span class="bad">{FIRST}</span>: {_e(_first_text(loc.first))}</li>'
    lines = [f"<li>{_e(_header_text(report))}</li>", verdict]
    if loc.first is not None and loc.first.inputs:
        lines.append(f"<li>{_e(_inputs_text(loc.first))}</li>")
    lines.append(f"<li>{_e(_count_text(loc))}</li>")
    lines += [f"<li>note: {_e(note)}</li>" for note in loc.notes]
    if report.timings:
        lines.append(f"<li>{_e(_timings_text(report))}</li>")
    maps = "".join(_heatmap(report, k, beyond, causes, tags) for k in range(len(loc.steps)))
    title = f"diffcheck localize {loc.candidate} against {loc.reference}"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>{_CSS}{_HEAT_CSS}</style></head><body>"
        f'<header><h1>{_e(title)} {badge}</h1><ul class="lines">{"".join(lines)}</ul></header>'
        f"{_legend()}"
        f'<section id="heatmaps"><h2>Layer × op, per captured step</h2><div class="maps">{maps}</div></section>'
        f"{_findings_table(loc)}</body></html>\n"
    )
