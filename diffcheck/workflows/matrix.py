"""``diffcheck matrix``: a suite's whole experiment matrix, resumable, with the seed's table and a narrowing.

One plan, one driver (`run_plan`), two executors of its engine work
(`diffcheck.workflows.executors`: sequential here, or Ray): the executor returns runs,
the driver alone stores them (`diffcheck.workspace`) and judges them.

1. **Goldens first**: every reference the chosen cases need, recorded unless up to
   date.
2. **Every candidate** the ledger does not hold is generated and forced along its
   goldens, then every candidate is judged against its references from its stored
   files (`comparemod.compare`), each corrected for its own tests (`judging.decision.family`),
   as `compare` corrects it.
   Cases that list references while being references themselves (a second,
   unbatched reference) are compared too.
3. Every engine run goes through the ledger: a run with the same key (config, code,
   model, goldens) is reused, so an interrupted matrix resumes where it stopped and a
   finished run never runs twice.
4. The table: case, reference, config delta, verdict, onset, tokens/s, the seed's text
   metrics (max digit_ratio, weird_runs, repeated_num_runs, max max_digit_run over the
   sequences) and "same output as" groups (the ledger's output digests).
5. The narrowing (`diffcheck.judging.narrow`) of the verdicts: bad = `policy.fails`,
   clean = a pass (a reference with no references of its own is clean by definition),
   ERROR is no verdict.

``--from-outcomes FILE`` does steps 4-5 from recorded outcomes instead
(`diffcheck.cases.outcomes`): no engine. ``--ray`` runs the engine work of steps
1-2 as Ray tasks (`diffcheck.workflows.matrix_ray.RayExecutor`); the driver alone writes.

Cases tagged ``slow`` or ``gpu`` are left out unless named.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from diffcheck import workspace
from diffcheck.core.errors import DiffcheckError
from diffcheck.core.types import CaseVerdict, Run, Verdict
from diffcheck.engines import replay as replaymod
from diffcheck.engines import session as sessionmod
from diffcheck.workflows import compare as comparemod
from diffcheck.workflows import executors

Echo = Callable[[str], None]


@dataclass(frozen=True)
class Plan:
    references: tuple[Any, ...]  # Cases whose goldens are needed, suite order
    compared: tuple[Any, ...]  # Cases compared against their references, suite order
    left_out: tuple[str, ...] = ()  # tagged slow/gpu and not named

    @property
    def steps(self) -> int:
        return len(self.references) + len(self.compared)


def plan(suite, ids: tuple[str, ...] | list[str] = ()) -> Plan:
    """Which goldens and comparisons a matrix over `ids` (default: the whole suite) needs."""
    from diffcheck import cases as casesmod

    if ids:
        chosen = [casesmod.get_case(suite, i) for i in dict.fromkeys(ids)]
        left_out: list[str] = []
    else:
        chosen = [c for c in suite.cases.values() if not casesmod.not_by_default(c)]
        left_out = [c.id for c in suite.cases.values() if c not in chosen]
    need = {r for c in chosen for r in c.references} | {c.id for c in chosen if c.role == "reference"}
    references = tuple(c for c in suite.cases.values() if c.id in need and c.role == "reference")
    compared = tuple(c for c in suite.cases.values() if c in chosen and c.references)
    return Plan(references=references, compared=compared, left_out=tuple(left_out))


@dataclass(frozen=True)
class Row:
    case_id: str
    reference_id: str | None  # None: a golden (a reference's own run)
    verdict: str  # a Verdict name, "golden", or a recorded outcome
    delta: dict[str, Any] = field(default_factory=dict)
    onset: int | None = None
    tokens_per_s: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    output: str | None = None  # output digest (or a recorded hash)
    same_as: tuple[str, ...] = ()
    note: str = ""


@dataclass
class MatrixResult:
    suite: Any
    rows: list[Row] = field(default_factory=list)
    comparisons: dict[str, Any] = field(default_factory=dict)  # case id -> comparemod.Comparison
    outcomes: dict[str, str] = field(default_factory=dict)  # case id -> bad | clean (for narrowing)
    left_out: tuple[str, ...] = ()
    narrowing: Any = None
    seconds: float = 0.0
    engine_runs: int = 0

    @property
    def verdict(self) -> Verdict:
        return Verdict.worst(v.verdict for comp in self.comparisons.values() for v in comp.verdicts)


# -- running ----------------------------------------------------------------------------------------


def run_matrix(suite, ids=(), *, root: Path, echo: Echo = print, force: bool = False, verbose: bool = False,
               strict: bool = False, baseline: str | None = None, ray: str | None = None,
               cpus_per_rank: float = 1.0) -> MatrixResult:
    """Goldens, then every comparison, through the ledger; then the table and the narrowing.

    The engine work runs on the sequential executor, or with `ray` (an address or
    ``local``) on the Ray executor; the plan, the storing and the judging are the same."""
    t0 = time.perf_counter()
    p = plan(suite, ids)
    led = workspace.ledger(root)
    before = len(led.entries())
    if ray is not None:
        from diffcheck.workflows import matrix_ray

        executor = matrix_ray.RayExecutor(ray, echo=echo, verbose=verbose, cpus_per_rank=cpus_per_rank)
        comparisons, golden_errors = run_plan(suite, p, executor, root=root, echo=echo, force=force, verbose=verbose)
    else:
        with _Interrupt() as interrupt:
            executor = executors.SequentialExecutor(echo=echo, verbose=verbose, check=interrupt.check)
            comparisons, golden_errors = run_plan(suite, p, executor, root=root, echo=echo, force=force,
                                                  verbose=verbose, check=interrupt.check)
    result = collect(suite, p, comparisons, golden_errors, root=root, strict=strict, baseline=baseline)
    result.seconds = time.perf_counter() - t0
    result.engine_runs = len(led.entries()) - before
    return result


def run_plan(suite, p: Plan, executor, *, root: Path, echo: Echo, force: bool, verbose: bool,
             check: Callable[[], None] = lambda: None):
    """The plan through `executor`: goldens first (stored as each returns), then the candidates the
    ledger does not hold (stored as each returns), then every candidate judged from its stored
    files. Returns (comparisons, golden errors)."""
    n, k = p.steps, 0
    golden_errors: dict[str, str] = {}
    jobs = []
    for case in p.references:
        k += 1
        if workspace.golden_up_to_date(workspace.golden_path(root, case), case):
            echo(f"case {k} of {n}: {case.id}: golden up to date")
            continue
        jobs.append(executors.Job(case, f"case {k} of {n}: golden {case.id} ({case.description or 'reference'})"))
    for case, run, error in executor.goldens(jobs):
        if error is not None:
            golden_errors[case.id] = error
            echo(f"{case.id}: golden failed: {error}")
            continue
        echo(f"{case.id}: golden {workspace.store_golden(root, case, run).status}")
    comparisons: dict[str, Any] = {}
    jobs, goldens_of = [], {}
    for case in p.compared:
        k += 1
        label = f"case {k} of {n}: {case.id} vs {', '.join(case.references)} ({case.description or 'candidate'})"
        missing = [r for r in case.references if r in golden_errors]
        if missing:
            comparisons[case.id] = comparemod.error_comparison(
                case, f"golden {missing[0]} failed: {golden_errors[missing[0]]}")
            continue
        goldens = {r: workspace.load_golden(root, suite.name, r) for r in case.references}
        mode, _ = replaymod.mode_for(case, None)
        forced_along = sessionmod.candidate_references(case, list(case.references))
        hit = None if force else workspace.cached_candidate(case, forced_along, goldens, root=root, mode=mode)
        if hit is not None:
            echo(f"{label}: in the ledger")
            for line in hit[2]:
                echo(line)
            continue
        goldens_of[case.id] = goldens
        jobs.append(executors.Job(case, label, ref_cases={r: suite.cases[r] for r in case.references},
                                  goldens=goldens))
    for case, result, error in executor.candidates(jobs):
        if error is not None:
            echo(f"{case.id}: {error}")
            comparisons[case.id] = comparemod.error_comparison(case, error)
            continue
        workspace.store_candidate(case, result.candidate, result.forced, goldens_of[case.id], root=root)
        for r, scored in result.scored.items():
            workspace.store_score(root, r, result.candidate, scored)
    for case in p.compared:
        if case.id not in comparisons:
            comparisons[case.id] = comparemod.compare(suite, case.id, root=root, verbose=verbose, echo=echo,
                                                      run_file=workspace.candidate_file(root, case))
            check()
            echo(f"{case.id}: {comparisons[case.id].verdict.name}")
    return {c.id: comparisons[c.id] for c in p.compared}, golden_errors


class _Interrupt:
    """Ctrl-C stops the matrix, also while vLLM starts an engine.

    - The first SIGINT is remembered, and after every step the matrix checks the flag and
      stops: vLLM can turn a KeyboardInterrupt during its start-up into an engine failure,
      which must not become the case's ERROR (an interrupted case leaves no ledger row; the
      next run does it again).
    - The kernel may deliver SIGINT to any thread (vLLM's and rich's helpers) while the main
      thread sits in one long C call (vLLM waits for its engine process in a zmq poll): a
      watcher thread reads the signal from Python's wakeup fd and re-sends it to the main
      thread if the main thread has not handled it within half a second.
    - vLLM can also swallow the interrupt during start-up and go on waiting for an engine
      process the same Ctrl-C ended. If the matrix has not stopped `GRACE_S` after the
      signal, the watcher ends this process's children and exits with 130. Every file
      and ledger row is written atomically, so what finished stays valid.
    """

    GRACE_S = 20.0

    def __init__(self) -> None:
        self.hit = False
        self.left = False
        self.previous = None
        self.previous_fd = -1
        self.pipe = None

    def __enter__(self) -> "_Interrupt":
        import signal
        import socket
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self
        self.previous = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, self._handler)
        self.pipe = socket.socketpair()
        self.pipe[1].setblocking(False)
        self.previous_fd = signal.set_wakeup_fd(self.pipe[1].fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(threading.main_thread().ident, self.pipe[0]),
                         name="diffcheck-matrix-sigint", daemon=True).start()
        return self

    def _watch(self, main_ident: int, sock) -> None:
        import signal
        import time

        while True:
            try:
                data = sock.recv(64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGINT not in data:
                continue
            time.sleep(0.5)
            if not self.hit and not self.left:  # it landed on another thread: hand it to the main thread
                signal.pthread_kill(main_ident, signal.SIGINT)
            deadline = time.monotonic() + self.GRACE_S
            while not self.left and time.monotonic() < deadline:
                time.sleep(0.2)
            if not self.left:
                self._hard_exit()

    def _hard_exit(self) -> None:
        import sys

        try:
            import psutil

            for child in psutil.Process().children(recursive=True):
                try:
                    child.kill()
                except psutil.Error:
                    pass
        except ImportError:
            pass
        print(f"diffcheck: interrupted; the engine did not stop within {self.GRACE_S:.0f}s, ended it",
              file=sys.stderr, flush=True)
        os._exit(130)

    def _handler(self, signum, frame) -> None:
        self.hit = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.hit:
            raise KeyboardInterrupt

    def __exit__(self, *exc) -> None:
        import signal

        self.left = True
        if self.previous is not None:
            signal.set_wakeup_fd(self.previous_fd)
            signal.signal(signal.SIGINT, self.previous)
            for s in self.pipe:
                s.close()


# -- the table --------------------------------------------------------------------------------------


def run_metrics(run: Run | None) -> dict[str, Any]:
    """The seed's text metrics over a run's sequences: worst digit_ratio and max_digit_run, summed runs."""
    if run is None:
        return {}
    from diffcheck.judging.quality import text_metrics

    per = [text_metrics(s.text, s.n_tokens) for s in run.sequences]
    if not per:
        return {}
    return {"digit_ratio": max(m["digit_ratio"] for m in per), "weird_runs": sum(m["weird_runs"] for m in per),
            "repeated_num_runs": sum(m["repeated_num_runs"] for m in per),
            "max_digit_run": max(m["max_digit_run"] for m in per), "tokens": run.n_tokens}


def _onset(verdict: CaseVerdict) -> int | None:
    onsets = [s.onset for s in verdict.sequences if s.onset is not None]
    return min(onsets) if onsets else None


def _same_groups(outputs: dict[str, str | None]) -> dict[str, tuple[str, ...]]:
    groups: dict[str, list[str]] = {}
    for cid, digest in outputs.items():
        if digest:
            groups.setdefault(digest, []).append(cid)
    return {cid: tuple(c for c in groups[d] if c != cid) for cid, d in outputs.items() if d}


def collect(suite, p: Plan, comparisons: dict, golden_errors: dict[str, str], *, root: Path, strict: bool = False,
            baseline: str | None = None) -> MatrixResult:
    """The rows, outcomes and narrowing of a finished matrix (no engine)."""
    from diffcheck import cases as casesmod
    from diffcheck.core.types import fails
    from diffcheck.storage import store

    result = MatrixResult(suite=suite, comparisons=comparisons, left_out=p.left_out)
    outputs: dict[str, str | None] = {}
    runs: dict[str, Run | None] = {}
    for ref in p.references:
        path = store.run_path(root, suite.name, ref.id)
        run = store.read_run(path) if ref.id not in golden_errors and path.exists() else None
        runs[ref.id] = run
        outputs[ref.id] = store.output_digest(run) if run is not None else None
    for cid, comp in comparisons.items():
        runs[f"{cid}@run"] = comp.candidate
        outputs[f"{cid}@run"] = store.output_digest(comp.candidate) if comp.candidate is not None else None
    same = _same_groups(outputs)

    def label(key: str) -> str:
        return key[:-4] if key.endswith("@run") else key

    for ref in p.references:
        if ref.id in comparisons:
            continue  # shown with its comparison
        run = runs[ref.id]
        result.rows.append(Row(case_id=ref.id, reference_id=None,
                               verdict="ERROR" if ref.id in golden_errors else "golden",
                               tokens_per_s=(run.meta.timings or {}).get("tokens_per_s") if run else None,
                               metrics=run_metrics(run), output=outputs[ref.id],
                               same_as=tuple(sorted({label(k) for k in same.get(ref.id, ())} - {ref.id})),
                               note=golden_errors.get(ref.id, "")))
        if ref.id not in golden_errors:
            result.outcomes[ref.id] = "clean"
    for case in p.compared:
        comp = comparisons[case.id]
        run = comp.candidate
        key = f"{case.id}@run"
        for v in comp.verdicts:
            result.rows.append(Row(case_id=case.id, reference_id=v.reference_id, verdict=v.verdict.name,
                                   delta=casesmod.config_delta(case, casesmod.get_case(suite, v.reference_id)),
                                   onset=_onset(v),
                                   tokens_per_s=(run.meta.timings or {}).get("tokens_per_s") if run else None,
                                   metrics=run_metrics(run), output=outputs.get(key),
                                   same_as=tuple(sorted({label(k) for k in same.get(key, ())} - {case.id})),
                                   note=v.error or ""))
        if comp.verdict is not Verdict.ERROR:
            result.outcomes[case.id] = "bad" if fails(comp.verdict, strict=strict) else "clean"
    result.narrowing = narrow_suite(suite, result.outcomes, baseline=baseline,
                                    same_output=_first_same(result.rows))
    return result


def _first_same(rows: list[Row]) -> dict[str, str]:
    """case -> the first other case (table order) with the same output."""
    order = list(dict.fromkeys(r.case_id for r in rows))
    out = {}
    for r in rows:
        earlier = [c for c in r.same_as if c in order and order.index(c) < order.index(r.case_id)]
        if earlier and r.case_id not in out:
            out[r.case_id] = earlier[0]
    return out


def default_baseline(suite, outcomes: dict[str, str]) -> str:
    """The first reference of the suite with no references of its own (J), else the first case."""
    refs = [c.id for c in suite.cases.values() if c.role == "reference" and not c.references]
    return refs[0] if refs else next(iter(suite.cases))


def narrow_suite(suite, outcomes: dict[str, str], *, baseline: str | None = None,
                 explicit: dict[str, dict] | None = None, same_output: dict[str, str] | None = None):
    """`narrow.narrow` over the suite's resolved configs relative to `baseline`."""
    from diffcheck import cases as casesmod
    from diffcheck.judging import narrow

    base_id = baseline or default_baseline(suite, outcomes)
    base = casesmod.get_case(suite, base_id)
    ids = [c for c in outcomes if c in suite.cases]
    configs = {c: casesmod.resolved_config(suite.cases[c]) for c in ids}
    facts = narrow.case_factors(configs, baseline=casesmod.resolved_config(base), explicit=explicit or {})
    return narrow.narrow({c: outcomes[c] for c in ids}, facts, same_output=same_output)


