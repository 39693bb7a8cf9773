"""The HTML report: one self-contained file with a plot and a text diff per sequence.

Longer than 400 lines because it is one self-contained page: template, styles and SVG plots together, so the report needs no other file.

Knows how to lay out verdicts, their per-step series and both sides' token
strings as HTML + inline SVG; judges nothing. No scripts, fonts or stylesheets
are loaded from anywhere (the machines it runs on have no network), and every
piece of text from the runs is escaped (tokens can hold ``<``, ``&``, quotes).

Page: a header with the overall verdict and ``meta``; a summary (one row per
case, one row per sequence, linking to its section); then one section per
sequence, worst first, with

- a plot over steps: the top panel is the divergence curve (the first present
  of ``forced_kl``, ``kl``, ``forced_dlogprob``, ``dlogprob``: the forced path
  is preferred because it compares both engines on the same tokens at every
  step), the bottom panel the reference NLL of the candidate's tokens
  (``ref_nll_candidate``) beside that of the reference's own tokens
  (``ref_nll_reference``); dashed t* and solid onset markers cross both;
- both texts side by side from the divergence: the shared prefix plain (its
  tail; the whole prefix in a fold), the divergent parts highlighted, and the
  candidate's tokens from the onset on marked as gibberish. Hovering a
  divergent token shows its step.

Size stays bounded: curves are decimated to min/max per pixel bucket (spikes
survive) and texts are capped (`HEAD_TOKENS`, `ONSET_TOKENS`, `PREFIX_TAIL_CHARS`).
"""

from __future__ import annotations

import html
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from diffcheck.report import (
    ReportInput,
    SequenceTexts,
    atomic_write_text,
    case_baselines,
    config_delta_lines,
    printable,
)
from diffcheck.core.types import CaseVerdict, SequenceVerdict, Verdict

# Distinctive colours: the browser test finds the curves in a screenshot by them.
DIVERGENCE_COLOUR = "#e6007e"  # magenta
NLL_CANDIDATE_COLOUR = "#0050ff"  # blue
NLL_REFERENCE_COLOUR = "#20a040"  # green
T_STAR_COLOUR = "#ff8c00"  # orange
ONSET_COLOUR = "#c00000"  # dark red

DIVERGENCE_SERIES = (
    ("forced_kl", "KL, forced on reference tokens"),
    ("kl", "KL"),
    ("forced_dlogprob", "Δlogprob, forced on reference tokens"),
    ("dlogprob", "Δlogprob"),
)
NLL_SERIES = (
    ("ref_nll_candidate", "reference NLL of candidate tokens", NLL_CANDIDATE_COLOUR),
    ("ref_nll_reference", "reference NLL of reference tokens", NLL_REFERENCE_COLOUR),
)

# Divergent tokens shown per side: the first HEAD_TOKENS after t*, and when the
# onset is further on, ONSET_CONTEXT before it and ONSET_TOKENS from it.
HEAD_TOKENS = 200
ONSET_CONTEXT = 20
ONSET_TOKENS = 200
PREFIX_TAIL_CHARS = 400
PREFIX_FULL_CHARS = 20_000

VERDICT_COLOURS = {
    Verdict.IDENTICAL: "#1b7f3b",
    Verdict.BENIGN_DRIFT: "#0b7285",
    Verdict.WITHIN_BUDGET: "#8a6d00",
    Verdict.DEGRADED: "#c45500",
    Verdict.GIBBERISH: "#c00000",
    Verdict.ERROR: "#862e9c",
}

# Plot geometry (SVG user units; the SVG scales to the page width).
_W, _LEFT, _RIGHT = 960, 64, 16
_LEGEND_H, _PANEL_H, _GAP, _AXIS_H = 28, 140, 34, 36
_BUCKET_PX = 3.0


def _e(value: Any) -> str:
    return html.escape(printable(value), quote=True)


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, (float, np.floating)):
        f = float(value)
        return "–" if math.isnan(f) else f"{f:.4g}"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, default=str, ensure_ascii=False)
    return str(value)


def _badge(verdict: Verdict) -> str:
    return f'<span class="badge" style="background:{VERDICT_COLOURS[verdict]}">{verdict.name}</span>'


