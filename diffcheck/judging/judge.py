"""One sequence, judged in full: garbage signals first, then the floor decision.

Knows a comparison's shared state (runs, same-context paths, floor limits, budget)
and builds one `SequenceVerdict`; `classify.compare_runs` builds the state and asks
it only for sequences that are not plainly identical. Pure."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from diffcheck.judging import stats as S
from diffcheck.judging.decision import decide, margins_text, undecided_reasons
from diffcheck.judging.signals import Signal, departure, loop_onset, mean, text_flags
from diffcheck.core.types import SequenceVerdict, Verdict


# Text-level garbage evidence that a generate run alone cannot turn into a verdict while the
# same-context steps before t* (and the flip at t*) are inside the floor: small models loop and
# write digit runs at temperature 0.7 after a benign flip too.
GENERATE_ONLY_SIGNALS = ("text metrics", "repetition loop")


class Judge:
    """Shared state of one comparison; `sequence(i)` judges sequence i in full."""

    def __init__(self, *, reference, candidate, scored, layouts, alignment, before, forced_path, tol, limits,
                 budget, change, tests, metrics, token_text, scored_reference=None):
        self.reference, self.candidate, self.scored = reference, candidate, scored
        # the scorer's logprobs of the reference's own tokens (`classify.compare_runs`), same layout as `reference`
        self.scored_reference = scored_reference
        self.alignment, self.before, self.forced_path, self.tol = alignment, before, forced_path, tol
        self.limits, self.budget, self.change, self.tests = limits, budget, change, tests
        self.metrics, self.token_text = metrics, token_text
        self.ref_off, self.cand_off = layouts[0].off, layouts[1].off
        self.scored_off = layouts[2].off if layouts[2] is not None else None
        al = alignment
        # KL at t* for every sequence that has a token on both sides there, in one call
        self.kl_at_t_star = np.zeros(len(al), np.float32)
        both = np.flatnonzero((al.t_star >= 0) & (al.t_star < np.minimum(al.reference_len, al.candidate_len)))
        if both.size:
            rr, cr = self.ref_off[both] + al.t_star[both], self.cand_off[both] + al.t_star[both]
            r, c = reference.steps, candidate.steps
            self.kl_at_t_star[both] = S.topk_kl(r.topk_ids[rr], r.topk_logprobs[rr], c.topk_ids[cr], c.topk_logprobs[cr])

    def tok(self, token_id: int) -> str:
        return repr(self.token_text(int(token_id))) if self.token_text else f"#{int(token_id)}"

    def ref_metrics(self, i: int) -> dict:
        from diffcheck.judging.quality import text_metrics  # lazy, like _text_metrics

        info = self.reference.sequences[i]
        return text_metrics(info.text, n_tokens=info.n_tokens)

    def at_t_star(self, i: int, t: int) -> str:
        """What happened at t* (same context on both sides), for a kernel engineer."""
        ref, cand, tol = self.reference.steps, self.candidate.steps, self.tol
        rr, cr = int(self.ref_off[i]) + t, int(self.cand_off[i]) + t
        rt, ct = int(ref.token_id[rr]), int(cand.token_id[cr])
        n = min(tol.benign_topn, ref.k, cand.k)
        ref_ids, cand_ids = ref.topk_ids[rr, :n].tolist(), cand.topk_ids[cr, :n].tolist()  # short: lists are fastest
        rank_r = ref_ids.index(ct) if ct in ref_ids else None  # candidate token in the reference's top-N
        rank_c = cand_ids.index(rt) if rt in cand_ids else None  # reference token in the candidate's top-N
        lp_ref = float(ref.logprob[rr])
        if self.scored_reference is not None:  # the margin below sets two logprobs of the same engine apart
            lp_ref = float(self.scored_reference.steps.logprob[rr])
        if self.scored is not None:  # exact: the reference scored this very token in this context
            lp_cand: float | None = float(self.scored.steps.logprob[int(self.scored_off[i]) + t])
        else:
            lp_cand = float(ref.topk_logprobs[rr, rank_r]) if rank_r is not None else None
        if lp_cand is None:
            kth = float(ref.topk_logprobs[rr, n - 1]) if n else float("-inf")
            margin = f" (< {kth:.2f})"
        else:
            margin = f"({lp_cand:.2f}), margin {abs(lp_ref - lp_cand):.2f} nats"
        if rank_r is not None and rank_c is not None:
            member = f"both in each other's top-{max(rank_r, rank_c) + 1}"
        else:
            missing = [(rank_r, "candidate token not in the reference's"), (rank_c, "reference token not in the candidate's")]
            member = "; ".join(f"{what} top-{n}" for rank, what in missing if rank is None)
        return (f"t*={t}: reference {self.tok(rt)}({lp_ref:.2f}) vs candidate {self.tok(ct)}{margin}, "
                f"{member}; KL at t* {self.kl_at_t_star[i]:.3g}")

    def signals(self, i: int, t: int, cand_nll, scored_nll, mu0: float, off_floor: bool) -> list[Signal]:
        """Garbage signals on the candidate's steps from t* on (and the forced path).

        `off_floor`: the same-context distributions are beyond what this candidate
        may cost (its floor, or its precision budget); it decides a loop when there
        is no forced replay."""
        tol, sigs = self.tol, []
        cl = int(self.alignment.candidate_len[i])
        has_text = cl > t
        if has_text and scored_nll is not None:
            x = scored_nll[t:cl]
            cp = S.cusum(x, baseline=mu0, drift=tol.cusum_drift, threshold=tol.cusum_threshold,
                         step_cap=tol.cusum_step_cap)
            if cp is not None:
                on = t + cp.onset
                sigs.append(Signal("reference-NLL CUSUM", on, True, True, (
                    f"reference NLL of candidate text {mean(x[cp.onset:]):.1f} nats/token from step {on} on "
                    f"vs {mu0:.1f} for the reference's own text (CUSUM alarm at step {t + cp.alarm})")))
            sure = (cand_nll[t:t + len(x)] <= -tol.confident_logprob) & (x >= tol.implausible_nll)
            p = S.persistent_onset(sure, window=tol.persist_window, fraction=tol.persist_fraction)
            if p is not None:
                sigs.append(Signal("confident garbage", t + p, True, True, (
                    f"confident garbage: {int(sure[p:].sum())} of {len(sure) - p} steps from step {t + p} have "
                    f"candidate logprob >= {tol.confident_logprob:g} on tokens the reference gives "
                    f">= {tol.implausible_nll:g} nats")))
        elif has_text:
            x = cand_nll[t:]
            cp = S.cusum(x, baseline=mu0, drift=tol.cusum_drift, threshold=tol.cusum_threshold,
                         step_cap=tol.cusum_step_cap)
            if cp is not None:
                on = t + cp.onset
                sigs.append(Signal("candidate self-NLL CUSUM", on, True, True, (
                    f"candidate's own NLL {mean(x[cp.onset:]):.1f} nats/token from step {on} on vs {mu0:.1f} "
                    f"for the reference's own text (no scored run; CUSUM alarm at step {t + cp.alarm})")))
        # A loop is not plausible text, however low the reference scores it. It is garbage
        # when the model is off the reference's path from there on: a persistent departure
        # of the forced path, or without one the same-context steps beyond what this
        # candidate may cost. Alone (a degraded model loops too, and so do small models at
        # temperature 0.7) it is evidence for DEGRADED, not GIBBERISH.
        forced_departure = None
        if self.forced_path is not None and self.forced_path.agg.n_departed[i]:
            forced_departure = departure(self.forced_path.of(i), tol, what="forced replay", name="forced replay",
                                          trigger_ok=False)
        loop = None
        if has_text:
            cand_tokens = self.candidate.sequence(i).token_id.tolist()
            ref_tokens = self.reference.sequence(i).token_id.tolist()
            loop = loop_onset(cand_tokens, ref_tokens, t, tol)
        if loop is not None:
            on, frac, ref_frac = loop
            trigger = forced_departure is not None if self.forced_path is not None else off_floor
            sigs.append(Signal("repetition loop", on, trigger, True, (
                f"repetition loop: {frac:.0%} of the {tol.loop_ngram}-grams from step {on} on repeat earlier ones "
                f"(reference {ref_frac:.0%} over the same steps)")))
        if has_text and self.metrics[i]:
            flags = text_flags(self.metrics[i], self.ref_metrics(i), tol)
            if flags:
                # Without scoring the text metrics decide garbage, but not from a generate run
                # alone whose same-context steps are inside the floor: then nothing says the
                # engine, rather than the small model's own sampling, wrote that text.
                trigger = self.scored is None and (self.forced_path is not None or off_floor)
                how = "the reference's scoring does not confirm it" if self.scored is not None else (
                    "no per-step signal: onset at t*" if trigger else
                    "generate only, and nothing before t* left the floor: decides nothing")
                sigs.append(Signal("text metrics", t, trigger, self.scored is None,
                                    f"text metrics: {', '.join(flags)} ({how})"))
        # departures need marked steps: the vectorized counts skip most sequences.
        # The reference's scoring may not veto a forced path this far off unless the
        # text reads as plausible prose (no loop).
        if forced_departure is not None:
            strong = mean(np.abs(self.forced_path.of(i).dlogprob)[forced_departure.onset:]) >= \
                tol.forced_gibberish_dlogprob
            trigger = has_text and strong and (self.scored is None or loop is not None)
            sigs.append(dataclasses.replace(forced_departure, trigger=trigger))
        if self.before.agg.n_departed[i]:
            sig = departure(self.before.of(i), tol, what="before t*", name="same-context steps before t*",
                             trigger_ok=False)
            sigs += [sig] if sig is not None else []
        return sigs

    def sequence(self, i: int, base: dict) -> SequenceVerdict:
        tol, al, lim = self.tol, self.alignment, self.limits
        t = al.t_star_of(i)
        rl, cl = int(al.reference_len[i]), int(al.candidate_len[i])
        series, stats = base["series"], dict(base["stats"])
        ref_nll, cand_nll = series["ref_nll_reference"], series["candidate_nll"]
        scored_nll = series.get("ref_nll_candidate")
        mu0 = stats["ref_nll_reference_mean"]
        before = self.before.of(i)
        # The path the floor decision reads: the forced replay when there is one (every
        # step of the reference), else the same-context steps before t*.
        if self.forced_path is not None:
            path_name, path = "forced replay", self.forced_path.of(i)
        else:
            path_name, path = "same-context steps" if t is None else "steps before t*", before
        amount, loss, b_amount, b_loss = decide(
            path.kl, path.dlogprob, floor=lim.floor, factor=tol.floor_factor, min_effect_kl=tol.min_effect_kl,
            min_effect_loss=tol.min_effect_loss, alpha=tol.alpha, beta=tol.beta, tests=self.tests,
            budget=self.budget, min_steps=tol.min_steps)
        stats["effects"] = {"path": path_name, "amount": amount.as_dict(), "loss": loss.as_dict()}
        # far steps: same-context steps (before t*, and t* itself) far beyond any benign step
        far_steps = np.flatnonzero(before.kl > lim.far).tolist()
        if t is not None and t < min(rl, cl) and self.kl_at_t_star[i] > lim.far:
            far_steps.append(t)
        if self.forced_path is not None:
            far_steps += [s for s in np.flatnonzero(path.kl > lim.far).tolist() if s not in far_steps]
        beyond_floor = amount.beyond or loss.beyond or bool(far_steps)
        failures: list[str] = []
        notes: list[str] = []
        floor_text = [f"{path_name} vs the noise floor: {amount.text()}; {loss.text()}"]
        if lim.floor.kl_seq_max == 0 and lim.floor.loss_seq_max == 0:
            floor_text.append(margins_text(lim.floor, *lim.margins))  # floor 0: margins are the minimum effect
        if far_steps:
            s0 = min(far_steps)
            kl0 = float(self.kl_at_t_star[i]) if s0 == t else float((before.kl if s0 < len(before) else path.kl)[s0])
            floor_text.append(f"{len(far_steps)} same-context step(s) with KL beyond {lim.far:.3g} ({tol.far_factor:g}x "
                              f"the floor's largest step, at least {tol.far_kl:g}), first at step {s0} (KL {kl0:.3g})")
        verdict, onset = Verdict.IDENTICAL if t is None else Verdict.BENIGN_DRIFT, None
        generate_only_garbage = ""  # why generate-only garbage evidence decides nothing (see `signals`)
        if t is not None:
            # beyond what this candidate may cost: its floor, or its budget for a precision change
            unacceptable = (b_amount.beyond or b_loss.beyond) if self.budget is not None else beyond_floor
            sigs = self.signals(i, t, cand_nll, scored_nll, mu0, off_floor=unacceptable)
            triggers = [s for s in sigs if s.trigger]
            if not triggers and self.forced_path is None and self.scored is None and not unacceptable and any(
                    s.name in GENERATE_ONLY_SIGNALS for s in sigs):
                generate_only_garbage = (
                    "generate only: the text after t* looks like garbage but nothing before it left the floor; "
                    "run with forced replay or scoring to decide")
            if triggers:
                first = min((s for s in sigs if s.locates), key=lambda s: (s.onset, not s.trigger))
                verdict, onset = Verdict.GIBBERISH, first.onset
                notes.append(f"gibberish from step {onset}, located by {first.name}")
                notes += [s.evidence for s in triggers] + [s.evidence for s in sigs if not s.trigger]
                stats["onset_signal"] = first.name
                if scored_nll is not None and onset < scored_nll.size:
                    stats["ref_nll_candidate_after_onset"] = mean(scored_nll[max(onset, t):])
            else:
                notes += [s.evidence for s in sigs]  # short of garbage: shown, judged by the floor below
            if t < min(rl, cl):
                where = self.at_t_star(i, t)
            elif t >= cl:
                reason = self.candidate.sequences[i].finish_reason
                where = (f"candidate ended at step {t} (finish_reason {reason!r}); the reference went on for "
                         f"{rl - t} steps")
                if reason not in ("stop", "length"):  # cut short by the engine (abort, error)
                    failures.append(where)
            else:
                where = (f"reference ended at step {t} (finish_reason "
                         f"{self.reference.sequences[i].finish_reason!r}); the candidate went on for {cl - t} steps")
            if where not in failures:
                notes.insert(1 if verdict is Verdict.GIBBERISH else 0, where)
            if scored_nll is not None and scored_nll.size > t:
                m_c = mean(scored_nll[t:])
                m_r = mean(ref_nll[t:]) if rl > t else mu0
                notes.append(f"reference NLL of candidate text after t* {m_c:.2f} nats/token vs {m_r:.2f} "
                             f"for the reference's own text")
        # A pass must be shown (two one-sided tests, `decision`): within only when both
        # effects' upper bounds are inside their margins on evidence that is not thin.
        shown_within = amount.within and loss.within
        signals = dict(forced=self.forced_path is not None, scored=self.scored is not None,
                       floor_measured=lim.floor.measured)
        undecided: list[str] = []
        if verdict is not Verdict.GIBBERISH and failures:
            verdict = Verdict.DEGRADED
            notes += floor_text
        elif verdict is not Verdict.GIBBERISH and generate_only_garbage:
            verdict = Verdict.INCONCLUSIVE
            undecided = [generate_only_garbage]
            notes += floor_text
        elif verdict is not Verdict.GIBBERISH:
            if self.budget is not None and (beyond_floor or not shown_within):
                cost = (f"precision cost of {_change_text(self.change)}: {b_amount.text()}; {b_loss.text()} "
                        f"(budget KL {self.budget.kl:g}, loss {self.budget.loss:g})")
                stats["effects"]["budget"] = {"amount": b_amount.as_dict(), "loss": b_loss.as_dict(),
                                              "kl": self.budget.kl, "loss_budget": self.budget.loss}
                if b_amount.beyond or b_loss.beyond:
                    verdict = Verdict.DEGRADED
                    failures.append(cost)
                elif b_amount.within and b_loss.within:
                    verdict = Verdict.WITHIN_BUDGET
                    notes.insert(0, cost)
                else:
                    verdict = Verdict.INCONCLUSIVE
                    undecided = undecided_reasons((b_amount, b_loss), **signals)
                    notes.insert(0, cost)
                notes += floor_text
            elif beyond_floor:
                verdict = Verdict.DEGRADED
                failures += floor_text
            elif shown_within:
                if t is None:
                    notes.insert(0, f"tokens identical over {rl} steps and shown within the noise floor")
                notes += floor_text
            else:
                verdict = Verdict.INCONCLUSIVE
                undecided = undecided_reasons((amount, loss), **signals)
                notes += floor_text
        else:
            notes += floor_text
        if t is None and self.forced_path is not None and len(before.kl) and (
                float(before.kl.max()) > 0 or float(np.abs(before.dlogprob).max()) > 0):
            notes.append(f"generate: the golden's tokens with other logprobs (max KL {float(before.kl.max()):.2g}, "
                         f"max |Δlogprob| {float(np.abs(before.dlogprob).max()):.2g}); the decision reads the "
                         "forced replay")
        if verdict is Verdict.INCONCLUSIVE:
            stats["inconclusive"] = undecided
            failures.insert(0, "inconclusive: " + "; ".join(undecided))
        # the headline first: for gibberish its onset, otherwise the failing checks
        evidence = notes if verdict is Verdict.GIBBERISH else failures + notes
        return SequenceVerdict(
            index=i, prompt_id=self.reference.sequences[i].prompt_id, verdict=verdict, t_star=t, onset=onset,
            shared_prefix=int(al.shared_prefix[i]), reference_len=rl, candidate_len=cl,
            evidence=tuple(evidence), stats=stats, baselines=base["baselines"],
            quality=self.metrics[i], series=series,
        )


def _change_text(change: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k} {a} -> {b}" for k, (a, b) in change.items())
