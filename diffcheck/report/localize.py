"""The report of `diffcheck localize`: the terminal table and the JSON document.

Knows a `LocalizeReport`: a `diffcheck.judging.localize.Localization` (the first site beyond
its floor, the worst others, the per-site floors) and how it was reached (the onset step and
its source, the capture times). Judges nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar


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


def render_terminal(report: LocalizeReport, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    loc = report.localization
    console.print(f"localize {escape(loc.candidate)} against {escape(loc.reference)}: steps {loc.steps[0]}..{loc.steps[-1]} "
                  f"(onset {report.step}, from {escape(report.onset_source)}); floor from "
                  f"{', '.join(loc.floor_replicas) or 'no replica'}; beyond = relative error > "
                  f"max({loc.factor:g} x floor, {loc.minimum:g})")
    if loc.first is None:
        console.print("[green]nothing beyond its floor[/]: no layer or op of the candidate left the reference's "
                      "noise floor at these steps")
    else:
        f = loc.first
        console.print(f"[bold red]first beyond its floor[/]: step {f.step}, {escape(f.site)} (seq {f.seq}): relative "
                      f"error {f.relative_error:.3g}, {f.ratio:.3g}x its margin {f.margin:.3g} (floor {f.floor:.3g}); "
                      f"{_cause(f)}")
    table = Table(title="first and worst sites", title_justify="left")
    for col in ("", "step", "site", "seq", "rel. error", "floor", "margin", "x margin", "cause"):
        table.add_column(col, justify="right" if col in ("step", "seq", "rel. error", "floor", "margin", "x margin")
                         else "left")
    rows = ([("first", loc.first)] if loc.first else []) + [("", f) for f in loc.worst]
    for tag, f in rows:
        table.add_row(tag, str(f.step), escape(f.site), str(f.seq), f"{f.relative_error:.3g}", f"{f.floor:.3g}",
                      f"{f.margin:.3g}", f"{f.ratio:.3g}", "inherited" if f.inherited else "own")
    if rows:
        console.print(table)
    if loc.first is not None and loc.first.inputs:
        console.print("its inputs at that step: " + "; ".join(
            f"{escape(s)} {e:.3g} ({'beyond' if e > m else 'inside'} margin {m:.3g})" for s, e, m in loc.first.inputs))
    console.print(f"{loc.beyond_sites} of {len(loc.sites)} sites beyond their floor at some step")
    for note in loc.notes:
        console.print(f"note: {escape(note)}")
    if report.timings:
        console.print("capture time: " + ", ".join(f"{escape(k)} {v:.1f}s" for k, v in report.timings.items()))


def render_json(report: LocalizeReport) -> str:
    return json.dumps(report.to_dict(), indent=1, sort_keys=True) + "\n"