# ---------------------------------------------------------------- plot


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    span = hi - lo
    if span <= 0 or not math.isfinite(span):
        return [lo]
    raw = span / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        ticks.append(0.0 if abs(t) < step * 1e-9 else t)
        t += step
    return ticks


def _path_d(x: np.ndarray, y: np.ndarray) -> str:
    """SVG path data through finite points, broken at NaN, min/max-decimated per bucket."""
    valid = np.isfinite(y)
    idx = np.flatnonzero(valid)
    if idx.size == 0:
        return ""
    parts = []
    for segment in np.split(idx, np.flatnonzero(np.diff(idx) > 1) + 1):
        xs, ys = x[segment], y[segment]
        if xs.size > 2 * (xs[-1] - xs[0]) / _BUCKET_PX + 4:
            bucket = np.floor((xs - xs[0]) / _BUCKET_PX).astype(np.int64)
            starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
            keep = []
            for a, b in zip(starts, np.r_[starts[1:], xs.size]):
                lo, hi = a + int(np.argmin(ys[a:b])), a + int(np.argmax(ys[a:b]))
                keep += sorted({lo, hi})
            xs, ys = xs[keep], ys[keep]
        points = " L".join(f"{px:.1f},{py:.1f}" for px, py in zip(xs, ys))
        parts.append("M" + points if xs.size > 1 else f"M{xs[0]:.1f},{ys[0]:.1f} h0.01")
    return " ".join(parts)


def _series(sequence: SequenceVerdict, name: str) -> np.ndarray | None:
    values = sequence.series.get(name)
    if values is None:
        return None
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    return array if np.isfinite(array).any() or np.isinf(array).any() else None


def _panel(
    *, top: float, curves: list[tuple[np.ndarray, str, str]], x_of, title: str
) -> list[str]:
    """One panel: frame, y ticks and grid, and a <path> per curve."""
    finite = np.concatenate([c[np.isfinite(c)] for c, _, _ in curves])
    lo = min(0.0, float(finite.min())) if finite.size else 0.0
    hi = float(finite.max()) if finite.size else 1.0
    if hi - lo < 1e-12:
        hi = lo + (abs(lo) * 0.1 or 1.0)
    hi += (hi - lo) * 0.05
    bottom = top + _PANEL_H

    def y_of(values):
        clipped = np.clip(values, lo, hi)  # ±inf stay visible at the panel edge
        return bottom - (clipped - lo) / (hi - lo) * _PANEL_H

    out = [f'<rect x="{_LEFT}" y="{top}" width="{_W - _LEFT - _RIGHT}" height="{_PANEL_H}" class="frame"/>']
    for tick in _nice_ticks(lo, hi):
        ty = float(y_of(np.array(tick)))
        out.append(f'<line x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{ty:.1f}" y2="{ty:.1f}" class="grid"/>')
        out.append(f'<text x="{_LEFT - 6}" y="{ty + 4:.1f}" class="ytick">{tick:.4g}</text>')
    out.append(
        f'<text x="14" y="{top + _PANEL_H / 2:.0f}" class="ylabel" '
        f'transform="rotate(-90 14 {top + _PANEL_H / 2:.0f})">{_e(title)}</text>'
    )
    for values, colour, css in curves:
        d = _path_d(x_of(np.arange(values.size)), y_of(values))
        if d:
            out.append(f'<path d="{d}" class="curve {css}" stroke="{colour}"/>')
    return out