def from_outcomes(suite, path: str | Path) -> MatrixResult:
    """The table and the narrowing of recorded outcomes (`diffcheck.cases.outcomes`): no engine."""
    from diffcheck import cases as casesmod
    from diffcheck.cases.outcomes import load_outcomes

    rec = load_outcomes(path, suite=suite)
    result = MatrixResult(suite=suite)
    outputs = {cid: r.output for cid, r in rec.ids.items()}
    # Recorded hashes may be prefixes of different lengths: equal when one starts the other.
    same = {cid: tuple(o for o, d in outputs.items() if o != cid and d and h and (d.startswith(h) or h.startswith(d)))
            for cid, h in outputs.items()}
    for cid, r in rec.ids.items():
        case = suite.cases[cid]
        ref = case.references[0] if case.references else None
        delta = casesmod.config_delta(case, casesmod.get_case(suite, ref)) if ref else {}
        result.rows.append(Row(case_id=cid, reference_id=ref, verdict=r.outcome, delta=delta,
                               tokens_per_s=r.tokens_per_s, metrics=dict(r.metrics), output=r.output,
                               same_as=same.get(cid, ()), note=r.reason))
        if r.outcome in ("bad", "clean"):
            result.outcomes[cid] = r.outcome
    result.left_out = tuple(cid for cid, r in rec.ids.items() if r.outcome == "not-a-verdict")
    result.narrowing = narrow_suite(suite, result.outcomes, baseline=rec.baseline,
                                    explicit={cid: r.factors for cid, r in rec.ids.items()},
                                    same_output=_first_same(result.rows))
    return result


# The matrix's table, Markdown, JSON, JUnit and HTML: diffcheck.report.matrix, through the report registry.


def check_ray_address(value: str | None) -> str | None:
    """``--ray`` alone means a local cluster; else HOST:PORT or ``auto``."""
    if value is None or value in ("local", "auto") or ":" in value:
        return value
    raise DiffcheckError(f"--ray {value}: not a cluster address (valid: HOST:PORT, auto, or --ray alone for a "
                         "local cluster; write --ray=ADDRESS, or --ray last, when case ids follow)")
