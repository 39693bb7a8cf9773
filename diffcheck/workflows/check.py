"""``diffcheck check``: the whole suite the way CI wants it, one command, one exit code.

- Every **reference** is re-run with today's code and engine and judged against its own
  stored golden and noise floor (`comparemod.compare` with ``own_golden=True``; a reference
  that has references of its own, such as F against J, is judged against those too, in the
  same engine run).
- Every **candidate** is judged against its references' goldens, as ``diffcheck compare``
  does.
- Labelled faults (a case whose ``expect`` is a failing verdict) are the self-test's
  business and are left out, with the reason; so are cases tagged ``slow`` or ``gpu``
  unless named with ``--case``.

The exit code is `diffcheck.core.types.exit_code` of the worst verdict. The goldens part
answers the question after an engine upgrade: which goldens *moved* (the reference's
fresh run is not IDENTICAL to its golden), and whether each move is *benign* (the
policy passes it: inside the noise floor, or a precision change inside its budget), the
input to ``diffcheck golden record IDS --update``.

Knows cases, the compare workflow and the policy; renders nothing (``diffcheck.cli.check`` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from diffcheck import cases as casesmod
from diffcheck.core import progress
from diffcheck.core.errors import DataError, DiffcheckError
from diffcheck.core import types as policy
from diffcheck.workflows import compare as comparemod
from diffcheck.storage import store
from diffcheck.core.types import CaseVerdict, Verdict

Echo = Callable[[str], None]


@dataclass(frozen=True)
class GoldenMove:
    """What today's engine did to one reference's golden."""

    case_id: str
    verdict: Verdict
    recorded_with: str  # the engine the golden was recorded with
    now: str  # today's engine ("" when it did not run)
    config_changed: bool  # the case's resolved config differs from the golden's
    spec_change: dict = field(default_factory=dict)  # precision-spec keys that differ (dtype, ...)
    strict: bool = False  # --strict: a precision cost (WITHIN_BUDGET) is not benign either

    @property
    def moved(self) -> bool:
        return self.verdict is not Verdict.IDENTICAL and self.verdict is not Verdict.ERROR

    @property
    def benign(self) -> bool:
        return self.moved and policy.passes(self.verdict, strict=self.strict)

    def describe(self, suite: str) -> str:
        engines = (f"recorded with {self.recorded_with}, now {self.now}" if self.now and self.now != self.recorded_with
                   else f"engine {self.recorded_with}")
        notes = [engines]
        if self.config_changed:
            notes.append("the case's config changed since recording")
        if self.spec_change:
            notes.append("precision spec " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in self.spec_change.items()))
        how = "; ".join(notes)
        update = f"`diffcheck golden record {self.case_id} --update --suite {suite}`"
        if self.verdict is Verdict.ERROR:
            return f"not checked: the engine failed ({how})"
        if not self.moved:
            return f"unchanged ({how})"
        if self.verdict is Verdict.INCONCLUSIVE:
            return (f"moved, undecided ({how}): too little evidence to call it benign or not; decide it with more "
                    f"tokens or a forced replay before {update}")
        if self.verdict is Verdict.WITHIN_BUDGET and self.benign:
            return f"moved, benign: a precision change inside its budget ({how}); if intended, accept it with {update}"
        if self.benign:
            return f"moved, benign: inside the noise floor ({how}); accept it with {update}"
        return f"moved, NOT benign ({how}): investigate before {update}"


@dataclass(frozen=True)
class CheckResult:
    suite: str
    comparisons: dict[str, comparemod.Comparison]  # case id -> its comparison, in the order run
    goldens: tuple[GoldenMove, ...]
    skipped: tuple[tuple[str, str], ...]  # (case id, why)

    @property
    def verdicts(self) -> tuple[CaseVerdict, ...]:
        return tuple(v for c in self.comparisons.values() for v in c.verdicts)

    @property
    def verdict(self) -> Verdict:
        return Verdict.worst(v.verdict for v in self.verdicts)

    def exit_code(self, *, strict: bool = False) -> int:
        return policy.exit_code(self.verdict, strict=strict)


def plan(suite, *, include: set[str] | None = None) -> tuple[list, list[tuple[str, str]]]:
    """(cases to check, references first; [(case id, why it is left out)])."""
    chosen, skipped = [], []
    for case in suite.cases.values():
        if include is not None:
            if case.id in include:
                chosen.append(case)
            continue
        tags = casesmod.not_by_default(case)
        exp = case.expect
        if tags:
            skipped.append((case.id, f"tagged {', '.join(tags)} (name it with --case to check it)"))
        elif exp is not None and exp.verdict is not None and policy.fails(exp.verdict):
            skipped.append((case.id, f"labelled fault (expect {exp.verdict.name}): `diffcheck selftest` checks it"))
        elif case.role == "reference" or case.references:
            chosen.append(case)
    if include is not None:
        unknown = sorted(include - set(suite.cases))
        if unknown:
            casesmod.get_case(suite, unknown[0])  # the loader's one-line error with the valid ids
    chosen.sort(key=lambda c: c.role != "reference")  # goldens first: their moves explain the rest
    return chosen, skipped


def suite_arg(suite) -> str:
    """How to name `suite` in a command: its name when that finds this very file, else its path."""
    try:
        if Path(casesmod.load_suite(suite.name).path).resolve() == Path(suite.path).resolve():
            return suite.name
    except DiffcheckError:  # no suite of that name, or a broken one (ConfigError): the path says it
        pass
    return casesmod.display_path(suite.path)


def _engine_label(engine: dict) -> str:
    name = engine.get("distribution") or engine.get("name") or "engine"
    label = f"{name} {engine.get('version') or '?'}"
    if engine.get("commit"):
        label += f"@{str(engine['commit'])[:10]}" + ("+dirty" if engine.get("dirty") else "")
    return label


def golden_move(case, comparison: comparemod.Comparison, *, strict: bool = False) -> GoldenMove:
    golden = comparison.goldens[case.id]
    own = next(v for v in comparison.verdicts if v.reference_id == case.id)
    now = _engine_label(comparison.candidate.meta.engine) if comparison.candidate is not None else ""
    spec = (own.summary or {}).get("spec_change") or {}
    return GoldenMove(case_id=case.id, verdict=own.verdict, recorded_with=_engine_label(golden.meta.engine), now=now,
                      config_changed=golden.meta.source.get("config_digest") != casesmod.config_digest(case),
                      spec_change={k: tuple(v) for k, v in spec.items()}, strict=strict)


def run_check(suite, *, root: Path, include: set[str] | None = None, verbose: bool = False, force: bool = False,
              replay: str | None = None, strict: bool = False, echo: Echo = print) -> CheckResult:
    """Judge every chosen case (`plan`); goldens that are missing are refused up front, all at once."""
    chosen, skipped = plan(suite, include=include)
    needed = sorted({r for c in chosen for r in ((c.id,) if c.role == "reference" else ()) + tuple(c.references)})
    missing = [r for r in needed if not store.run_path(root, suite.name, r).exists()]
    if missing:
        raise DataError(f"{Path(root) / suite.name}: no golden for {', '.join(missing)}; record "
                        f"{'them' if len(missing) > 1 else 'it'} first with `diffcheck golden record "
                        f"{' '.join(missing)} --suite {suite_arg(suite)}`")
    refs_of = {c.id: ((c.id,) if c.role == "reference" else ()) + tuple(r for r in c.references if r != c.id)
               for c in chosen}
    comparisons: dict[str, comparemod.Comparison] = {}
    moves = []
    for n, case in enumerate(chosen, 1):
        against = ", ".join("its golden" if r == case.id else r for r in refs_of[case.id])
        progress.stage(f"check: case {n} of {len(chosen)}: {case.id} against {against}")
        echo(f"[{n}/{len(chosen)}] {case.id}: against {against}")
        comparison = comparemod.compare(suite, case.id, root=root, verbose=verbose, force=force, echo=echo,
                                    replay=replay, own_golden=case.role == "reference")
        comparisons[case.id] = comparison
        if case.role == "reference":
            moves.append(golden_move(case, comparison, strict=strict))
    progress.stage(None)
    return CheckResult(suite=suite.name, comparisons=comparisons, goldens=tuple(moves), skipped=tuple(skipped))