def plot_svg(sequence: SequenceVerdict) -> str:
    """The inline SVG plot of one sequence's series; "" when it has none to draw."""
    present = ((_series(sequence, name), label) for name, label in DIVERGENCE_SERIES)
    divergence = next(((values, label) for values, label in present if values is not None), None)
    nll = [(_series(sequence, name), label, colour, name) for name, label, colour in NLL_SERIES]
    nll = [item for item in nll if item[0] is not None]
    if divergence is None and not nll:
        return ""
    lengths = [divergence[0].size] if divergence else []
    lengths += [item[0].size for item in nll]
    n_steps = max(lengths + [sequence.reference_len, sequence.candidate_len, 2])
    plot_w = _W - _LEFT - _RIGHT

    def x_of(steps):
        return _LEFT + np.asarray(steps, dtype=np.float64) / (n_steps - 1) * plot_w

    panels, legend = [], []
    top = _LEGEND_H
    if divergence is not None:
        panels += _panel(
            top=top, curves=[(divergence[0], DIVERGENCE_COLOUR, "divergence")], x_of=x_of,
            title="KL" if "KL" in divergence[1] else "Δlogprob",
        )
        legend.append((divergence[1], DIVERGENCE_COLOUR, ""))
        top += _PANEL_H + _GAP
    if nll:
        panels += _panel(
            top=top, curves=[(v, colour, name.replace("_", "-")) for v, _, colour, name in nll], x_of=x_of,
            title="NLL (nats)",
        )
        legend += [(label, colour, "") for _, label, colour, _ in nll]
        top += _PANEL_H + _GAP
    plot_bottom = top - _GAP
    height = plot_bottom + _AXIS_H

    out = [
        f'<svg class="plot" viewBox="0 0 {_W} {height:.0f}" width="{_W}" height="{height:.0f}" '
        f'xmlns="http://www.w3.org/2000/svg" role="img">',
        f"<title>seq {sequence.index}: per-step curves</title>",
        *panels,
    ]
    for tick in _nice_ticks(0, n_steps - 1, 8):
        tx = float(x_of(tick))
        out.append(f'<line x1="{tx:.1f}" x2="{tx:.1f}" y1="{plot_bottom}" y2="{plot_bottom + 4}" class="axis"/>')
        out.append(f'<text x="{tx:.1f}" y="{plot_bottom + 16}" class="xtick">{int(round(tick))}</text>')
    out.append(f'<text x="{_LEFT + plot_w / 2:.0f}" y="{plot_bottom + 32}" class="xlabel">step</text>')
    for step, label, colour, dash, dy in (
        (sequence.t_star, "t*", T_STAR_COLOUR, "6 4", 0),
        (sequence.onset, "onset", ONSET_COLOUR, "", 12 if sequence.onset == sequence.t_star else 0),
    ):
        if step is None:
            continue
        mx = float(x_of(min(step, n_steps - 1)))
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(
            f'<line x1="{mx:.1f}" x2="{mx:.1f}" y1="{_LEGEND_H}" y2="{plot_bottom}" '
            f'stroke="{colour}" class="marker"{dash_attr}/>'
        )
        # Near the right edge the label goes left of its line so it stays inside the plot.
        anchor, tx = ("end", mx - 3) if mx > _W - _RIGHT - 80 else ("start", mx + 3)
        out.append(
            f'<text x="{tx:.1f}" y="{_LEGEND_H + 11 + dy}" fill="{colour}" class="mlabel" '
            f'text-anchor="{anchor}">{label}={step}</text>'
        )
        legend.append((label, colour, dash))
    x = _LEFT
    for label, colour, dash in legend:
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<line x1="{x}" x2="{x + 22}" y1="12" y2="12" stroke="{colour}" class="swatch"{dash_attr}/>')
        out.append(f'<text x="{x + 27}" y="16" class="legend">{_e(label)}</text>')
        x += 36 + 6.5 * len(label)
    out.append("</svg>")
    return "\n".join(out)


# ---------------------------------------------------------------- texts


def _windows(n: int, *, first_step: int | None, onset: int | None) -> list[tuple[int, int]]:
    """Which divergent tokens to show: the start, plus the onset's neighbourhood when far."""
    if first_step is not None and onset is not None and onset - first_step > HEAD_TOKENS + ONSET_CONTEXT:
        at = onset - first_step
        return [(0, min(n, HEAD_TOKENS)), (min(n, at - ONSET_CONTEXT), min(n, at + ONSET_TOKENS))]
    return [(0, min(n, HEAD_TOKENS + ONSET_CONTEXT + ONSET_TOKENS))]


