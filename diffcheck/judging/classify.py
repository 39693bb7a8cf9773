"""Judge a candidate run against a reference golden, sequence by sequence.

Knows runs (`types.Run`) and the judging modules; nothing about engines, files or
rendering. Pure: the same runs, floor and tolerances always give the same verdict.

Inputs: the reference golden and the candidate run (kind "generate"), optionally the
candidate teacher-forced along the reference (`forced`, kind "forced"), the
reference's scoring of the candidate's tokens (`scored`, kind "scored") and the
reference's noise floor (`floor.Floor`).

The parts, each in its own module:

- `align`: t*, the first divergence; `paths`: the same-context step pairs (before
  t*, and the forced replay) with their per-sequence reductions;
- `signals`: garbage evidence (CUSUMs of NLL, confident garbage, loops, text
  metrics, persistent departures of the forced path), which locates an onset;
- `decision`: amount (mean KL) and direction (loss on the reference's own tokens)
  against the floor's margins or a precision budget, with confidence and power;
- `judge`: one sequence in full: GIBBERISH when a signal triggers, else the
  decision: IDENTICAL / BENIGN_DRIFT inside the floor, WITHIN_BUDGET for a
  spec-changing candidate inside its budget, DEGRADED beyond;
- `baselines`: what vLLM's exact-match and check_logprobs_close rules would say.

ERROR verdicts come from callers (`error_verdict`). A case's verdict is its worst
sequence's; which verdicts fail is `policy`'s business. Sequences that are identical
and plainly inside the floor take a vectorized fast path; only the others are judged
one by one (`judge.Judge`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from diffcheck.core.errors import DataError
from diffcheck.judging import stats as S
from diffcheck.judging.align import align
from diffcheck.judging.decision import family, far_step_level, margins_text
from diffcheck.judging.baselines import baselines
from diffcheck.judging.floor import Floor, spec_change
from diffcheck.judging.judge import Judge
from diffcheck.judging.paths import Layout, Limits, check_follows, same_context_path
from diffcheck.judging.signals import nll
from diffcheck.judging.tolerances import BUDGETS, Tolerances, budget_for  # noqa: F401  (public here too)
from diffcheck.core.types import CaseVerdict, Run, SequenceVerdict, Verdict

def error_verdict(candidate_id: str, reference_id: str, message: str) -> CaseVerdict:
    """The verdict of a case whose candidate engine failed: ERROR, no sequences."""
    counts = {v.name: 0 for v in Verdict}
    return CaseVerdict(
        candidate_id=candidate_id,
        reference_id=reference_id,
        verdict=Verdict.ERROR,
        sequences=(),
        summary={"counts": counts, "n_sequences": 0},
        error=message,
    )



def _check_kind(run: Run, kind: str, what: str) -> None:
    if run.meta.kind != kind:
        raise DataError(f"{what} run {run.meta.case_id!r} has kind {run.meta.kind!r}; expected {kind!r}")


def _text_metrics(run: Run, diverged: np.ndarray) -> list[dict]:
    from diffcheck.judging.quality import text_metrics  # lazy: written beside this core, not needed to import it

    return [text_metrics(s.text, n_tokens=s.n_tokens) if d else {} for s, d in zip(run.sequences, diverged.tolist())]


def _sequence_verdicts(judge: Judge, *, fast: list[bool], layouts, exact: np.ndarray, close: np.ndarray
                       ) -> list[SequenceVerdict]:
    """One SequenceVerdict per sequence: built directly where `fast`, else by `judge`.

    Per-step curves for plots are views into flat columns, negated once for all
    sequences. The loop runs once per sequence, so it works on Python lists."""
    reference, candidate, scored = judge.reference, judge.candidate, judge.scored
    al, pre, fpath, metrics = judge.alignment, judge.before, judge.forced_path, judge.metrics
    ref, cand, scored_layout = layouts
    ref_nll_all, cand_nll_all = nll(reference.steps.logprob), nll(candidate.steps.logprob)
    scored_nll_all = nll(scored.steps.logprob) if scored is not None else None
    nll_means = {"ref_nll_reference_mean": (ref_nll_all, ref), "candidate_nll_mean": (cand_nll_all, cand)}
    if judge.scored_reference is not None:
        # The reference's own text as the scorer reads it: every reference NLL the scored run is
        # set against (the CUSUM's baseline, the curves, the means) comes from the same engine;
        # the golden's own logprobs stay beside them as ``ref_nll_reference_recorded_mean``.
        nll_means["ref_nll_reference_recorded_mean"] = (ref_nll_all, ref)
        ref_nll_all = nll(judge.scored_reference.steps.logprob)
        nll_means["ref_nll_reference_mean"] = (ref_nll_all, ref)
    if scored is not None:
        nll_means["ref_nll_candidate_mean"] = (scored_nll_all, scored_layout)
    nll_columns = [(S.segment_sum(x, lay.off) / np.maximum(lay.lens, 1)).tolist() for x, lay in nll_means.values()]
    nll_table = [dict(zip(nll_means, row)) for row in zip(*nll_columns)]
    pre_off, ref_off, cand_off = pre.off.tolist(), judge.ref_off.tolist(), judge.cand_off.tolist()
    forced_off = fpath.off.tolist() if fpath is not None else None
    scored_off = judge.scored_off.tolist() if scored is not None else None
    pre_table = pre.agg.table()
    forced_table = fpath.agg.table("forced_") if fpath is not None else None
    lens = al.reference_len.tolist()
    exact_l, close_l = exact.tolist(), close.tolist()
    margins_line = margins_text(judge.limits.floor, *judge.limits.margins)
    out = []
    for i in range(len(al)):
        a, b = pre_off[i], pre_off[i + 1]
        series = {
            "dlogprob": pre.stats.dlogprob[a:b],
            "kl": pre.stats.kl[a:b],
            "ref_nll_reference": ref_nll_all[ref_off[i]:ref_off[i + 1]],
            "candidate_nll": cand_nll_all[cand_off[i]:cand_off[i + 1]],
        }
        stats = pre_table[i] | nll_table[i]
        if forced_off is not None:
            fa, fb = forced_off[i], forced_off[i + 1]
            series["forced_kl"] = fpath.stats.kl[fa:fb]
            series["forced_dlogprob"] = fpath.stats.dlogprob[fa:fb]
            stats |= forced_table[i]
        if scored_off is not None:
            series["ref_nll_candidate"] = scored_nll_all[scored_off[i]:scored_off[i + 1]]
        baselines = {"exact_match": exact_l[i], "check_logprobs_close": close_l[i]}
        if fast[i]:
            n = lens[i]
            out.append(SequenceVerdict(
                index=i, prompt_id=reference.sequences[i].prompt_id, verdict=Verdict.IDENTICAL, t_star=None,
                onset=None, shared_prefix=n, reference_len=n, candidate_len=n,
                evidence=(f"tokens identical over {n} steps, every step exactly the reference's: shown within the "
                          f"noise floor: mean KL "
                          f"{stats['kl_mean']:.2g} (margin {judge.limits.kl_margin:.2g}), max {stats['kl_max']:.2g}",
                          margins_line),
                stats=stats, baselines=baselines, quality=metrics[i], series=series,
            ))
        else:
            out.append(judge.sequence(i, {"stats": stats, "series": series, "baselines": baselines}))
    return out


def compare_runs(
    reference: Run,
    candidate: Run,
    *,
    forced: Run | None = None,
    scored: Run | None = None,
    scored_reference: Run | None = None,
    tolerances: Tolerances = Tolerances(),
    candidate_id: str = "",
    reference_id: str = "",
    token_text: Callable[[int], str] | None = None,
    text_metrics: bool = True,
    floor: Floor | None = None,
    looks: int = 1,
    forced_reference: Run | None = None,
) -> CaseVerdict:
    """Judge every candidate sequence against its reference sequence.

    `forced`: the candidate teacher-forced along the reference's tokens; `scored`: the
    reference's logprobs of the candidate's tokens. `scored_reference`: the same scoring engine's
    logprobs of the reference's own tokens, given when `scored` came from other hardware than the
    reference run (`workflows.compare`: a GPU golden, scored on a CPU): the reference NLL that
    `scored` is compared with (the CUSUM's baseline μ0, the NLL shown beside the candidate's, the
    margin at t*) is then this run's, so no rule sets the NLL of one machine against another's.
    The other rules that read `scored` use fixed thresholds, not a baseline (confident garbage:
    >= `implausible_nll` nats, 6 by default); the floor decision reads neither run.
    `token_text` renders a token id for evidence (e.g. a tokenizer's decode); without it tokens
    show as ``#id``.
    ``text_metrics=False`` skips the seed's text metrics, which are per-character
    Python and can cost more than the whole numeric comparison: every
    `SequenceVerdict.quality` is then empty and the text-metric signal is off.
    `floor`: the reference's noise floor (`floor.build_floor`); without one, margins
    are the minimum effect of interest (`tolerances.min_effect`) and the summary says so.
    Every test is corrected for the comparison's tests (`decision.family`: every sequence's
    tests times `looks`, the looks a sequential extension plans), whichever command asks, and
    the summary states them (``tests``). `forced_reference`: the
    reference path `forced` followed when it is longer than `reference` (a sequential
    extension, `judging.sequential`): the forced path's statistics read it, from the same
    prompts and the same first tokens; alignment, t* and the text signals still read
    `reference`.
    """
    tol = tolerances
    _check_kind(reference, "generate", "reference")
    _check_kind(candidate, "generate", "candidate")
    floor = floor if floor is not None else Floor()
    change = spec_change(reference, candidate)
    budget = budget_for(change, tol)
    ref, cand = Layout.of(reference), Layout.of(candidate)
    al = align(reference, candidate, reference_len=ref.lens, candidate_len=cand.lens)
    n_forced = None
    if forced is not None:
        _check_kind(forced, "forced", "forced")
        forced_layout = Layout.of(forced)
        lead, lead_layout = reference, ref
        if forced_reference is not None:
            _check_kind(forced_reference, "generate", "forced reference")
            lead, lead_layout = forced_reference, Layout.of(forced_reference)
            check_follows(forced_reference, reference, lead_layout, ref, what="reference", against="extended reference")
        n_forced = check_follows(lead, forced, lead_layout, forced_layout, what="forced", against="reference")
    tests = family(len(al), budget=budget is not None, looks=looks)
    # the far-step rule reads, per sequence, the steps before t*, t* itself and the forced path
    far_steps = int(ref.lens.max(initial=0)) + 1 + (int(n_forced.max(initial=0)) if n_forced is not None else 0)
    lim = Limits.of(floor, tol, tests=tests.m, steps=far_steps)
    pre = same_context_path(reference, candidate, ref, cand, al.shared_prefix, tol, lim)
    fpath = scored_layout = None
    if forced is not None:
        fpath = same_context_path(lead, forced, lead_layout, forced_layout, n_forced, tol, lim)
    if scored is not None:
        _check_kind(scored, "scored", "scored")
        scored_layout = Layout.of(scored)
        check_follows(candidate, scored, cand, scored_layout, what="scored", against="candidate")
    if scored_reference is not None:
        if scored is None:
            raise DataError("a scored reference run is the baseline of a scored candidate run; there is none")
        _check_kind(scored_reference, "scored", "scored reference")
        sref_layout = Layout.of(scored_reference)
        check_follows(reference, scored_reference, ref, sref_layout, what="scored reference", against="reference")
        if not np.array_equal(sref_layout.lens, ref.lens):
            raise DataError("the scored reference run must score every step of the reference run")
    exact, close = baselines(reference, candidate, ref, cand, al, tol)
    # Text metrics only where they can matter: an identical sequence's text is the
    # reference's, so it cannot raise a text signal (reports fill those in for display).
    metrics = _text_metrics(candidate, al.t_star >= 0) if text_metrics else [{} for _ in candidate.sequences]
    judge = Judge(reference=reference, candidate=candidate, scored=scored, scored_reference=scored_reference,
                  layouts=(ref, cand, scored_layout), alignment=al, before=pre, forced_path=fpath, tol=tol,
                  limits=lim, budget=budget, change=change, tests=tests.m, metrics=metrics, token_text=token_text)

    # The case summary's percentiles partition every same-context step: run them on a
    # thread (numpy releases the GIL there) while this thread judges sequences.
    pool = ThreadPoolExecutor(max_workers=1) if S.WORKERS > 1 else None
    try:
        summaries = [S.summarize(p.stats) if pool is None else pool.submit(S.summarize, p.stats)
                     for p in (pre, fpath) if p is not None]
        # identical and plainly within the floor: judged without a Python-level look. "Plainly"
        # means shown by observation, not estimated: the tokens are the reference's over the
        # whole sequence and so is every number on the path the decision reads (KL 0 and Δ 0 at
        # every step), whatever the length: there is no effect to bound. Anything else, however
        # close, goes through the two one-sided tests (`judge`), where few steps are thin.
        # Both paths: a generate whose logprobs moved on the golden's tokens is not "exactly the
        # reference's" even where the forced replay is (the judge says which moved).
        plain = (pre.agg.kl_max == 0) & (pre.agg.dlogprob_abs_max == 0)
        if fpath is not None:
            plain &= (fpath.agg.kl_max == 0) & (fpath.agg.dlogprob_abs_max == 0)
        fast = ((al.t_star < 0) & pre.agg.ok & (fpath.agg.ok if fpath is not None else True) & plain).tolist()
        out = _sequence_verdicts(judge, fast=fast, layouts=(ref, cand, scored_layout), exact=exact, close=close)
        if pool is not None:
            summaries = [f.result() for f in summaries]
    finally:
        if pool is not None:
            pool.shutdown()

    # counted without touching each verdict's enum (its attribute access is slow Python)
    judged = [sv.verdict for sv, f in zip(out, fast) if not f]
    counts = {v.name: judged.count(v) for v in Verdict}
    counts[Verdict.IDENTICAL.name] += sum(fast)
    same = summaries[0]
    summary: dict[str, Any] = {
        "counts": counts,
        "n_sequences": len(out),
        "n_reference_tokens": reference.n_tokens,
        "n_candidate_tokens": candidate.n_tokens,
        "n_same_context": same.pop("n"),
        **same,
        "baselines": {"exact_match": int(exact.sum()), "check_logprobs_close": int(close.sum())},
        "floor": {"description": floor.describe(), **floor.as_dict(), "kl_margin": lim.kl_margin,
                  "loss_margin": lim.loss_margin, "far_kl": lim.far,
                  "margins": {"kl": lim.margins[0].as_dict(), "loss": lim.margins[1].as_dict(),
                              "text": margins_text(floor, *lim.margins)},
                  "far_step_level": far_step_level(floor, lim.far, steps=far_steps), "far_steps": far_steps},
        "min_effect": tol.min_effect,
        "tests": tests.as_dict(tol.alpha),
        "signals": {"forced": forced is not None, "scored": scored is not None, "floor": floor.measured,
                    **({"scored_reference": True} if scored_reference is not None else {})},
        "spec_change": {k: list(v) for k, v in change.items()},
    }
    if budget is not None:
        summary["budget"] = {"kl": budget.kl, "loss": budget.loss}
    if fpath is not None:
        summary["forced"] = summaries[1]
        summary["precision_cost"] = _cost(fpath.stats)
    return CaseVerdict(
        candidate_id=candidate_id,
        reference_id=reference_id,
        verdict=Verdict.worst(v for v in Verdict if counts[v.name]),
        sequences=tuple(out),
        summary=summary,
    )


def _cost(st: S.StepStats) -> dict[str, Any]:
    """The forced path's cost, the way llama.cpp reports a quantization: mean KL ± se,
    same top-1, and the paired ΔNLL of the reference's tokens (mean ± se, percentiles)."""
    from diffcheck.judging.decision import batch_means_se

    kl, d = st.kl.astype(np.float64), st.dlogprob.astype(np.float64)
    if kl.size == 0:
        return {}
    return {
        "kl_mean": float(kl.mean()), "kl_mean_se": batch_means_se(kl),
        "same_top1": float(st.top1.mean()),
        "delta_nll_mean": float(-d.mean()), "delta_nll_se": batch_means_se(-d),
        "delta_nll_p5": float(np.quantile(-d, 0.05)), "delta_nll_p95": float(np.quantile(-d, 0.95)),
    }
