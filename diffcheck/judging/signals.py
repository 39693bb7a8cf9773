"""Garbage signals: the per-step evidence that a candidate's text turned to garbage
(departures of same-context distributions, repetition loops, text metrics), and the
small numeric helpers they share. Knows step statistics and tolerances; no verdicts."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from diffcheck.judging import stats as S
from diffcheck.judging.tolerances import Tolerances


@dataclass(frozen=True)
class Signal:
    name: str  # the signal, as named in evidence ("reference-NLL CUSUM", ...)
    onset: int  # first step of its persistent evidence
    trigger: bool  # fires GIBBERISH on its own
    locates: bool  # may set the onset (a per-step, persistent signal)
    evidence: str


def departed(st: S.StepStats, absd: np.ndarray, tol: Tolerances) -> np.ndarray:
    return (absd > tol.forced_dlogprob) | (st.kl > tol.forced_kl)


def departure(st: S.StepStats, tol: Tolerances, *, what: str, name: str, trigger_ok: bool) -> Signal | None:
    """Persistent, strong departure of same-context distributions (forced path, or before t*)."""
    absd = np.abs(st.dlogprob)
    marked = departed(st, absd, tol)
    onset = S.persistent_onset(marked, window=tol.persist_window, fraction=tol.persist_fraction)
    if onset is None:
        return None
    mean_abs = mean(absd[onset:])
    text = (
        f"{what}: |Δlogprob| > {tol.forced_dlogprob:g} nat or KL > {tol.forced_kl:g} from step {onset} on "
        f"(mean |Δlogprob| {mean_abs:.1f} nats, mean KL {mean(st.kl[onset:]):.2f} over {len(st) - onset} steps)"
    )
    strong = mean_abs >= tol.forced_gibberish_dlogprob
    return Signal(name, onset, trigger_ok and strong, True, text)


def text_flags(cand: dict, ref: dict, tol: Tolerances) -> list[str]:
    """The seed's text metrics (and the symbol ratio) of the candidate beyond the reference's own."""
    flags = []
    for key, limit, excess in (("digit_ratio", tol.digit_ratio_max, tol.digit_ratio_excess),
                               ("symbol_ratio", tol.symbol_ratio_max, tol.symbol_ratio_excess)):
        c, r = float(cand.get(key, 0.0)), float(ref.get(key, 0.0))
        if c > limit and c - r > excess:
            flags.append(f"{key} {c:.2f} (reference {r:.2f})")
    for key, excess in (("weird_runs", tol.weird_runs_excess), ("repeated_num_runs", tol.repeated_num_runs_excess)):
        c, r = int(cand.get(key, 0)), int(ref.get(key, 0))
        if c - r > excess:
            flags.append(f"{key} {c} (reference {r})")
    return flags


def loop_onset(cand_tokens: list[int], ref_tokens: list[int], t: int, tol: Tolerances) -> tuple[int, float, float] | None:
    """A repetition loop in the candidate from t* on that the reference does not have:
    (onset step, candidate's repeated fraction after it, reference's over the same steps)."""
    from diffcheck.judging.quality import repeated_ngrams

    rep = np.array(repeated_ngrams(cand_tokens, tol.loop_ngram), bool)
    onset = S.persistent_onset(rep[t:], window=max(tol.persist_window, 2 * tol.loop_ngram),
                               fraction=tol.persist_fraction)
    if onset is None:
        return None
    onset += t
    frac = float(rep[onset:].mean())
    ref_rep = np.array(repeated_ngrams(ref_tokens, tol.loop_ngram), bool)[onset:]
    ref_frac = float(ref_rep.mean()) if ref_rep.size else 0.0
    return (onset, frac, ref_frac) if frac - ref_frac > tol.loop_excess else None


def mean(x: np.ndarray) -> float:
    """Mean of a short array without np.mean's per-call overhead (this runs per sequence)."""
    return float(np.add.reduce(x, dtype=np.float64)) / x.shape[0] if x.shape[0] else 0.0


def nll(logprob: np.ndarray) -> np.ndarray:
    """Per-step NLL, float32; an -inf logprob counts as `stats.NLL_CAP` nats."""
    return np.minimum(-logprob, np.float32(S.NLL_CAP))
