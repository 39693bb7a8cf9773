"""The HTML report: one self-contained file with a plot and a text diff per sequence.

Knows how to lay out verdicts and both sides' token strings as HTML, with each
sequence's plot from `diffcheck.report.plot` inline; judges nothing. No scripts,
fonts or stylesheets are loaded from anywhere (the machines it runs on have no
network), and every piece of text from the runs is escaped (tokens can hold
``<``, ``&``, quotes).

Page: a header with the overall verdict and ``meta``; a summary (one row per
case, one row per sequence, linking to its section); then one section per
sequence, worst first, with

- the plot over steps (`diffcheck.report.plot.plot_svg`): divergence curve, the
  reference NLL of both sides' tokens, t* and onset markers;
- both texts side by side from the divergence: the shared prefix plain (its
  tail; the whole prefix in a fold), the divergent parts highlighted, and the
  candidate's tokens from the onset on marked as gibberish. Hovering a
  divergent token shows its step.

Size stays bounded: texts are capped (`HEAD_TOKENS`, `ONSET_TOKENS`,
`PREFIX_TAIL_CHARS`) and the plot decimates its curves.

`render_report` is the registry's renderer (`diffcheck.report.registry`): the page
of any result that has verdicts (a comparison, a matrix).
"""

from __future__ import annotations

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
)
from diffcheck.report import escape_html as _e
from diffcheck.report.plot import plot_svg
from diffcheck.core.types import CaseVerdict, SequenceVerdict, Verdict

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
    Verdict.INCONCLUSIVE: "#5c5f66",
    Verdict.DEGRADED: "#c45500",
    Verdict.GIBBERISH: "#c00000",
    Verdict.ERROR: "#862e9c",
}


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


def render_report(result) -> str:
    """The registry's renderer: the page of any result that has verdicts (its ``report_input()``)."""
    return render_html(result.report_input())