def _token_spans(tokens: tuple[str, ...], *, first_step: int | None, onset: int | None, mark_onset: bool) -> str:
    """Divergent tokens as spans titled with their step; with ``mark_onset``, class "g" from the onset on.

    Both sides get the same windows so they stay side by side.
    """
    if first_step is None:  # one whole text: no steps to show
        return "".join(f'<span class="div">{_e(token)}</span>' for token in tokens[:1])
    parts, shown_to = [], 0
    for a, b in _windows(len(tokens), first_step=first_step, onset=onset):
        if a > shown_to:
            parts.append(f'<span class="elided"> … {a - shown_to} tokens … </span>')
        for i in range(a, b):
            step = first_step + i
            gib = ' class="g"' if mark_onset and onset is not None and step >= onset else ""
            parts.append(f'<span{gib} title="step {step}">{_e(tokens[i])}</span>')
        shown_to = b
    if len(tokens) > shown_to:
        parts.append(f'<span class="elided"> … {len(tokens) - shown_to} more tokens</span>')
    return "".join(parts)


def texts_html(sequence: SequenceVerdict, texts: SequenceTexts | None) -> str:
    if texts is None:
        return '<p class="note">No texts were given for this sequence.</p>'
    if sequence.t_star is None and texts.reference_tokens == texts.candidate_tokens:
        body = _e("".join(texts.reference_tokens)[:PREFIX_FULL_CHARS])
        return f'<details><summary>text (identical on both sides)</summary><pre class="text">{body}</pre></details>'
    split = texts.split(sequence.shared_prefix)
    prefix = "".join(split.prefix)
    unit = f"{len(split.prefix)} tokens" if texts.tokenized else f"{len(prefix)} characters"
    tail = prefix[-PREFIX_TAIL_CHARS:]
    tail_html = ('<span class="elided">…</span>' if len(tail) < len(prefix) else "") + _e(tail)
    cut = split.cut_step
    columns = []
    for label, rest, css in (("reference", split.reference_rest, "ref"), ("candidate", split.candidate_rest, "cand")):
        end = "" if rest else '<span class="elided">(ends here)</span>'
        # Gibberish is the candidate's; the reference only shares the windows.
        spans = _token_spans(rest, first_step=cut, onset=sequence.onset, mark_onset=css == "cand")
        size = f"{len(rest)} tokens" if texts.tokenized else f"{len(''.join(rest))} characters"
        columns.append(
            f'<div class="side"><h4>{label} ({size} after the prefix)</h4>'
            f'<pre class="text {css}"><span class="shared">{tail_html}</span>{spans}{end}</pre></div>'
        )
    full = _e(prefix[:PREFIX_FULL_CHARS]) + ('<span class="elided">…</span>' if len(prefix) > PREFIX_FULL_CHARS else "")
    return (
        f'<details class="prefix"><summary>shared prefix ({unit})</summary><pre class="text">{full}</pre></details>'
        f'<div class="sides">{"".join(columns)}</div>'
    )


# ---------------------------------------------------------------- page


def _kv_table(title: str, values: Mapping[str, Any]) -> str:
    if not values:
        return ""
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(_fmt(v))}</td></tr>" for k, v in values.items())
    return f'<table class="kv"><caption>{_e(title)}</caption>{rows}</table>'


def _anchor(case_index: int, sequence: SequenceVerdict) -> str:
    return f"c{case_index}-s{sequence.index}"


