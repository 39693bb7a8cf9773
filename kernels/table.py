"""The summary table of a kernel-suite result, as data and as plain text.

Knows how to fold per-case rows into one line per (kernel, mode, dtype,
shape) and how to print that without third-party libraries (for
``python -m kernels`` on a bare GPU machine). The rich table of
``diffcheck kernels`` renders the same `SummaryRow`s.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffcheck_kernels.results import CAUGHT, FAIL, MISSED, PASS, Comparison, SuiteResult, overall_ok

COLUMNS = ("kernel", "mode", "dtype", "shape", "cases", "max err", "mean err", "tolerance", "result")


@dataclass(frozen=True)
class SummaryRow:
    kernel: str
    mode: str  # "eager", "graph", or "graph[<broken builder>]"
    dtype: str
    shape: str
    cases: int
    max_err: float
    mean_err: float
    tolerance: str
    result: str  # "PASS", "FAIL k/n", "CAUGHT", "MISSED"
    detail: str = ""  # first failure, or a broken builder's evidence

    @property
    def ok(self) -> bool:
        return self.result in (PASS, CAUGHT)

    def cells(self) -> tuple[str, ...]:
        return (self.kernel, self.mode, self.dtype, self.shape, str(self.cases), f"{self.max_err:.2e}",
                f"{self.mean_err:.2e}", self.tolerance, self.result)  # fmt: skip


def summarize(result: SuiteResult) -> list[SummaryRow]:
    """Correct-builder cases folded per (kernel, mode, dtype, shape); broken-builder rows as they are."""
    groups: dict[tuple, list] = {}
    broken = []
    for row in result.rows:
        if row.builder in ("-", "refresh"):
            groups.setdefault((row.kernel, row.mode, row.dtype, row.shape), []).append(row)
        else:
            broken.append(row)
    out = []
    for (kernel, mode, dtype, shape), rows in groups.items():
        failed = [r for r in rows if r.verdict != PASS]
        verdict = PASS if not failed else f"{FAIL} {len(failed)}/{len(rows)}"
        out.append(SummaryRow(
            kernel=kernel, mode=mode, dtype=dtype, shape=shape, cases=len(rows),
            max_err=max(r.max_err for r in rows), mean_err=sum(r.mean_err for r in rows) / len(rows),
            tolerance=f"{rows[0].atol:.2g}/{rows[0].rtol:.2g}", result=verdict,
            detail=f"{failed[0].case_id}: {failed[0].detail}" if failed else "",
        ))  # fmt: skip
    for row in broken:
        out.append(SummaryRow(
            kernel=row.kernel, mode=f"graph[{row.builder}]", dtype=row.dtype, shape=f"{row.shape} bs{row.block_size}",
            cases=1, max_err=row.max_err, mean_err=row.mean_err, tolerance=f"{row.atol:.2g}/{row.rtol:.2g}",
            result=row.verdict, detail=row.detail,
        ))  # fmt: skip
    return out


def verdict_line(result: SuiteResult, comparison: Comparison | None = None) -> str:
    """One line: what passed, what failed, what was caught."""
    cases = [r for r in result.rows if r.verdict not in (CAUGHT, MISSED)]  # correct builders, variants included
    broken = [r for r in result.rows if r.verdict in (CAUGHT, MISSED)]
    failed = sum(1 for r in cases if r.verdict != PASS)
    missed = sum(1 for r in broken if r.verdict == MISSED)
    caught = sum(1 for r in broken if r.verdict == CAUGHT)
    parts = [f"{len(cases) - failed}/{len(cases)} cases within tolerance",
             f"broken builders caught {caught}/{len(broken)}"]  # fmt: skip
    if comparison is not None:
        parts.append(f"{len(comparison.regressions)} regressions against stored results")
    if missed:
        parts.append(f"{missed} MISSED")
    return ("OK: " if overall_ok(result, comparison) else "FAILED: ") + ", ".join(parts)


def format_plain(result: SuiteResult) -> str:
    rows = summarize(result)
    cells = [COLUMNS] + [r.cells() for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(COLUMNS))).rstrip() for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in rows:
        if r.detail and (not r.ok or r.mode.startswith("graph[")):
            lines.append(f"  {r.kernel} {r.mode}: {r.detail}")
    for s in result.skipped:
        lines.append(f"  skipped {s.kernel}: {s.reason}")
    for note in result.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines)
