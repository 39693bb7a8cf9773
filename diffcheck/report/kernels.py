"""The kernel check's reports: the summary table of a kernel-suite run, and its JSON.

Knows a `diffcheck.report.results.KernelsReport`: a `diffcheck_kernels.results.SuiteResult`,
its comparison with the stored results, and the command's messages; judges nothing
(the verdicts and regressions come with it). The JSON is the suite result's own
(``SuiteResult.to_json``, sorted keys, ASCII): what ``python -m kernels --json`` writes
and ``diffcheck kernels --from-json`` reads.
"""

from __future__ import annotations

import json

STYLES = {"PASS": "green", "CAUGHT": "green", "MISSED": "bold red"}


def render_terminal(report, console) -> None:
    """The per-group summary (or every case), details, skipped kernels, notes, regressions and the verdict line;
    then the command's messages."""
    from rich.markup import escape
    from rich.table import Table

    from diffcheck_kernels.table import COLUMNS, summarize, verdict_line

    result, comparison = report.result, report.comparison
    env = result.env
    title = f"decode attention on {result.device} ({env.get('device_name', '?')}, torch {env.get('torch', '?')})"
    table = Table(title=title, title_justify="left")
    if report.all_rows:
        for col in ("case", "max err", "mean err", "invariant", "result"):
            table.add_column(col, overflow="fold")
        for row in result.rows:
            style = STYLES.get(row.verdict, "bold red")
            table.add_row(escape(row.case_id), f"{row.max_err:.2e}", f"{row.mean_err:.2e}", row.invariant,
                          f"[{style}]{row.verdict}[/]")  # fmt: skip
    else:
        for col in COLUMNS:
            table.add_column(col, justify="right" if "err" in col or col == "cases" else "left")
        for row in summarize(result):
            cells = [escape(cell) for cell in row.cells()]
            style = STYLES.get(row.result, "bold red")
            cells[-1] = f"[{style}]{cells[-1]}[/]"
            table.add_row(*cells)
    console.print(table)
    for row in summarize(result):
        if row.detail and (not row.ok or row.mode.startswith("graph[")):
            console.print(f"  {row.kernel} {row.mode}: {row.detail}", highlight=False, markup=False, soft_wrap=True)
    for skipped in result.skipped:
        console.print(f"  skipped {skipped.kernel}: {skipped.reason}", highlight=False, markup=False, soft_wrap=True)
    for note in result.notes:
        console.print(f"  note: {note}", highlight=False, markup=False, soft_wrap=True)
    if comparison is not None:
        for regression in comparison.regressions:
            console.print(f"  REGRESSION {regression}", style="bold red", highlight=False, markup=False,
                          soft_wrap=True)
    line = verdict_line(result, comparison)
    console.print(line, style="green" if line.startswith("OK") else "bold red", highlight=False, markup=False,
                  soft_wrap=True)
    for message in report.messages:
        console.print(message, highlight=False, markup=False, soft_wrap=True)
    if comparison is not None and comparison.regressions:
        console.print(f"to accept these numbers: diffcheck kernels --device {result.device} --update", markup=False,
                      soft_wrap=True)


def render_json(report) -> str:
    return json.dumps(report.result.to_json(), indent=1, sort_keys=True) + "\n"
