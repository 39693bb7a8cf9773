"""``diffcheck compare CASE --until-decided``: undecided sequences extended look after look.

The comparison runs as ``compare`` runs it, with both engines kept up (the candidate's,
and the reference's that scores it), and every decision corrected for the looks planned
(`judging.sequential`: Bonferroni over the planned looks, alpha / (m·L) per look). Then,
per reference, while sequences are `INCONCLUSIVE` and their budget allows:

1. the reference engine generates its prompts again, further (the next look's length);
   its first tokens must be the golden's (fp32 on the CPU lane is bitwise reproducible),
   or the command stops with one line saying where they part;
2. the golden is made longer by those rows (`sequential.extend_run`) and the candidate
   engine is teacher-forced along the new steps (from step 0 where the case replays in
   full, else from where the last look ended);
3. the candidate is judged again on the longer forced path (alignment, t* and scoring are
   the candidate's own text's, unchanged).

Nothing extended is written: the stored runs stay the plain comparison's, and the ledger
gets the final verdict.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from diffcheck import cases as casesmod
from diffcheck import workspace
from diffcheck.core import progress
from diffcheck.core.errors import ConfigError, DataError
from diffcheck.core.types import CaseVerdict, Run, Verdict
from diffcheck.engines import replay as replaymod
from diffcheck.engines import session as sessionmod
from diffcheck.judging import sequential as seq
from diffcheck.workflows import compare as comparemod

Echo = Callable[[str], None]


class _Pool(sessionmod.EngineSession):
    """Reference engines, one per configuration: a reference's scoring and its longer generations
    (the same configuration, other sampling) share one start (`EngineSession.rebound`)."""

    def get(self, case, echo: Echo = print):
        return self.rebound(case, echo)


def check_max_tokens(max_tokens) -> int:
    """--max-tokens as an int >= 1, or one line naming the flag and what is valid."""
    try:
        n = int(max_tokens)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or str(max_tokens).strip() not in (str(n), f"{n}.0"):
        raise ConfigError(f"--max-tokens {max_tokens!r} is not valid: a whole number of decode steps >= 1 "
                          f"(default {seq.DEFAULT_MAX_TOKENS})")
    return n


def schedules(case, golden: Run, max_tokens: int) -> dict[int, tuple[int, ...]]:
    """Per golden sequence, the path lengths of its planned looks: from its golden's length by
    doubling up to `max_tokens`, and no further than the engine's max_model_len leaves after its
    prompt. A sequence that ended on its own (EOS, not its length) has its first look only."""
    limit = case.engine.max_model_len
    out = {}
    for i, info in enumerate(golden.sequences):
        cap = max_tokens if limit is None else min(max_tokens, int(limit) - len(info.prompt_token_ids))
        if info.finish_reason != "length":
            cap = info.n_tokens
        out[i] = seq.plan_looks(info.n_tokens, cap)
    return out


def until_decided(suite, case_id: str, *, root: Path, max_tokens: int = seq.DEFAULT_MAX_TOKENS,
                  verbose: bool = False, force: bool = False, echo: Echo = print, replay: str | None = None,
                  own_golden: bool | None = None) -> comparemod.Comparison:
    """`compare`, then the sequential extension of every `INCONCLUSIVE` sequence (module docstring)."""
    import contextlib

    max_tokens = check_max_tokens(max_tokens)
    case = casesmod.get_case(suite, case_id)
    references = comparemod.judged_references(case, own_golden)
    goldens = {r: workspace.load_golden(root, suite.name, r) for r in references}
    plans = {r: schedules(casesmod.get_case(suite, r), g, max_tokens) for r, g in goldens.items()}
    looks = seq.planned_looks(s for p in plans.values() for s in p.values())
    echo(f"{case.id}: until decided: at most {looks} look(s) per sequence, paths up to {max_tokens} steps; "
         f"every look judged at alpha / (the comparison's tests x {looks}) ({seq.RULE})")
    with contextlib.ExitStack() as stack:
        ref_pool = stack.enter_context(_Pool(verbose=verbose))
        # a candidate of its references' configuration (a reference against its own golden) shares their engine
        same = all(sessionmod.config_key(casesmod.get_case(suite, r)) == sessionmod.config_key(case)
                   for r in references)
        cand_pool = ref_pool if same else stack.enter_context(sessionmod.EngineSession(verbose=verbose))
        comparison = comparemod.compare(suite, case_id, root=root, verbose=verbose, force=force, echo=echo,
                                        session=ref_pool, replay=replay, own_golden=own_golden,
                                        candidate_session=cand_pool, looks=looks)
        if comparison.candidate is None:
            return comparison
        verdicts = []
        for v in comparison.verdicts:
            r = v.reference_id
            undecided = [s.index for s in v.sequences if s.verdict is Verdict.INCONCLUSIVE]
            if v.verdict is Verdict.ERROR or not undecided:
                verdicts.append(v)
                continue
            if r not in comparison.forced:
                echo(f"{case.id} vs {r}: {len(undecided)} undecided sequence(s) not extended: no forced replay "
                     "(the candidate's engine cannot be teacher-forced)")
                verdicts.append(_annotated(v, [], {}, looks=looks, max_tokens=max_tokens,
                                           alpha=_tolerances(case).alpha, why="no forced replay"))
                continue
            verdicts.append(_extend(suite, case, r, v, undecided, comparison, plans[r], looks=looks,
                                    max_tokens=max_tokens, ref_pool=ref_pool, cand_pool=cand_pool, root=root,
                                    replay=replay, echo=echo))
    workspace.set_verdict(root, comparison.candidate, Verdict.worst(v.verdict for v in verdicts))
    return dataclasses.replace(comparison, verdicts=tuple(verdicts))


def _tolerances(case):
    from diffcheck.judging import classify

    return classify.Tolerances.of_case(case)


def _extend(suite, case, r: str, first: CaseVerdict, undecided: list[int], comparison, plan, *, looks: int,
            max_tokens: int, ref_pool, cand_pool, root: Path, replay: str | None, echo: Echo) -> CaseVerdict:
    """Reference `r`'s undecided sequences, extended look after look (`sequential.run_looks`)."""
    ref_case = casesmod.get_case(suite, r)
    candidate, golden = comparison.candidate, comparison.goldens[r]
    mode, _ = replaymod.mode_for(case, replay)
    tolerances = _tolerances(case)
    token_text = comparemod.token_texts(case)
    state = {"golden": golden, "forced": comparison.forced[r], "verdict": first, "generated": 0, "forced_tokens": 0}

    def extend(targets: dict[int, int]) -> dict[int, seq.Extended]:
        longest = max(targets.values())
        longer = dataclasses.replace(ref_case, sampling=dataclasses.replace(ref_case.sampling, max_tokens=longest))
        engine = ref_pool.rebound(longer, echo)
        regenerated = engine.generate(progress=progress.task(f"{r}: generating on to {longest} steps"))
        parted = seq.first_departure(golden, regenerated)
        if parted is not None:
            raise DataError(f"--until-decided: reference {r} generated again does not start with its golden "
                            f"({parted}), so its continuation cannot extend the golden's path; the reference must "
                            "be reproducible (fp32 on the CPU lane is), or its golden re-recorded "
                            f"(`diffcheck golden record {r} --update --suite {suite.name}`)")
        before = state["golden"]
        longer_golden, reached = seq.extend_run(before, regenerated, targets)
        old = {i: before.sequences[i].n_tokens for i in targets}
        grown = [i for i, (n, _) in reached.items() if n > old[i]]
        forced, starts = state["forced"], {}
        if grown:
            starts = {i: 0 if mode == "full" else old[i] for i in grown}
            cand_engine = cand_pool.rebound(case, echo)
            order = [starts.get(i) for i in range(len(longer_golden.sequences))]
            part = cand_engine.force(longer_golden, starts=order,
                                     progress=progress.task(f"{case.id}: forced along {r}'s longer path"))
            todo = replaymod.ReplayPlan(mode=mode, starts=tuple(order),
                                        lengths=tuple(s.n_tokens for s in longer_golden.sequences))
            forced = replaymod.assemble(longer_golden, forced, todo, part, reference_id=r,
                                        mechanism=cand_engine.mechanism)
        v = comparemod.judge_reference(suite, case, r, golden=golden, full_golden=golden, candidate=candidate,
                                       forced=forced, scored=comparison.scored.get(r), tolerances=tolerances,
                                       token_text=token_text, looks=comparison.looks, root=root, echo=echo,
                                       forced_reference=longer_golden, quiet=True)
        forced_now = sum(reached[i][0] - starts[i] for i in grown)
        state.update(golden=longer_golden, forced=forced, verdict=v, generated=state["generated"] + regenerated.n_tokens,
                     forced_tokens=state["forced_tokens"] + forced_now)
        out = {}
        for i in targets:
            n_now, ended = reached[i]
            spent = regenerated.sequences[i].n_tokens + (n_now - starts[i] if i in starts else 0)
            out[i] = seq.Extended(steps=n_now, verdict=v.sequences[i].verdict, tokens=spent, ended=ended)
        return out

    tracks = [seq.Track(index=i, schedule=plan[i], looks=[seq.Look(plan[i][0], first.sequences[i].verdict)])
              for i in undecided]
    for t in tracks:
        info = golden.sequences[t.index]
        if len(t.schedule) == 1:
            t.stopped = (f"the reference ended at step {info.n_tokens} ({info.finish_reason})"
                         if info.finish_reason != "length" else f"budget of {t.schedule[-1]} steps reached")

    def on_look(k: int, targets: dict[int, int]) -> None:
        steps = sorted(set(targets.values()))
        progress.activity(f"{case.id} vs {r}: look {k} of at most {looks}")
        echo(f"{case.id} vs {r}: look {k} of at most {looks}: {len(targets)} undecided sequence(s) extended to "
             f"{'/'.join(map(str, steps))} steps")

    seq.run_looks(tracks, extend, on_look=on_look)
    floor, _ = workspace.load_floor(root, suite.name, r, golden, candidate=candidate)
    spent = {"reference_generated": state["generated"], "candidate_forced": state["forced_tokens"]}
    return _annotated(state["verdict"], tracks, spent, looks=looks, max_tokens=max_tokens,
                      alpha=tolerances.alpha, floor=floor, tolerances=tolerances)