def _summary(report: ReportInput) -> str:
    case_rows, seq_rows = [], []
    for ci, case in enumerate(report.verdicts):
        counts: dict[str, int] = {}
        for s in case.sequences:
            counts[s.verdict.name] = counts.get(s.verdict.name, 0) + 1
        baselines = case_baselines(case)
        words = {None: "n/a", True: "pass", False: "fail"}
        delta = "<br>".join(_e(line) for line in config_delta_lines(case.config_delta)) or "–"
        error = f'<div class="error">{_e(case.error)}</div>' if case.error else ""
        case_rows.append(
            f"<tr><td>{_e(case.candidate_id)}</td><td>{_e(case.reference_id)}</td><td>{_badge(case.verdict)}{error}</td>"
            f"<td>{_e(', '.join(f'{k} {v}' for k, v in counts.items()) or '–')}</td>"
            f"<td>{words[baselines.get('exact_match')]}</td><td>{words[baselines.get('check_logprobs_close')]}</td>"
            f'<td class="delta">{delta}</td></tr>'
        )
        for s in case.sequences:
            q = s.quality
            seq_rows.append(
                f'<tr><td>{_e(case.candidate_id)}</td><td><a href="#{_anchor(ci, s)}">{s.index}</a></td>'
                f"<td>{_e(s.prompt_id)}</td><td>{_badge(s.verdict)}</td><td>{_fmt(s.t_star)}</td>"
                f'<td>{_fmt(s.onset)}</td><td class="ev">{_e(s.evidence[0] if s.evidence else "")}</td>'
                f"<td>{_e(_fmt(q.get('digit_ratio')))}</td><td>{_e(_fmt(q.get('weird_runs')))}</td>"
                f"<td>{_e(_fmt(q.get('token_count', s.candidate_len)))}</td></tr>"
            )
    return (
        '<section id="summary"><h2>Summary</h2><table class="grid"><tr><th>candidate</th><th>reference</th>'
        "<th>verdict</th><th>sequences</th><th>exact match</th><th>check_logprobs_close</th>"
        f"<th>config delta (reference → candidate)</th></tr>{''.join(case_rows)}</table>"
        '<table class="grid"><tr><th>case</th><th>seq</th><th>prompt_id</th><th>verdict</th><th>t*</th>'
        "<th>onset</th><th>key evidence</th><th>digit_ratio</th><th>weird_runs</th><th>tokens</th></tr>"
        f"{''.join(seq_rows)}</table></section>"
    )


