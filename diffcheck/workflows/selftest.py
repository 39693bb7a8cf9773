"""The labelled self-test: do the verdicts catch every fault and pass every benign variant?

Labels live in the case files (``expect``), never here. Each labelled case is in
one class: a *gibberish fault* (``expect.verdict = GIBBERISH``), a *degraded
fault* (``expect.verdict = DEGRADED``: a fault that hurts quality without turning
the text into garbage), a *precision variant* (tagged ``precision``: a dtype or
KV-cache change that must stay within its budget), or *benign* (anything else). For each case the comparison runs as `diffcheck compare` does, and the
same sequences are also judged by the older rules, so the table shows what each
would have said. A detector *flags* a case when it calls it broken:

- ``diffcheck``: what `diffcheck.core.types` fails, or ERROR;
- ``exact_match`` (vLLM's check_outputs_equal): any token difference;
- ``check_logprobs_close`` (vLLM): at the first mismatch, either side's token is
  outside the other's top-N.

Whether a case passes is its own label's business (`Expect.matches`): a degraded
fault must come out DEGRADED, a benign variant must pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffcheck import cases as casesmod
from diffcheck.core.types import fails
from diffcheck.core.types import Verdict

DETECTORS = ("diffcheck", "exact_match", "check_logprobs_close")


CLASSES = ("gibberish fault", "degraded fault", "precision variant", "benign")


@dataclass(frozen=True)
class Outcome:
    case_id: str
    reference_id: str
    label: str  # one of CLASSES
    expected: str
    verdict: Verdict
    onset: int | None
    expected_onset: int | None
    onset_error: int | None
    passed: bool  # the case's expectation holds
    flagged: dict[str, bool]  # detector -> flagged this case
    evidence: str


def labelled_cases(suite, *, include=None, exclude_tags=casesmod.NOT_BY_DEFAULT):
    chosen = []
    for case in suite.cases.values():
        if case.expect is None or not case.references:
            continue
        if include and case.id not in include:
            continue
        if not include and any(t in case.tags for t in exclude_tags):
            continue
        chosen.append(case)
    return chosen


def in_engine_order(chosen: list) -> list:
    """`chosen` with the cases that can share one kept engine next to each other (the same
    configuration, a switchable fault aside: `engines.session.fault_switchable`), each group where
    its first case stands; the output still reports the cases in file order."""
    from diffcheck.engines import session as sessionmod

    keys = [sessionmod.config_key(c, faults_switched=sessionmod.fault_switchable(c)) for c in chosen]
    first: dict[str, int] = {}
    for key in keys:
        first.setdefault(key, len(first))
    order = sorted(range(len(chosen)), key=lambda i: first[keys[i]])
    return [chosen[i] for i in order]


def outcome(case, verdict, *, strict: bool = False) -> Outcome:
    exp = case.expect
    label = {Verdict.GIBBERISH: CLASSES[0], Verdict.DEGRADED: CLASSES[1]}.get(
        exp.verdict, CLASSES[2] if "precision" in case.tags else CLASSES[3])
    worst = max(verdict.sequences, key=lambda s: s.verdict.value, default=None)
    onsets = [s.onset for s in verdict.sequences if s.onset is not None]
    onset = min(onsets) if onsets else None
    passed = exp.matches(verdict.verdict, onset)
    onset_error = abs(onset - exp.onset) if (onset is not None and exp.onset is not None) else None
    flagged = {
        "diffcheck": fails(verdict.verdict, strict=strict) or verdict.verdict is Verdict.ERROR,
        "exact_match": any(not s.baselines.get("exact_match", True) for s in verdict.sequences),
        "check_logprobs_close": any(not s.baselines.get("check_logprobs_close", True) for s in verdict.sequences),
    }
    if exp.verdict is not None:
        expected = exp.verdict.name
    else:
        expected = "not " + "/".join(v.name for v in exp.not_verdict)
    if exp.onset is not None:
        expected += f" @{exp.onset}±{exp.onset_tolerance}"
    return Outcome(case_id=case.id, reference_id=verdict.reference_id, label=label, expected=expected,
                   verdict=verdict.verdict, onset=onset, expected_onset=exp.onset, onset_error=onset_error,
                   passed=passed, flagged=flagged,
                   evidence=(worst.evidence[0] if worst is not None and worst.evidence else (verdict.error or "")))


def confusion(outcomes: list[Outcome]) -> dict[str, dict[str, str]]:
    """Per detector and class: how many cases it flagged, as "flagged/total"."""
    table = {}
    for d in DETECTORS:
        row = {}
        for cls in CLASSES:
            members = [o for o in outcomes if o.label == cls]
            row[cls] = f"{sum(o.flagged[d] for o in members)}/{len(members)}"
        table[d] = row
    return table
