"""The self-test's reports: each labelled case's outcome, and what each rule calls broken.

Knows a `diffcheck.report.results.SelftestReport` (outcomes as
`diffcheck.workflows.selftest` made them); judges nothing. The terminal shows two
tables and a count; the JSON document is ``{"outcomes": [...], "confusion": {...}}``:
each outcome's fields with ``verdict`` as its name, and per detector how many cases
of each class it flagged.
"""

from __future__ import annotations

import json


def render_terminal(report, console) -> None:
    """The outcome table, the confusion table and the pass/fail count."""
    from rich.table import Table

    table = Table("case", "vs", "expected", "verdict", "onset", "onset err", "diffcheck", "exact match",
                  "logprobs close", "ok", title=f"selftest: suite {report.suite}")
    word = {True: "flag", False: "pass"}
    for o in report.outcomes:
        table.add_row(o.case_id, o.reference_id, o.expected, o.verdict.name, "" if o.onset is None else str(o.onset),
                      "" if o.onset_error is None else str(o.onset_error), word[o.flagged["diffcheck"]],
                      word[o.flagged["exact_match"]], word[o.flagged["check_logprobs_close"]],
                      "[green]yes[/]" if o.passed else "[red]NO[/]")
    console.print(table)
    ctable = Table("detector", *(f"flagged: {c}s" if c != "benign" else "flagged: benign variants"
                                 for c in report.classes),
                   title="what each rule calls broken (faults should be flagged; precision and benign variants not)")
    for d, row in report.confusion.items():
        ctable.add_row(d, *(row[c] for c in report.classes))
    console.print(ctable)
    failed = [o for o in report.outcomes if not o.passed]
    console.print(f"{len(report.outcomes) - len(failed)} passed, {len(failed)} failed  ({report.seconds:.0f}s)")


def render_json(report) -> str:
    data = [{**o.__dict__, "verdict": o.verdict.name} for o in report.outcomes]
    return json.dumps({"outcomes": data, "confusion": report.confusion}, indent=1) + "\n"