def _annotated(v: CaseVerdict, tracks: list[seq.Track], spent: dict, *, looks: int, max_tokens: int,
               alpha: float, why: str = "", floor=None, tolerances=None) -> CaseVerdict:
    """`v` with each extended sequence's looks, tokens, verdict and power reached (first evidence
    lines and ``stats.sequential``), and the rule in ``summary.sequential``."""
    import numpy as np

    tests = int((v.summary.get("tests") or {}).get("m", 1))  # the comparison's tests x looks (`decision.family`)
    by_index = {t.index: t for t in tracks}
    sequences, records = [], []
    for s in v.sequences:
        t = by_index.get(s.index)
        if t is None:
            sequences.append(s)
            continue
        kl, d = s.series.get("forced_kl"), s.series.get("forced_dlogprob")
        power = seq.power_reached(np.asarray(kl), np.asarray(d), floor=floor, tol=tolerances, tests=tests) \
            if kl is not None else None
        rec = seq.record(t, power)
        records.append({"index": s.index, "prompt_id": s.prompt_id, **rec})
        line = seq.describe(t, power)
        # an undecided sequence keeps "inconclusive: ..." (what would decide it) as its headline
        evidence = (s.evidence[:1] + (line,) + s.evidence[1:]) if s.verdict is Verdict.INCONCLUSIVE \
            else (line,) + s.evidence
        sequences.append(dataclasses.replace(s, evidence=evidence, stats={**s.stats, "sequential": rec}))
    summary = {**v.summary, "sequential": {
        "rule": seq.RULE, "looks_planned": looks, "growth": seq.GROWTH, "max_tokens": max_tokens, "tests": tests,
        "alpha": alpha, "alpha_per_look": alpha / max(tests, 1), "power_beta": seq.POWER_BETA,
        "tokens": spent, "sequences": records, **({"not_extended": why} if why else {})}}
    return dataclasses.replace(v, sequences=tuple(sequences), summary=summary)
