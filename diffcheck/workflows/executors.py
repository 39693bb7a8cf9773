"""How a matrix's engine work runs: the jobs, and the sequential executor.

A matrix is one plan (`diffcheck.workflows.matrix.plan`) run by one driver; only the
executor differs. A *job* is engine work that writes nothing and returns runs:

- `golden_job`: a reference's golden run;
- `candidate_job`: a candidate generated, teacher-forced along each golden, and scored
  by each reference engine where it diverged.

An executor takes jobs and yields, as each finishes, ``(case, result, error)``: the
result, or the one-line error that makes the case ERROR (never a verdict). The driver
alone stores what comes back (`diffcheck.workspace`) and judges it. `SequentialExecutor`
runs the jobs here, one after the other; `diffcheck.workflows.matrix_ray.RayExecutor`
runs them as Ray tasks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from diffcheck.core.errors import EngineError
from diffcheck.core.types import Run
from diffcheck.engines import replay as replaymod
from diffcheck.engines import session as sessionmod
from diffcheck.judging.align import differs

Echo = Callable[[str], None]


@dataclass(frozen=True)
class Job:
    case: Any
    label: str  # what the progress line says when the job starts ("case 2 of 5: golden J (...)")
    ref_cases: dict | None = None  # candidates: reference id -> reference case
    goldens: dict | None = None  # candidates: reference id -> golden Run


@dataclass(frozen=True)
class CandidateResult:
    candidate: Run
    forced: dict[str, Run]
    scored: dict[str, Run]
    seconds: float


def golden_job(case, verbose: bool = False) -> Run:
    """Generate a reference's golden run."""
    return sessionmod.generate(case, verbose=verbose, echo=lambda _: None)


def candidate_job(case, ref_cases: dict, goldens: dict[str, Run], verbose: bool = False,
                  echo: Echo = lambda _: None, score: bool = True) -> CandidateResult:
    """Generate the candidate, force it along each golden, and (with `score`) score it where it
    diverged.

    A failing candidate or scoring engine is the job's `EngineError` (an ERROR, never a
    verdict judged without that scoring). Without `score`, the
    driver's judging scores it (`diffcheck.workflows.compare.score_candidate`, which reuses
    a stored scoring of the same content)."""
    t0 = time.perf_counter()
    mode, why = replaymod.mode_for(case, None)
    references = sessionmod.candidate_references(case, list(ref_cases))
    cand, forced = sessionmod.generate_and_force(case, references, goldens, mode=mode, why=why, verbose=verbose,
                                                 echo=echo)
    scored = {}
    for ref_id, ref_case in ref_cases.items():
        if score and differs(goldens[ref_id], cand):
            try:
                scored[ref_id] = sessionmod.score(ref_case, cand, verbose=verbose, echo=echo)
            except EngineError as exc:
                raise EngineError(f"scoring with reference {ref_id} failed: {exc.message}") from exc
    return CandidateResult(cand, forced, scored, time.perf_counter() - t0)


class SequentialExecutor:
    """Every job here, in order; `check` (the matrix's Ctrl-C flag) runs after each. Scoring is
    left to the driver's judging, which reuses a stored scoring of the same candidate."""

    def __init__(self, *, echo: Echo = print, verbose: bool = False, check: Callable[[], None] = lambda: None):
        self.echo, self.verbose, self.check = echo, verbose, check

    def goldens(self, jobs: list[Job]) -> Iterator[tuple[Any, Run | None, str | None]]:
        for job in jobs:
            self.echo(job.label)
            try:
                run = sessionmod.generate(job.case, verbose=self.verbose, echo=self.echo)
            except EngineError as exc:
                self.check()  # an interrupted engine start is Ctrl-C, not the case's ERROR
                yield job.case, None, exc.message
                continue
            self.check()
            yield job.case, run, None

    def candidates(self, jobs: list[Job]) -> Iterator[tuple[Any, CandidateResult | None, str | None]]:
        for job in jobs:
            self.echo(job.label)
            self.echo(f"{job.case.id}: starting candidate engine ({job.case.description or 'candidate'})")
            try:
                result = candidate_job(job.case, job.ref_cases, job.goldens, verbose=self.verbose, echo=self.echo,
                                       score=False)
            except EngineError as exc:
                self.check()
                yield job.case, None, exc.message
                continue
            self.check()
            yield job.case, result, None
