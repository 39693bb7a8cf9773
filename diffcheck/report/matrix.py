"""The matrix's reports: the seed's table, the narrowing, and the matrix's JSON document.

Knows the rows and the narrowing of a `diffcheck.workflows.matrix.MatrixResult` (read
as they are; nothing is judged or run here) and renders them for the terminal, as
Markdown and as JSON. JUnit and HTML of a matrix are those of all its verdicts
(`diffcheck.report.junit`, `diffcheck.report.html`).

The JSON document (``schema`` "diffcheck.matrix", ``version`` 1; a change that removes
or renames a key bumps it, a new key does not)::

    {
      "schema": "diffcheck.matrix",
      "version": 1,
      "meta": {"suite": str, "command": str},
      "verdict": str | null,                # worst verdict; null for recorded outcomes
      "rows": [{                            # the table, in its order
        "case": str, "reference": str | null,   # null: a golden (a reference's own run)
        "verdict": str,                     # a Verdict name, "golden", or a recorded outcome
        "config_delta": {path: {"reference": value, "candidate": value}},
        "onset": int | null, "tokens_per_s": float | null,
        "metrics": {...},                   # the seed's text metrics
        "output": str | null,               # output digest (or a recorded hash)
        "same_as": [str, ...], "note": str
      }],
      "outcomes": {case: "bad" | "clean"},  # what the narrowing was given
      "left_out": [str, ...],
      "narrowing": {"lines": [str, ...], "next_cases": str} | null,   # next_cases: TOML
      "reports": {case: {...}}              # each compared case's diffcheck.report document
    }
"""

from __future__ import annotations

import json
import uuid
from typing import Any

SCHEMA = "diffcheck.matrix"
VERSION = 1
METRIC_COLUMNS = ("digit_ratio", "weird_runs", "repeated_num_runs", "max_digit_run")
COLUMNS = ("case", "vs", "config delta", "verdict", "onset", "tok/s", *METRIC_COLUMNS, "same output as")


def delta_text(delta: dict[str, Any]) -> str:
    """``key=candidate value`` per changed path, ``engine.`` dropped (the reference is its own column)."""
    parts = []
    for path, value in sorted(delta.items()):
        cand = value[1] if isinstance(value, (tuple, list)) and len(value) == 2 else value
        short = path[len("engine."):] if path.startswith("engine.") else path
        text = "default" if cand is None else ("true" if cand is True else "false" if cand is False else cand)
        parts.append(f"{short}={text}")
    return ", ".join(parts)


def _num(value: Any, fmt: str) -> str:
    return "" if value is None else fmt.format(value)


def table_rows(result) -> list[list[str]]:
    """The seed's table of a `MatrixResult`: one list of cells (`COLUMNS`) per row."""
    out = []
    for r in result.rows:
        m = r.metrics
        out.append([r.case_id, r.reference_id or "", delta_text(r.delta), r.verdict, _num(r.onset, "{}"),
                    _num(r.tokens_per_s, "{:.1f}"), _num(m.get("digit_ratio"), "{:.4f}"),
                    _num(m.get("weird_runs"), "{}"), _num(m.get("repeated_num_runs"), "{}"),
                    _num(m.get("max_digit_run"), "{}"), ", ".join(r.same_as)])
    return out


def markdown(result, *, title: str | None = None) -> str:
    """The table, the narrowing and the next cases of a `MatrixResult` as one Markdown document."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = [f"# {title or f'Matrix: suite {result.suite.name}'}", ""]
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|" + "---|" * len(COLUMNS))
    for row in table_rows(result):
        lines.append("| " + " | ".join(cell(c) for c in row) + " |")
    notes = [r for r in result.rows if r.note]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {r.case_id}: {cell(r.note)}" for r in notes]
    if result.narrowing is not None:
        lines += ["", "## Narrowing", ""]
        lines += [f"- {line.strip()}" if not line.startswith("  ") else f"  - {line.strip()}"
                  for line in result.narrowing.lines(skipped=result.left_out)]
        if result.narrowing.next_cases:
            lines += ["", "## Next cases worth running", "", "```toml", result.narrowing.toml().rstrip(), "```"]
    return "\n".join(lines) + "\n"


def _narrowing_lines(report) -> list[str]:
    """The narrowing as the terminal shows it: recorded outcomes list what they leave out."""
    result = report.result
    return result.narrowing.lines(skipped=result.left_out if report.from_outcomes else ())


# -- the registry's renderers (`diffcheck.report.registry`); `report` is a `MatrixReport` ------------------


def render_terminal(report, console) -> None:
    """The table (rich), each row's note, the narrowing and the next cases as TOML."""
    from rich.table import Table

    from diffcheck.report.terminal import plain_line

    result = report.result
    table = Table(*COLUMNS, title=f"matrix: suite {result.suite.name}")
    for row in table_rows(result):
        table.add_row(*row)
    console.print(table)
    for r in result.rows:
        if r.note:
            console.print(f"{r.case_id}: {r.note}", markup=False, highlight=False)
    for line in _narrowing_lines(report):
        plain_line(console, line)
    if result.narrowing.next_cases:
        plain_line(console, "")
        plain_line(console, result.narrowing.toml().rstrip())


def render_markdown(report) -> str:
    return markdown(report.result)


def render_json(report) -> str:
    """The matrix's JSON document (the module docstring's schema); each case's report keeps its compact series."""
    from diffcheck.core.types import Verdict
    from diffcheck.report.json_report import config_delta_dict, dumps, report_dict, to_jsonable

    result = report.result
    narrowing = result.narrowing
    tag = uuid.uuid4().hex  # a placeholder no real string can collide with
    reports = [dumps(report_dict(comp.verdicts, report.case_meta(cid, comp))) for cid, comp in
               result.comparisons.items()]
    doc = {
        "schema": SCHEMA,
        "version": VERSION,
        "meta": {"suite": report.suite, "command": report.command},
        "verdict": None if report.from_outcomes else Verdict.worst(v.verdict for v in report.verdicts).name,
        "rows": [{"case": r.case_id, "reference": r.reference_id, "verdict": r.verdict,
                  "config_delta": config_delta_dict(r.delta), "onset": to_jsonable(r.onset),
                  "tokens_per_s": to_jsonable(r.tokens_per_s), "metrics": to_jsonable(r.metrics),
                  "output": r.output, "same_as": list(r.same_as), "note": r.note} for r in result.rows],
        "outcomes": dict(result.outcomes),
        "left_out": list(result.left_out),
        "narrowing": None if narrowing is None else {"lines": _narrowing_lines(report),
                                                     "next_cases": narrowing.toml() if narrowing.next_cases else ""},
        "reports": {cid: f"{tag}:{i}" for i, cid in enumerate(result.comparisons)},
    }
    text = json.dumps(doc, indent=1, allow_nan=False, ensure_ascii=False)
    lines = []
    for line in text.split("\n"):
        head, sep, rest = line.partition(f'"{tag}:')
        if sep:  # `  "O": "<tag>:3",`: the case's report, indented to its place
            index, _, tail = rest.partition('"')
            indent = line[: len(line) - len(line.lstrip())]
            line = head + reports[int(index)].replace("\n", "\n" + indent) + tail
        lines.append(line)
    return "\n".join(lines) + "\n"