def _sequence_section(report: ReportInput, ci: int, case: CaseVerdict, s: SequenceVerdict) -> str:
    evidence = "".join(f"<li>{_e(item)}</li>" for item in s.evidence)
    svg = plot_svg(s) or '<p class="note">No per-step series were recorded for this sequence.</p>'
    is_open = " open" if s.verdict is not Verdict.IDENTICAL else ""
    return (
        f'<details class="seq" id="{_anchor(ci, s)}"{is_open}><summary>{_badge(s.verdict)} '
        f"<b>{_e(case.candidate_id)}</b> seq {s.index} <code>{_e(s.prompt_id)}</code> "
        f"t*={_fmt(s.t_star)} onset={_fmt(s.onset)} · shared prefix {s.shared_prefix} · "
        f"tokens {s.reference_len} reference / {s.candidate_len} candidate</summary>"
        f'<ul class="evidence">{evidence}</ul><div class="plotbox">{svg}</div>'
        f"{texts_html(s, report.texts_for(case, s))}"
        f'<div class="kvs">{_kv_table("stats", s.stats)}{_kv_table("quality", s.quality)}'
        f'{_kv_table("baselines", s.baselines)}</div></details>'
    )


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:16px 24px;color:#1a1a1a;background:#fff}
h1{font-size:20px;margin:0 0 6px}h2{font-size:17px;margin:18px 0 6px}h4{margin:4px 0;font-size:13px}
.badge{color:#fff;border-radius:3px;padding:1px 6px;font-size:12px;font-weight:600}
table.grid{border-collapse:collapse;margin:6px 0 10px}
table.grid td,table.grid th{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}
td.ev{max-width:420px}td.delta{font-family:monospace;font-size:12px}.error{color:#862e9c}
dl.meta{display:grid;grid-template-columns:max-content 1fr;gap:0 12px;margin:0;font-size:12px;color:#555}
dl.meta dd{margin:0;font-family:monospace}
details.seq{border-top:2px solid #ddd;padding:6px 0;margin-top:8px}details.seq>summary{cursor:pointer}
.plotbox svg{max-width:100%;height:auto}
svg .frame{fill:none;stroke:#999}svg .grid{stroke:#eee}svg .axis{stroke:#999}
svg .curve{fill:none;stroke-width:2;stroke-linejoin:round;stroke-linecap:round}svg .marker{stroke-width:2}svg .swatch{stroke-width:3}
svg text{font:11px sans-serif;fill:#333}svg .ytick{text-anchor:end}
svg .xtick,svg .xlabel,svg .ylabel{text-anchor:middle}svg .mlabel{font-weight:600}
.sides{display:grid;grid-template-columns:1fr 1fr;gap:12px}
pre.text{white-space:pre-wrap;word-break:break-word;font:12px/1.45 monospace;background:#fafafa;
border:1px solid #e3e3e3;padding:6px;margin:4px 0;max-height:420px;overflow:auto}
.shared{color:#444}pre.ref span[title],pre.ref .div{background:#d9f2df}
pre.cand span[title],pre.cand .div{background:#fff0c2}pre.cand span.g{background:#ffc9c9}
pre.ref span[title]:nth-of-type(even){background:#c6ebcf}pre.cand span[title]:nth-of-type(even){background:#ffe69a}
pre.cand span.g:nth-of-type(even){background:#ffb0b0}
.elided{color:#888;font-style:italic}.note{color:#777}
table.kv{display:inline-table;border-collapse:collapse;margin:4px 16px 4px 0;font-size:12px;vertical-align:top}
table.kv caption{text-align:left;font-weight:600}table.kv th,table.kv td{padding:0 6px;text-align:left}
ul.evidence{margin:4px 0 6px;padding-left:20px}
"""


def _speed(report: ReportInput) -> str:
    """Decode tokens/s of the candidate and each reference, forced replays, and the speed-up."""
    speed = report.speed
    if not speed:
        return ""
    rows = []
    for run in speed.get("runs", ()):
        forced = "; ".join(
            f"{f['reference']} ({f['replay']}): {f['forced_tokens']}/{f['path_steps']} steps, "
            f"{_fmt(f['force_s'])} s, {_fmt(f['forced_tokens_per_s'])} tok/s"
            for f in run.get("forced", ()))  # fmt: skip
        rate = run["decode_tokens_per_s"]
        cells = (run["role"], run["case"], run["engine"], run["hardware"], _fmt(run["startup_s"]),
                 _fmt(run["generate_tokens"]), _fmt(run["generate_s"]), "–" if rate is None else f"{rate:.0f}",
                 forced or "–")  # fmt: skip
        rows.append("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("role", "case", "engine", "hardware", "start-up s", "tokens",
                                            "generate s", "decode tok/s", "forced replay"))  # fmt: skip
    ratios = []
    for r in speed.get("ratios", ()):
        if r.get("decode_speedup") is not None:
            hw = "" if r["same_hardware"] else " (different hardware: not comparable)"
            ratios.append(f"<li><b>{_e(r['candidate'])}</b> decodes <b>{r['decode_speedup']:.2f}x</b> as fast as "
                          f"<b>{_e(r['reference'])}</b>{_e(hw)}</li>")
    return (
        '<section id="speed"><h2>Speed</h2>'
        f'<table class="grid"><tr>{head}</tr>{"".join(rows)}</table>'
        f"<ul>{''.join(ratios)}</ul><p class=\"note\">{_e(speed.get('note', ''))}</p></section>"
    )


def render_html(report: ReportInput | Iterable[CaseVerdict]) -> str:
    """The whole report page as a string."""
    if not isinstance(report, ReportInput):
        report = ReportInput(verdicts=tuple(report))
    overall = Verdict.worst(c.verdict for c in report.verdicts)
    meta = "".join(f"<dt>{_e(k)}</dt><dd>{_e(_fmt(v))}</dd>" for k, v in report.meta.items())
    sections = []
    for ci, case in enumerate(report.verdicts):
        order = sorted(case.sequences, key=lambda s: (-s.verdict.severity, s.index))
        sections += [_sequence_section(report, ci, case, s) for s in order]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>diffcheck report: {overall.name}</title><style>{_CSS}</style></head><body>"
        f"<header><h1>diffcheck report {_badge(overall)}</h1><dl class=\"meta\">{meta}</dl></header>"
        f"{_summary(report)}{_speed(report)}"
        f"<section id=\"sequences\"><h2>Sequences (worst first)</h2>{''.join(sections)}</section>"
        "</body></html>\n"
    )


def write_html(path: str | os.PathLike, report: ReportInput | Iterable[CaseVerdict]) -> Path:
    """Write the self-contained HTML report atomically; returns the path."""
    return atomic_write_text(path, render_html(report))
