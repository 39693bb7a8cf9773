"""The report of `diffcheck selftest --localize`: one row per labelled case (and layer variant).

Each row: the case, the fault its spec selects, where the fault catalogue says it first acts
(step, layer, op), what `diffcheck localize` named, the step localized at, and whether they
agree (a benign variant must name nothing). Skipped rows say why. Judges nothing: the rows
come from `diffcheck.workflows.selftest_localize`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class Row:
    case_id: str
    variant_of: str | None  # the suite case a layer variant is derived from
    fault: str  # the fault in words, from its spec ("none")
    expected: str  # "step T, layers.L.op" or "nothing"
    named: str  # what localize named ("nothing"; "" when not run)
    step: int | None  # the step localized at (None: not run)
    ok: bool | None  # None: skipped
    note: str = ""  # the ratio and cause, the skip reason or the failure
    seconds: float = 0.0
    steps: tuple[int, ...] = ()  # the captured window
    captured: dict = field(default_factory=dict)  # configurations captured for this row (not reused): seconds


@dataclass(frozen=True)
class SelftestLocalizeReport:
    kind: ClassVar[str] = "selftest-localize"

    suite: str
    rows: tuple[Row, ...]
    around: int
    notes: tuple[str, ...] = ()  # catalogue faults no row exercises, with why
    seconds: float = 0.0

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.rows if r.ok is False]

    @property
    def passed(self) -> list[Row]:
        return [r for r in self.rows if r.ok is True]


def render_terminal(report: SelftestLocalizeReport, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table("case", "fault", "expected site", "named site", "step", "ok",
                  title=f"selftest --localize: suite {report.suite} (steps T-{report.around}..T)")
    for r in report.rows:
        ok = "[dim]skip[/]" if r.ok is None else ("[green]yes[/]" if r.ok else "[red]NO[/]")
        table.add_row(escape(r.case_id), escape(r.fault), escape(r.expected), escape(r.named),
                      "" if r.step is None else str(r.step), ok)
    console.print(table)
    for r in report.rows:
        if r.note and (r.ok is not True or r.variant_of is None):
            what = "skipped" if r.ok is None else ("ok" if r.ok else "NOT ok")
            console.print(f"{escape(r.case_id)} ({what}): {escape(r.note)}")
    for note in report.notes:
        console.print(f"note: {escape(note)}")
    skipped = sum(r.ok is None for r in report.rows)
    console.print(f"{len(report.passed)} ok, {len(report.failed)} not ok, {skipped} skipped  ({report.seconds:.0f}s)")


def render_json(report: SelftestLocalizeReport) -> str:
    return json.dumps({"kind": report.kind, "suite": report.suite, "around": report.around,
                       "rows": [asdict(r) for r in report.rows], "notes": list(report.notes),
                       "passed": len(report.passed), "failed": len(report.failed),
                       "seconds": report.seconds}, indent=1) + "\n"
