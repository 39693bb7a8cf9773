"""``diffcheck compare``: a candidate judged against its references' goldens and noise floors.

The workflow: the ledger's identical run, or one engine start (generate, then forced
replay along each golden: `diffcheck.engines.session`); the reference engine's scoring
of a candidate that diverged; every file written by `diffcheck.workspace`; then the
pure judge (`diffcheck.judging.classify`) against each reference's floor.

Cross-hardware scoring (``--run`` with a golden from a GPU this machine lacks) lives in
`diffcheck.workflows.cross_hardware`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from diffcheck import cases as casesmod
from diffcheck import workspace
from diffcheck.core.errors import ConfigError, DiffcheckError, EngineError
from diffcheck.core.types import CaseVerdict, Run, Verdict
from diffcheck.engines import replay as replaymod
from diffcheck.engines import session as sessionmod
from diffcheck.judging.align import differs
from diffcheck.judging.quality import with_quality
from diffcheck.storage import store
from diffcheck.workflows import cross_hardware as xhw

Echo = Callable[[str], None]


@dataclass(frozen=True)
class Comparison:
    verdicts: tuple[CaseVerdict, ...]
    candidate: Run | None
    goldens: dict[str, Run]
    reused: tuple[str, ...] = ()  # what was reused instead of run again, for the output
    forced: dict[str, Run] = dataclasses.field(default_factory=dict)  # reference id -> forced run, where one exists
    scored: dict[str, Run] = dataclasses.field(default_factory=dict)  # reference id -> its scoring of the candidate
    # reference id -> the same engine's scoring of the golden's own tokens, where the scoring came from
    # other hardware than the golden (cross-hardware scoring): the baseline the scored NLL is judged against
    scored_reference: dict[str, Run] = dataclasses.field(default_factory=dict)
    looks: int = 1  # the looks a sequential extension planned: each comparison's tests are counted times these

    @property
    def verdict(self) -> Verdict:
        return Verdict.worst(v.verdict for v in self.verdicts)


def run_candidate(case, references: list[str], goldens: dict[str, Run], *, root: Path, verbose: bool = False,
                  force: bool = False, echo: Echo = print,
                  replay: str | None = None,
                  session: sessionmod.EngineSession | None = None) -> tuple[Run, dict[str, Run], list[str]]:
    """Generate the candidate and teacher-force it along each golden: one engine start.

    An identical earlier run (same config digest, engine, model, goldens, replay mode) is
    reused from the ledger instead of run again, unless ``force`` (``force`` is about the
    ledger; the replay mode is ``replay``).

    Forced replay runs only where it is needed (`diffcheck.engines.replay`): a sequence
    whose sampled tokens equal the golden's has walked the golden's path already, and its
    forced rows are its own generate rows (reused); a sequence that diverged at t* is
    replayed from t* only, with prompt + the shared prefix as its prompt, and its rows
    before t* are its generate rows. The row at t* then comes from a prefill of the last
    prefix token, not from a decode step. ``replay="full"`` (CLI ``--replay full``, case
    tag ``replay-full``; automatic for faults that count decode steps) replays every
    sequence from step 0, for when the decode path at t* matters. ``meta.source`` of each
    forced run says which sequences were replayed (from which step) and which reused.
    `session`: run on its engine of this configuration, kept open (`EngineSession.rebound`).
    """
    mode, why = replaymod.mode_for(case, replay)
    references = sessionmod.candidate_references(case, references)
    if not force:
        hit = workspace.cached_candidate(case, references, goldens, root=root, mode=mode)
        if hit is not None:
            return hit
    if session is None:
        echo(f"{case.id}: starting candidate engine ({case.description or 'candidate'})")
    cand, forced = sessionmod.generate_and_force(case, references, goldens, mode=mode, why=why, verbose=verbose,
                                                 echo=echo, session=session)
    workspace.store_candidate(case, cand, forced, goldens, root=root)
    return cand, forced, []


def score_candidate(ref_case, candidate: Run, *, root: Path, verbose: bool = False, echo: Echo = print,
                    session: sessionmod.EngineSession | None = None) -> Run:
    """The reference engine's logprobs of the candidate's tokens (prefill scoring), cached by content
    (never a cross-hardware scoring: that one is judged only beside its baseline, `cross_hardware.stored_pair`)."""
    stored = workspace.stored_score(root, ref_case.id, candidate)
    if stored is not None and xhw.CROSS_HARDWARE not in stored.meta.source:
        return stored
    scored = sessionmod.score(ref_case, candidate, session=session, verbose=verbose, echo=echo)
    return workspace.store_score(root, ref_case.id, candidate, scored)


def compare(suite, case_id: str, *, root: Path, run_file: Path | None = None, verbose: bool = False,
            force: bool = False, echo: Echo = print, session: sessionmod.EngineSession | None = None,
            replay: str | None = None, own_golden: bool | None = None,
            view: Callable[[Run], Run] | None = None,
            candidate_session: sessionmod.EngineSession | None = None, looks: int = 1,
            score_missing: bool = True) -> Comparison:
    """Judge candidate `case_id` against each of its references' goldens and noise floors.

    `own_golden`: a reference case is also judged against its own stored golden (default:
    exactly when it has no references): a fresh run with today's code and engine, stored as
    ``<case>.run.parquet`` (candidate role, never over the golden), forced along the
    golden, judged against the golden's floor. No scoring there: the engine that would
    score is the one being checked.

    `run_file`: judge that recorded run (and the forced/scored files beside it)
    instead of running the engine; a missing scored file is computed with the local
    reference engine, and the signals the verdict had are always stated. Where the golden
    was recorded on a GPU this machine lacks, that engine is the reference's model on this
    machine's CPU in float32 (cross-hardware scoring: `cross_hardware.score_here`), which scores the
    golden's own tokens too, as the baseline; the output and the report say where the
    scoring came from. `session` then holds that engine too, under its own key, so the
    comparisons of one command share one start. ``score_missing=False``: no engine at all; a
    run without a scored file is judged without scoring (the output says so; a sequence whose
    garbage only the text shows, with nothing before t* beyond the floor, is INCONCLUSIVE).
    Each comparison is corrected for its own tests
    (`judging.decision.family`), whichever command asks.
    `replay`: the forced-replay mode (`run_candidate`; default partial).
    `view`: the candidate is judged against ``view(golden)`` of each reference (a probe of
    `diffcheck reduce`: the golden cut to the probe's prompts and steps, `judging.align.prefix_view`);
    each floor is still the full golden's. `candidate_session`: the candidate runs on that
    session's engine of its configuration, kept open for the next case that differs only in
    prompts or sampling (`EngineSession.rebound`). `looks`: the most looks a sequential
    extension may take of each sequence (`workflows.sequential`); every decision is then
    corrected for the comparison's tests × looks, this first look included.
    """
    from diffcheck.judging import classify

    case = casesmod.get_case(suite, case_id)
    references = judged_references(case, own_golden)
    full = {r: workspace.load_golden(root, suite.name, r) for r in references}
    goldens = {r: view(g) for r, g in full.items()} if view is not None else full
    tolerances = classify.Tolerances.of_case(case)
    reused: list[str] = []
    failed: dict[str, str] = {}  # reference -> why its scoring engine failed: an ERROR, never judged without it
    baselines: dict[str, Run] = {}  # reference -> its golden scored by the engine that scored the candidate
    if run_file is not None:
        # Offline re-judging: the recorded files; an engine only to score a run with no scored file beside it.
        candidate = store.read_run(Path(run_file))
        folder = Path(run_file).parent
        forced, scored = {}, {}
        with contextlib.ExitStack() as stack:
            scorers = session
            for r in references:
                fp = store.run_path(folder.parent, folder.name, case.id, kind="forced", reference=r)
                sp = store.run_path(folder.parent, folder.name, case.id, kind="scored", reference=r)
                if fp.exists():
                    forced[r] = store.read_run(fp)
                beside = store.read_run(sp) if sp.exists() else None
                if beside is not None and xhw.CROSS_HARDWARE not in beside.meta.source:
                    scored[r] = beside  # recorded with the run
                    continue
                if r == case.id or not differs(goldens[r], candidate):
                    continue
                pair = xhw.stored_pair(root, folder, r, candidate, goldens[r])
                if pair is None and not score_missing:
                    echo(f"{case.id}: no scored file beside {run_file}; judged without scoring (no engine asked for)")
                    continue
                gpu = xhw.recorded_elsewhere(goldens[r]) if pair is None else None
                try:
                    if pair is not None:
                        scored[r], baselines[r] = pair
                    elif gpu is None:
                        scored[r] = score_candidate(casesmod.get_case(suite, r), candidate, root=root,
                                                    verbose=verbose, echo=echo, session=session)
                    else:
                        if scorers is None:
                            scorers = stack.enter_context(sessionmod.EngineSession(verbose=verbose))
                        scored[r], baselines[r] = xhw.score_here(casesmod.get_case(suite, r), goldens[r], candidate,
                                                              gpu=gpu, root=root, session=scorers, echo=echo)
                except EngineError as exc:
                    failed[r] = exc.message
                    continue
                if r in baselines:
                    echo(f"{case.id} vs {r}: scoring from other hardware: {xhw.note(scored[r], goldens[r])}"
                         f"; the golden's own tokens scored there too are the baseline it is judged against")
    else:
        try:
            candidate, forced, reused = run_candidate(case, references, goldens, root=root, verbose=verbose,
                                                      force=force, echo=echo, replay=replay,
                                                      session=candidate_session)
        except EngineError as exc:
            verdicts = tuple(classify.error_verdict(case.id, r, exc.message) for r in references)
            return Comparison(verdicts=verdicts, candidate=None, goldens=goldens)
        scored = {}
        for r in references:
            if r != case.id and differs(goldens[r], candidate):
                try:
                    scored[r] = score_candidate(casesmod.get_case(suite, r), candidate, root=root,
                                                verbose=verbose, echo=echo, session=session)
                except EngineError as exc:
                    failed[r] = exc.message
    token_text = token_texts(case)
    verdicts = []
    for r in references:
        if r in failed:
            echo(f"{case.id} vs {r}: ERROR: scoring with reference {r} failed: {failed[r]}")
            verdicts.append(classify.error_verdict(case.id, r, f"scoring with reference {r} failed: {failed[r]}"))
            continue
        verdicts.append(judge_reference(suite, case, r, golden=goldens[r], full_golden=full[r], candidate=candidate,
                                        forced=forced.get(r), scored=scored.get(r), tolerances=tolerances,
                                        token_text=token_text, looks=looks, root=root, echo=echo,
                                        scored_reference=baselines.get(r)))
    workspace.set_verdict(root, candidate, Verdict.worst(v.verdict for v in verdicts))
    return Comparison(verdicts=tuple(verdicts), candidate=candidate, goldens=goldens, reused=tuple(reused),
                      forced=dict(forced), scored=dict(scored), looks=max(int(looks), 1),
                      scored_reference=dict(baselines))


def judged_references(case, own_golden: bool | None = None) -> list[str]:
    """The references `case` is judged against: its own golden first where it is judged against one
    (`own_golden`, default: a reference without references), then its references."""
    references = list(case.references)
    if own_golden is None:
        own_golden = case.role == "reference" and not references
    if own_golden:
        if case.role != "reference":
            raise ConfigError(f"{casesmod.display_path(case.source)}: case '{case.id}' is a {case.role}: only a "
                              "reference has a golden of its own to be judged against")
        references = [case.id] + [r for r in references if r != case.id]
    if not references:
        raise DiffcheckError(f"case '{case.id}' has no references to compare against (it is a {case.role})")
    return references


def token_texts(case) -> Callable[[int], str] | None:
    """A token id's text in `case`'s tokenizer, for evidence lines (None without a tokenizer)."""
    from diffcheck.engines import models

    tok = models.load_tokenizer(case.model)
    return (lambda t: tok.decode([int(t)])) if tok is not None else None


def judge_reference(suite, case, r: str, *, golden: Run, full_golden: Run, candidate: Run, forced: Run | None,
                    scored: Run | None, tolerances, token_text, looks: int = 1, root: Path, echo: Echo = print,
                    forced_reference: Run | None = None, quiet: bool = False, scored_reference: Run | None = None):
    """The candidate judged against reference `r`'s golden and floor (`classify.compare_runs`), with the
    config delta and the signals it lacked. `forced_reference`: the longer reference path `forced`
    followed (a sequential extension); `quiet`: no lines about the floor and the signals.
    `scored_reference`: the golden's own tokens scored by the engine that scored the candidate, on other
    hardware than the golden's (cross-hardware scoring): the baseline of the scored NLL, and the
    signals say where the scoring came from."""
    from diffcheck.judging import classify

    floor, notes = workspace.load_floor(root, suite.name, r, full_golden, candidate=candidate)
    lacking = _unavailable_signals(case, casesmod.get_case(suite, r))
    if r == case.id:
        lacking = lacking + ["no scoring (own golden: the engine that would score is the one being checked)"]
    elsewhere = xhw.note(scored, golden) if scored is not None and scored_reference is not None else None
    if not quiet:
        for note in notes:
            echo(note)
        scoring = "scoring" + (f" (cross-hardware: {elsewhere})" if elsewhere else "")
        signals = ["generate"] + [name for name, have in (("forced replay", forced is not None),
                                                          (scoring, scored is not None)) if have]
        echo(f"{case.id} vs {r}: signals: {', '.join(signals + lacking)}; {floor.describe()}")
    v = classify.compare_runs(golden, candidate, forced=forced, scored=scored, tolerances=tolerances,
                              candidate_id=case.id, reference_id=r, token_text=token_text, floor=floor, looks=looks,
                              forced_reference=forced_reference, scored_reference=scored_reference)
    delta = casesmod.config_delta(case, casesmod.get_case(suite, r))
    signals = {**v.summary.get("signals", {}), "unavailable": lacking}
    if elsewhere:
        stamp = scored.meta.source[xhw.CROSS_HARDWARE]
        signals["scoring"] = {"cross_hardware": True, "note": elsewhere, "golden_hardware": stamp["golden_hardware"],
                              "scorer_hardware": xhw.hardware_name(scored.meta.hardware), "dtype": stamp["dtype"],
                              "baseline": "the golden's own tokens, scored by the same engine"}
    summary = {**v.summary, "signals": signals}
    return dataclasses.replace(with_quality(v, candidate), config_delta=delta, summary=summary)


def error_comparison(case, message: str) -> Comparison:
    """A comparison that never ran: ERROR against every reference, never a verdict."""
    from diffcheck.judging import classify

    verdicts = tuple(classify.error_verdict(case.id, r, message) for r in case.references)
    return Comparison(verdicts=verdicts, candidate=None, goldens={})


def _unavailable_signals(case, ref_case) -> list[str]:
    """What the engines could not give this comparison: the candidate's forced replay, the reference's scoring."""
    from diffcheck.engines import registry

    return registry.unavailable(case, ("forced_replay",)) + registry.unavailable(ref_case, ("prompt_scoring",))
