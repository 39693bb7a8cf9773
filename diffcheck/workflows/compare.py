"""``diffcheck compare``: a candidate judged against its references' goldens and noise floors.

The workflow: the ledger's identical run, or one engine start (generate, then forced
replay along each golden: `diffcheck.engines.session`); the reference engine's scoring
of a candidate that diverged; every file written by `diffcheck.workspace`; then the
pure judge (`diffcheck.judging.classify`) against each reference's floor.

Cross-hardware scoring: a recorded run (``--run``) whose golden was recorded on a GPU this
machine lacks, with no scored file beside it, is scored by the reference's model on this
machine's CPU in float32 (`sessionmod.on_this_cpu`), and so are the golden's own tokens: the
judge reads the candidate's scored NLL against that baseline, never against the GPU's
(`classify.compare_runs`, ``scored_reference``). Both scored runs say so in their meta
(``source["cross_hardware"]``), and so do the output and the report's summary.
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
    (never a cross-hardware scoring: that one is judged only beside its baseline, `_stored_pair`)."""
    stored = workspace.stored_score(root, ref_case.id, candidate)
    if stored is not None and CROSS_HARDWARE not in stored.meta.source:
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
    machine's CPU in float32 (cross-hardware scoring: `_score_here`), which scores the
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
                if beside is not None and CROSS_HARDWARE not in beside.meta.source:
                    scored[r] = beside  # recorded with the run
                    continue
                if r == case.id or not differs(goldens[r], candidate):
                    continue
                pair = _stored_pair(root, folder, r, candidate, goldens[r])
                if pair is None and not score_missing:
                    echo(f"{case.id}: no scored file beside {run_file}; judged without scoring (no engine asked for)")
                    continue
                gpu = _recorded_elsewhere(goldens[r]) if pair is None else None
                try:
                    if pair is not None:
                        scored[r], baselines[r] = pair
                    elif gpu is None:
                        scored[r] = score_candidate(casesmod.get_case(suite, r), candidate, root=root,
                                                    verbose=verbose, echo=echo, session=session)
                    else:
                        if scorers is None:
                            scorers = stack.enter_context(sessionmod.EngineSession(verbose=verbose))
                        scored[r], baselines[r] = _score_here(casesmod.get_case(suite, r), goldens[r], candidate,
                                                              gpu=gpu, root=root, session=scorers, echo=echo)
                except EngineError as exc:
                    failed[r] = exc.message
                    continue
                if r in baselines:
                    echo(f"{case.id} vs {r}: scoring from other hardware: {cross_hardware_note(scored[r], goldens[r])}"
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
    elsewhere = cross_hardware_note(scored, golden) if scored is not None and scored_reference is not None else None
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
        stamp = scored.meta.source[CROSS_HARDWARE]
        signals["scoring"] = {"cross_hardware": True, "note": elsewhere, "golden_hardware": stamp["golden_hardware"],
                              "scorer_hardware": _hardware_name(scored.meta.hardware), "dtype": stamp["dtype"],
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


# -- cross-hardware scoring --------------------------------------------------------------------------

CROSS_HARDWARE = "cross_hardware"  # the key of a scored run's meta.source that says it came from other hardware


def _recorded_elsewhere(golden: Run) -> str | None:
    """The GPU `golden` was recorded on, where this machine has none (its reference engine cannot run
    here as recorded); None where it can."""
    gpu = golden.meta.hardware.get("gpu_name")
    if not gpu:
        return None
    try:
        import torch

        if torch.cuda.is_available():
            return None
    except ImportError:
        pass
    return str(gpu)


def _score_here(ref_case, golden: Run, candidate: Run, *, gpu: str, root: Path,
                session: sessionmod.EngineSession, echo: Echo = print) -> tuple[Run, Run]:
    """Cross-hardware scoring: reference `ref_case`'s model on this machine's CPU in float32
    (`sessionmod.on_this_cpu`, one engine in `session`) scores the candidate's tokens and the golden's
    own, each stamped with where it came from and stored like any scored run (`_store_here`).

    The NLL of a text moves by hundredths of a nat per token between a GPU's bf16 and a CPU's
    float32; garbage scores about 3 nats per token and text about 1, so the scoring still tells one
    from the other. It does not carry finer decisions: the judge sets the scored NLL only against
    the golden's NLL from this same engine (`classify.compare_runs`, ``scored_reference``), and the
    floor decision never reads it. An engine failure is an EngineError (the comparison's ERROR)."""
    r = ref_case.id
    local = sessionmod.on_this_cpu(ref_case)
    echo(f"{candidate.meta.case_id}: golden {r} was recorded on {gpu}, which this machine lacks: scoring the run "
         f"and the golden's own tokens with {r}'s model on this machine's CPU (float32, eager)")
    out = []
    for run in (candidate, golden):
        s = sessionmod.score(local, run, session=session, echo=echo, key=f"{r}/cpu-float32")
        stamp = {"golden_hardware": gpu, "dtype": "float32", "scored": "golden" if run is golden else "candidate"}
        s = dataclasses.replace(s, meta=dataclasses.replace(s.meta, source={**s.meta.source, CROSS_HARDWARE: stamp}))
        out.append(_store_here(root, r, run, s, echo=echo))
    return out[0], out[1]


def _store_here(root: Path, r: str, run: Run, scored: Run, *, echo: Echo = print) -> Run:
    """`workspace.store_score`, except over a stored scoring that did not come from other hardware (one
    recorded with its run, e.g. on the GPU): that one is left as it is and this one kept in memory."""
    path = workspace.scored_file(root, run.meta.suite, run.meta.case_id, r)
    if path.exists():
        try:
            meta = store.read_meta(path)
        except DiffcheckError:
            meta = None
        if meta is not None and CROSS_HARDWARE not in meta.source:
            echo(f"{run.meta.case_id}: {path} holds a scoring made on {_hardware_name(meta.hardware)}: left as it "
                 "is; this machine's scoring is used for this comparison only")
            source = {**scored.meta.source, "scored_digest": store.content_digest(run)}
            return dataclasses.replace(scored, meta=dataclasses.replace(scored.meta, source=source))
    return workspace.store_score(root, r, run, scored)


def _stored_pair(root: Path, folder: Path, r: str, candidate: Run, golden: Run) -> tuple[Run, Run] | None:
    """A stored cross-hardware scoring of `candidate` and of `golden` by reference `r`'s model from one
    engine (same model, hardware and dtype), beside the run or in the workspace; None where there is none."""
    def found(run: Run) -> list[Run]:
        out = []
        paths = {store.run_path(folder.parent, folder.name, run.meta.case_id, kind="scored", reference=r),
                 workspace.scored_file(root, run.meta.suite, run.meta.case_id, r)}
        for path in sorted(p for p in paths if p.exists()):
            try:
                s = store.read_run(path)
            except DiffcheckError:
                continue
            if CROSS_HARDWARE in s.meta.source and s.meta.source.get("scored_digest") == store.content_digest(run):
                out.append(s)
        return out

    for c in found(candidate):
        for g in found(golden):
            if _scorer(c) == _scorer(g):
                return c, g
    return None


def _scorer(run: Run) -> tuple:
    """What a scored run's numbers depend on: the model, the hardware, the dtype."""
    hw = run.meta.hardware
    return (run.meta.model.get("digest"), hw.get("gpu_name"), hw.get("cpu_model"), hw.get("machine"),
            run.meta.source.get(CROSS_HARDWARE, {}).get("dtype"))


def _hardware_name(hw: dict) -> str:
    return str(hw.get("gpu_name") or hw.get("cpu_model") or hw.get("machine") or "unknown hardware")


def cross_hardware_note(scored: Run, golden: Run) -> str:
    """Where a cross-hardware scoring came from, for the output and the report: e.g. "scored on this
    machine's CPU (float32) for a golden recorded on NVIDIA H200"."""
    from diffcheck.engines.base import hardware

    stamp = scored.meta.source.get(CROSS_HARDWARE, {})
    hw = scored.meta.hardware
    if hw.get("gpu_name"):
        where = str(hw["gpu_name"])
    elif hw.get("cpu_model") and hw.get("cpu_model") == hardware().get("cpu_model"):
        where = "this machine's CPU"
    else:
        where = f"a CPU ({_hardware_name(hw)})"
    note = (f"scored on {where} ({stamp.get('dtype', 'float32')}) for a golden recorded on "
            f"{stamp.get('golden_hardware') or _hardware_name(golden.meta.hardware)}")
    here, there = scored.meta.model.get("digest"), golden.meta.model.get("digest")
    if here and there and here != there:
        note += f"; model digest {here[:12]} for the scoring, {there[:12]} in the golden"
    return note
