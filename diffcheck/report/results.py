"""What a command hands the report registry: one dataclass per kind of result.

Each holds what its renderers need, already computed by the workflow that made it;
nothing here runs an engine or judges. The registry (`diffcheck.report.registry`)
picks a renderer by the result's ``kind``:

- `ComparisonReport` (``comparison``): one candidate against its references
  (``diffcheck compare``): the `ReportInput` (verdicts, token texts, meta, speed).
- `CheckReport` (``check``): the whole suite for CI (``diffcheck check``): every
  verdict, the goldens' moves, what was left out, the exit code.
- `MatrixReport` (``matrix``; ``outcomes`` for recorded outcomes, which hold no
  verdicts): a `diffcheck.workflows.matrix.MatrixResult` and how to decode its texts.
- `SelftestReport` (``selftest``): the labelled cases' outcomes and the confusion table.
- `KernelsReport` (``kernels``): a kernel-suite result, its comparison with the
  stored results, and what the command did with them.
- `DataReport` (``data``): plain JSON-able data (``cases show``, ``ledger``).

The results with verdicts share what the JUnit and HTML renderers read:
``verdicts``, ``strict``, ``junit_name`` and ``report_input()``.

`report_input` builds the `ReportInput` of a comparison (`diffcheck.workflows.compare.Comparison`):
each sequence's token strings on both sides, decoded one token at a time by the given
tokenizer, or whole texts without one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

from diffcheck.core.types import CaseVerdict, Verdict
from diffcheck.report import ReportInput, SequenceTexts


def report_input(comparison, meta: Mapping[str, Any], speed: Mapping[str, Any] | None = None, *,
                 tokenizer=None) -> ReportInput:
    """The verdicts of `comparison` with both sides' token strings, `meta` and `speed`.

    ``tokenizer`` (anything with ``decode([token_id])``) splits each side into token
    strings; without one each side is its whole text. A comparison without a
    candidate run (it never ran) has no texts.
    """
    texts = {}
    cand = comparison.candidate
    if cand is not None:
        for v in comparison.verdicts:
            gold = comparison.goldens[v.reference_id]
            for s in v.sequences:
                if tokenizer is None:
                    texts[(v.candidate_id, v.reference_id, s.index)] = SequenceTexts.from_texts(
                        gold.sequences[s.index].text, cand.sequences[s.index].text)
                else:
                    texts[(v.candidate_id, v.reference_id, s.index)] = SequenceTexts(
                        _decoded(tokenizer, gold, s.index), _decoded(tokenizer, cand, s.index))
    return ReportInput(verdicts=comparison.verdicts, texts=texts, meta=meta, speed=speed)


def _decoded(tokenizer, run, index: int) -> tuple[str, ...]:
    return tuple(tokenizer.decode([t]) for t in run.sequence(index).token_id.tolist())


@dataclass(frozen=True)
class ComparisonReport:
    """``diffcheck compare``: a candidate's verdicts against each reference."""

    kind: ClassVar[str] = "comparison"

    report: ReportInput
    strict: bool = False
    notes: tuple[str, ...] = ()  # lines shown under the terminal report (e.g. "same output as ...")
    junit_name: str = "diffcheck"

    @property
    def verdicts(self) -> tuple[CaseVerdict, ...]:
        return self.report.verdicts

    @property
    def meta(self) -> Mapping[str, Any]:
        return self.report.meta

    @property
    def speed(self) -> Mapping[str, Any] | None:
        return self.report.speed

    def report_input(self) -> ReportInput:
        return self.report


@dataclass(frozen=True)
class CheckReport:
    """``diffcheck check``: every verdict of the suite and what happened to its goldens."""

    kind: ClassVar[str] = "check"

    verdicts: tuple[CaseVerdict, ...]
    meta: Mapping[str, Any]
    suite: str  # the suite's name
    suite_option: str  # --suite as given, for the commands the report suggests
    goldens: tuple[Any, ...] = ()  # `diffcheck.workflows.check.GoldenMove`s
    skipped: tuple[tuple[str, str], ...] = ()  # (case id, why)
    exit_code: int = 0
    strict: bool = False

    @property
    def speed(self) -> None:
        return None  # a check does not compare speeds

    @property
    def verdict(self) -> Verdict:
        return Verdict.worst(v.verdict for v in self.verdicts)

    @property
    def junit_name(self) -> str:
        return f"diffcheck check {self.suite}"

    def report_input(self) -> ReportInput:
        return ReportInput(verdicts=self.verdicts, meta=self.meta)


@dataclass(frozen=True)
class MatrixReport:
    """``diffcheck matrix``: the seed's table, the narrowing and every comparison of a matrix.

    ``tokenizer_for(case_id)`` gives the tokenizer of a compared case's model (or None),
    called only when a renderer needs token texts (HTML).
    """

    result: Any  # `diffcheck.workflows.matrix.MatrixResult`
    strict: bool = False
    from_outcomes: bool = False
    tokenizer_for: Callable[[str], Any] | None = field(default=None, compare=False)

    @property
    def kind(self) -> str:
        return "outcomes" if self.from_outcomes else "matrix"

    @property
    def suite(self) -> str:
        return self.result.suite.name

    @property
    def command(self) -> str:
        return f"diffcheck matrix --suite {self.suite}"

    @property
    def verdicts(self) -> tuple[CaseVerdict, ...]:
        return tuple(v for comp in self.result.comparisons.values() for v in comp.verdicts)

    @property
    def junit_name(self) -> str:
        return f"diffcheck matrix {self.suite}"

    def case_meta(self, case_id: str, comparison) -> dict[str, Any]:
        """The meta of one compared case's report."""
        return {"suite": self.suite, "candidate": case_id,
                "references": [v.reference_id for v in comparison.verdicts], "command": self.command}

    def report_input(self) -> ReportInput:
        """Every comparison's verdicts and texts in one `ReportInput` (one page for the whole matrix)."""
        verdicts, texts = [], {}
        for cid, comp in self.result.comparisons.items():
            tokenizer = self.tokenizer_for(cid) if self.tokenizer_for is not None else None
            one = report_input(comp, {}, tokenizer=tokenizer)
            verdicts += one.verdicts
            texts.update(one.texts)
        meta = {"suite": self.suite, "command": self.command, "candidates": list(self.result.comparisons)}
        return ReportInput(verdicts=tuple(verdicts), texts=texts, meta=meta)


@dataclass(frozen=True)
class SelftestReport:
    """``diffcheck selftest``: each labelled case's outcome and what each rule flagged."""

    kind: ClassVar[str] = "selftest"

    suite: str
    outcomes: tuple[Any, ...]  # `diffcheck.workflows.selftest.Outcome`s
    confusion: Mapping[str, Mapping[str, str]]  # detector -> class -> "flagged/total"
    classes: tuple[str, ...]  # the label classes, in column order
    seconds: float = 0.0


@dataclass(frozen=True)
class KernelsReport:
    """``diffcheck kernels``: a kernel-suite run (`diffcheck_kernels.results.SuiteResult`) and its judgement."""

    kind: ClassVar[str] = "kernels"

    result: Any  # `SuiteResult`
    comparison: Any = None  # `diffcheck_kernels.results.Comparison` with the stored results, or None
    messages: tuple[str, ...] = ()  # what the command did with the stored results
    all_rows: bool = False  # the terminal shows every case, not the per-group summary


@dataclass(frozen=True)
class DataReport:
    """Plain data a command prints as JSON instead of its human output (``cases show``, ``ledger``)."""

    kind: ClassVar[str] = "data"

    data: Any
