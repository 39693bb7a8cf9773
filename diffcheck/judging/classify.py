"""Judge a candidate run against a reference golden, sequence by sequence.

Knows runs (`types.Run`), alignment (`align`), per-step statistics (`stats`) and the
seed's text metrics (`quality`, imported lazily); nothing about engines, files or
rendering. Pure: the same runs and tolerances always give the same verdict.

Inputs: the reference golden and the candidate run (kind "generate"), optionally the
candidate teacher-forced along the reference (`forced`, kind "forced") and the
reference's scoring of the candidate's tokens (`scored`, kind "scored").

Per sequence (every threshold is a `Tolerances` field):

- Same tokens, same length: IDENTICAL when the same-context steps (and the forced
  path, when given) are within tolerance, else NUMERIC_DRIFT.
- Diverged at t*: GIBBERISH when a text signal fires on the candidate's steps from t*.
  With `scored`: a one-sided CUSUM of the reference NLL of the candidate's tokens
  against the reference's own mean NLL, or sustained "confident garbage" (the
  candidate sure of tokens the reference finds implausible). Without `scored`: a CUSUM
  of the candidate's own NLL, the seed's text metrics against the reference's, or a
  strong persistent departure of the forced path. The onset is the earliest
  persistent evidence among the firing text signals, the forced path and the
  same-context steps before t*; it can precede t* (a fault corrupts the forced path at
  the injection step even when the sampled text diverges later). The evidence names
  the signal that located it.
- Otherwise BENIGN_DRIFT when t* is a near-tie (each token in the other side's top-N,
  the reference's margin between them small), the steps before t* are within
  tolerance, the continuation is about as plausible under the reference as the
  reference's own text (`scored`), the forced path is within tolerance (`forced`) and
  no gibberish signal fired even short of a verdict (a persistent but mild departure,
  text metrics the reference's scoring does not confirm); else NUMERIC_DRIFT, with the
  failing checks first in the evidence.

ERROR verdicts come from callers (`error_verdict`). A case's verdict is its worst
sequence's. Sequences that are identical and within tolerance take a vectorized fast
path; only the others are judged one by one (`_Judge`).
"""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, Callable

import numpy as np

from diffcheck.errors import ConfigError, DataError
from diffcheck.judging import stats as S
from diffcheck.judging.align import Alignment, align, check_matched, lengths, segment_rows
from diffcheck.judging.decision import Budget, decide, far_step_threshold, margins
from diffcheck.judging.floor import Floor, spec_change
from diffcheck.types import CaseVerdict, Run, SequenceVerdict, Verdict

_FRACTIONS = ("persist_fraction", "alpha", "beta")


@dataclass(frozen=True)
class Tolerances:
    """Every knob of the judge, in nats unless noted. Built from a case's
    ``[tolerances]`` table with `from_dict`; ``inf`` disables a limit.

    The floor decision (`decision`) needs no threshold table: margins come from the
    reference's measured noise floor. These fields say how sure a verdict must be,
    what diffcheck claims to resolve at all, and what a precision change may cost.
    """

    # The statistical decision (see `decision`).
    alpha: float = 0.05  # false-alarm rate per comparison, split over the sequences judged at once
    beta: float = 0.2  # 1 - power, for the minimum detectable effect reported beside each verdict
    floor_factor: float = 4.0  # margin = this x the largest per-sequence value seen under benign variation
    # Below these, diffcheck does not tell two distributions apart, whatever the floor says:
    # llama.cpp measures ~5e-4 nats mean KL for merely storing weights in f16, and the
    # stored logprob codes carry ~1% relative rounding.
    kl_resolution: float = 1e-3
    loss_resolution: float = 0.02
    # One same-context step (before or at t*) this far beyond the floor's largest step is
    # not noise: far_factor x the floor's largest step KL, and at least far_kl.
    far_factor: float = 10.0
    far_kl: float = 0.1
    # Precision budget of a spec-changing candidate (dtype, KV-cache dtype, quantization,
    # model): its mean KL and mean loss per step may reach this. nan = the default of the
    # changed keys (`BUDGETS`).
    budget_kl: float = math.nan
    budget_loss: float = math.nan
    # Gibberish: CUSUM over the reference NLL of the candidate's tokens. A healthy
    # continuation sits near the reference's own NLL (~1.4 nats/token for SmolLM2),
    # random tokens score ~14. An allowance of 3 nats, an alarm at 15 accumulated nats
    # and at most 5 nats of evidence per step: no single token (a sampling outlier, the
    # flip at t* itself) can alarm, 4 garbage tokens in a row do.
    cusum_drift: float = 3.0
    cusum_threshold: float = 15.0
    cusum_step_cap: float = 5.0
    confident_logprob: float = -0.3  # the candidate is "sure" of its token: p >= 0.74
    implausible_nll: float = 6.0  # the reference finds the token implausible: p <= 0.25%
    # "Persistent": a marked step that starts a window of `persist_window` steps of which
    # at least `persist_fraction` are marked.
    persist_window: int = 8
    persist_fraction: float = 0.75
    # Forced replay. A clean FULL graph replays the eager reference with |Δ| ~0; the seed's
    # stale-metadata bug moved the reference token by > 1 nat from its first decode
    # steps, 6-7 nats on average.
    forced_dlogprob: float = 1.0  # |Δlogprob| of the reference token that marks a forced step
    forced_kl: float = 1.0  # KL that marks a forced step
    forced_gibberish_dlogprob: float = 3.0  # mean |Δlogprob| after onset that is corruption on its own
    # Repetition loops: the candidate repeats earlier 4-grams persistently, the reference does not.
    loop_ngram: int = 4
    loop_excess: float = 0.3  # repeated fraction after the onset beyond the reference's own
    # Text metrics (the seed's log: clean runs had digit_ratio <= 0.02, bad ones >= 0.13).
    digit_ratio_max: float = 0.1
    digit_ratio_excess: float = 0.05  # ...and this much above the reference's own text
    symbol_ratio_max: float = 0.3
    symbol_ratio_excess: float = 0.15
    weird_runs_excess: float = 0.0  # weird runs allowed beyond the reference's
    repeated_num_runs_excess: float = 0.0  # repeated number runs allowed beyond the reference's
    # Evidence only: top-N membership shown at t*, and vLLM's check_logprobs_close
    # baseline (N=5 in vLLM's common model tests).
    benign_topn: int = 20
    baseline_topn: int = 5

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, *, source: str = "[tolerances]") -> "Tolerances":
        """Build from a case's table; unknown keys and bad values raise ConfigError."""
        kinds = {f.name: type(f.default) for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in (d or {}).items():
            if key not in kinds:
                raise ConfigError(f"{source}: unknown tolerance {key!r}; valid: {', '.join(kinds)}")
            values[key] = _tolerance_value(f"{source}: tolerances.{key}", key, value, kinds[key])
        return cls(**values)


# Default precision budgets per changed spec key (mean KL, mean loss per step), summed
# over the keys a candidate changes: about twice the largest per-sequence cost measured
# on the default suite (docs/measured.md): bf16 weights cost mean KL ~1e-3; an fp8_e5m2
# KV cache 0.04-0.09 (loss 0.07-0.25). Quantization is budgeted like the KV cache; a
# different model gets a wide budget (it is a different distribution by design).
BUDGETS: dict[str, Budget] = {
    "dtype": Budget(kl=0.05, loss=0.1),
    "kv_cache_dtype": Budget(kl=0.2, loss=0.5),
    "quantization": Budget(kl=0.2, loss=0.5),
    "model": Budget(kl=1.0, loss=2.0),
}


def budget_for(change: dict[str, Any], tol: Tolerances) -> Budget | None:
    """The budget of a spec change (None when the precision spec is the same)."""
    if not change:
        return None
    kl = sum(BUDGETS[k].kl for k in change if k in BUDGETS)
    loss = sum(BUDGETS[k].loss for k in change if k in BUDGETS)
    return Budget(kl=tol.budget_kl if tol.budget_kl == tol.budget_kl else kl,
                  loss=tol.budget_loss if tol.budget_loss == tol.budget_loss else loss)


def _tolerance_value(where: str, key: str, value: Any, kind: type) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if kind is int:
        if not float(value).is_integer() or value < 1:
            raise ConfigError(f"{where} must be a whole number >= 1, got {value!r}")
        return int(value)
    if key == "confident_logprob":
        if value > 0:
            raise ConfigError(f"{where} is a logprob and must be <= 0, got {value!r}")
    elif value < 0:
        raise ConfigError(f"{where} must be >= 0, got {value!r}")
    if key in _FRACTIONS and value > 1:
        raise ConfigError(f"{where} is a fraction and must be in [0, 1], got {value!r}")
    return float(value)


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


# --- per-sequence closeness of same-context steps -----------------------------


@dataclass(frozen=True)
class _Aggregate:
    """Closeness of same-context steps, per sequence (arrays [S]), computed in one
    vectorized pass so identical sequences never need a Python-level look."""

    n: np.ndarray
    kl_mean: np.ndarray
    kl_max: np.ndarray
    loss_mean: np.ndarray  # -mean Δlogprob of the reference token
    same_top1: np.ndarray
    dp_rms: np.ndarray
    dlogprob_abs_max: np.ndarray
    n_far: np.ndarray  # steps with KL beyond the far threshold
    first_far: np.ndarray  # local step, -1 where none
    ok: np.ndarray  # plainly within the floor: estimates at or below the margins, no far step
    n_departed: np.ndarray  # steps past the departure marks of `_departure`

    def table(self, prefix: str = "") -> list[dict[str, Any]]:
        """The per-sequence stats dicts, built from Python lists in one go (this runs
        for every sequence, identical ones included)."""
        names = ("n", "kl_mean", "kl_max", "loss_mean", "same_top1", "dp_rms", "dlogprob_abs_max", "n_far")
        columns = [getattr(self, name).tolist() for name in names]
        firsts = [f if f >= 0 else None for f in self.first_far.tolist()]
        keys = [prefix + name for name in names] + [prefix + "first_far"]
        return [dict(zip(keys, row)) for row in zip(*columns, firsts)]


@dataclass(frozen=True)
class _Limits:
    """The floor turned into numbers for one comparison."""

    floor: Floor
    kl_margin: float
    loss_margin: float
    far: float  # a single step's KL beyond this is far outside anything benign

    @staticmethod
    def of(floor: Floor, tol: Tolerances) -> "_Limits":
        m_kl, m_loss = margins(floor, factor=tol.floor_factor, kl_resolution=tol.kl_resolution,
                               loss_resolution=tol.loss_resolution)
        return _Limits(floor, m_kl, m_loss, far_step_threshold(floor, far_factor=tol.far_factor, far_kl=tol.far_kl))


def _aggregate(st: S.StepStats, off: np.ndarray, tol: Tolerances, lim: _Limits) -> _Aggregate:
    n = np.diff(off)
    safe = np.maximum(n, 1)
    absd = np.abs(st.dlogprob)
    far = st.kl > lim.far
    kl_mean = S.segment_sum(st.kl, off) / safe
    loss_mean = -S.segment_sum(st.dlogprob, off) / safe
    n_far = S.segment_sum(far, off).astype(np.int64)
    return _Aggregate(
        n=n,
        kl_mean=kl_mean,
        kl_max=S.segment_max(st.kl, off, empty=0.0),
        loss_mean=loss_mean,
        same_top1=S.segment_sum(st.top1, off) / safe,
        dp_rms=np.sqrt(S.segment_sum(st.dp * st.dp, off) / safe),
        dlogprob_abs_max=S.segment_max(absd, off, empty=0.0),
        n_far=n_far,
        first_far=S.segment_first(far, off),
        ok=(kl_mean <= lim.kl_margin) & (loss_mean <= lim.loss_margin) & (n_far == 0),
        n_departed=S.segment_sum(_departed(st, absd, tol), off),
    )


# --- gibberish signals ----------------------------------------------------------


@dataclass(frozen=True)
class _Signal:
    name: str  # the signal, as named in evidence ("reference-NLL CUSUM", ...)
    onset: int  # first step of its persistent evidence
    trigger: bool  # fires GIBBERISH on its own
    locates: bool  # may set the onset (a per-step, persistent signal)
    evidence: str


def _departed(st: S.StepStats, absd: np.ndarray, tol: Tolerances) -> np.ndarray:
    return (absd > tol.forced_dlogprob) | (st.kl > tol.forced_kl)


def _departure(st: S.StepStats, tol: Tolerances, *, what: str, name: str, trigger_ok: bool) -> _Signal | None:
    """Persistent, strong departure of same-context distributions (forced path, or before t*)."""
    absd = np.abs(st.dlogprob)
    marked = _departed(st, absd, tol)
    onset = S.persistent_onset(marked, window=tol.persist_window, fraction=tol.persist_fraction)
    if onset is None:
        return None
    mean_abs = _mean(absd[onset:])
    text = (
        f"{what}: |Δlogprob| > {tol.forced_dlogprob:g} nat or KL > {tol.forced_kl:g} from step {onset} on "
        f"(mean |Δlogprob| {mean_abs:.1f} nats, mean KL {_mean(st.kl[onset:]):.2f} over {len(st) - onset} steps)"
    )
    strong = mean_abs >= tol.forced_gibberish_dlogprob
    return _Signal(name, onset, trigger_ok and strong, True, text)


def _text_flags(cand: dict, ref: dict, tol: Tolerances) -> list[str]:
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


def _loop(cand_tokens: list[int], ref_tokens: list[int], t: int, tol: Tolerances) -> tuple[int, float, float] | None:
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


def _mean(x: np.ndarray) -> float:
    """Mean of a short array without np.mean's per-call overhead (this runs per sequence)."""
    return float(np.add.reduce(x, dtype=np.float64)) / x.shape[0] if x.shape[0] else 0.0


def _nll(logprob: np.ndarray) -> np.ndarray:
    """Per-step NLL, float32; an -inf logprob counts as `stats.NLL_CAP` nats."""
    return np.minimum(-logprob, np.float32(S.NLL_CAP))


@dataclass(frozen=True)
class _Path:
    """Same-context step pairs of one comparison, with per-sequence offsets [S+1]."""

    stats: S.StepStats
    off: np.ndarray
    agg: _Aggregate

    def of(self, i: int) -> S.StepStats:
        return self.stats.slice(int(self.off[i]), int(self.off[i + 1]))


# --- one sequence, judged in full -------------------------------------------------


class _Judge:
    """Shared state of one comparison; `sequence(i)` judges sequence i in full."""

    def __init__(self, *, reference, candidate, scored, layouts, alignment, before, forced_path, tol, limits,
                 budget, change, tests, metrics, token_text):
        self.reference, self.candidate, self.scored = reference, candidate, scored
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

    def signals(self, i: int, t: int, cand_nll, scored_nll, mu0: float, off_floor: bool) -> list[_Signal]:
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
                sigs.append(_Signal("reference-NLL CUSUM", on, True, True, (
                    f"reference NLL of candidate text {_mean(x[cp.onset:]):.1f} nats/token from step {on} on "
                    f"vs {mu0:.1f} for the reference's own text (CUSUM alarm at step {t + cp.alarm})")))
            sure = (cand_nll[t:t + len(x)] <= -tol.confident_logprob) & (x >= tol.implausible_nll)
            p = S.persistent_onset(sure, window=tol.persist_window, fraction=tol.persist_fraction)
            if p is not None:
                sigs.append(_Signal("confident garbage", t + p, True, True, (
                    f"confident garbage: {int(sure[p:].sum())} of {len(sure) - p} steps from step {t + p} have "
                    f"candidate logprob >= {tol.confident_logprob:g} on tokens the reference gives "
                    f">= {tol.implausible_nll:g} nats")))
        elif has_text:
            x = cand_nll[t:]
            cp = S.cusum(x, baseline=mu0, drift=tol.cusum_drift, threshold=tol.cusum_threshold,
                         step_cap=tol.cusum_step_cap)
            if cp is not None:
                on = t + cp.onset
                sigs.append(_Signal("candidate self-NLL CUSUM", on, True, True, (
                    f"candidate's own NLL {_mean(x[cp.onset:]):.1f} nats/token from step {on} on vs {mu0:.1f} "
                    f"for the reference's own text (no scored run; CUSUM alarm at step {t + cp.alarm})")))
        # A loop is not plausible text, however low the reference scores it. It is garbage
        # when the model is off the reference's path from there on: a persistent departure
        # of the forced path, or without one the same-context steps beyond what this
        # candidate may cost. Alone (a degraded model loops too, and so do small models at
        # temperature 0.7) it is evidence for DEGRADED, not GIBBERISH.
        forced_departure = None
        if self.forced_path is not None and self.forced_path.agg.n_departed[i]:
            forced_departure = _departure(self.forced_path.of(i), tol, what="forced replay", name="forced replay",
                                          trigger_ok=False)
        loop = None
        if has_text:
            cand_tokens = self.candidate.sequence(i).token_id.tolist()
            ref_tokens = self.reference.sequence(i).token_id.tolist()
            loop = _loop(cand_tokens, ref_tokens, t, tol)
        if loop is not None:
            on, frac, ref_frac = loop
            trigger = forced_departure is not None if self.forced_path is not None else off_floor
            sigs.append(_Signal("repetition loop", on, trigger, True, (
                f"repetition loop: {frac:.0%} of the {tol.loop_ngram}-grams from step {on} on repeat earlier ones "
                f"(reference {ref_frac:.0%} over the same steps)")))
        if has_text and self.metrics[i]:
            flags = _text_flags(self.metrics[i], self.ref_metrics(i), tol)
            if flags:
                how = "the reference's scoring does not confirm it" if self.scored is not None else (
                    "no per-step signal: onset at t*")
                sigs.append(_Signal("text metrics", t, self.scored is None, self.scored is None,
                                    f"text metrics: {', '.join(flags)} ({how})"))
        # departures need marked steps: the vectorized counts skip most sequences.
        # The reference's scoring may not veto a forced path this far off unless the
        # text reads as plausible prose (no loop).
        if forced_departure is not None:
            strong = _mean(np.abs(self.forced_path.of(i).dlogprob)[forced_departure.onset:]) >= \
                tol.forced_gibberish_dlogprob
            trigger = has_text and strong and (self.scored is None or loop is not None)
            sigs.append(dataclasses.replace(forced_departure, trigger=trigger))
        if self.before.agg.n_departed[i]:
            sig = _departure(self.before.of(i), tol, what="before t*", name="same-context steps before t*",
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
            path.kl, path.dlogprob, floor=lim.floor, factor=tol.floor_factor, kl_resolution=tol.kl_resolution,
            loss_resolution=tol.loss_resolution, alpha=tol.alpha, beta=tol.beta, tests=self.tests,
            budget=self.budget)
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
        if far_steps:
            s0 = min(far_steps)
            kl0 = float(self.kl_at_t_star[i]) if s0 == t else float((before.kl if s0 < len(before) else path.kl)[s0])
            floor_text.append(f"{len(far_steps)} same-context step(s) with KL beyond {lim.far:.3g} (10x the floor's "
                              f"largest step or {tol.far_kl:g}), first at step {s0} (KL {kl0:.3g})")
        verdict, onset = Verdict.IDENTICAL if t is None else Verdict.BENIGN_DRIFT, None
        if t is not None:
            # beyond what this candidate may cost: its floor, or its budget for a precision change
            unacceptable = (b_amount.beyond or b_loss.beyond) if self.budget is not None else beyond_floor
            sigs = self.signals(i, t, cand_nll, scored_nll, mu0, off_floor=unacceptable)
            triggers = [s for s in sigs if s.trigger]
            if triggers:
                first = min((s for s in sigs if s.locates), key=lambda s: (s.onset, not s.trigger))
                verdict, onset = Verdict.GIBBERISH, first.onset
                notes.append(f"gibberish from step {onset}, located by {first.name}")
                notes += [s.evidence for s in triggers] + [s.evidence for s in sigs if not s.trigger]
                stats["onset_signal"] = first.name
                if scored_nll is not None and onset < scored_nll.size:
                    stats["ref_nll_candidate_after_onset"] = _mean(scored_nll[max(onset, t):])
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
                m_c = _mean(scored_nll[t:])
                m_r = _mean(ref_nll[t:]) if rl > t else mu0
                notes.append(f"reference NLL of candidate text after t* {m_c:.2f} nats/token vs {m_r:.2f} "
                             f"for the reference's own text")
        if verdict is not Verdict.GIBBERISH and failures:
            verdict = Verdict.DEGRADED
            notes += floor_text
        elif verdict is not Verdict.GIBBERISH:
            if self.budget is not None and beyond_floor:
                cost = (f"precision cost of {_change_text(self.change)}: {b_amount.text()}; {b_loss.text()} "
                        f"(budget KL {self.budget.kl:g}, loss {self.budget.loss:g})")
                stats["effects"]["budget"] = {"amount": b_amount.as_dict(), "loss": b_loss.as_dict(),
                                              "kl": self.budget.kl, "loss_budget": self.budget.loss}
                if b_amount.beyond or b_loss.beyond:
                    verdict = Verdict.DEGRADED
                    failures.append(cost)
                else:
                    verdict = Verdict.WITHIN_BUDGET
                    notes.insert(0, cost)
                notes += floor_text
            elif beyond_floor:
                verdict = Verdict.DEGRADED
                failures += floor_text
            else:
                notes += floor_text
        else:
            notes += floor_text
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


# --- the case ------------------------------------------------------------------


def _check_kind(run: Run, kind: str, what: str) -> None:
    if run.meta.kind != kind:
        raise DataError(f"{what} run {run.meta.case_id!r} has kind {run.meta.kind!r}; expected {kind!r}")


@dataclass(frozen=True)
class _Layout:
    """A run's per-sequence lengths and offsets [S+1], computed once per comparison."""

    lens: np.ndarray
    off: np.ndarray

    @staticmethod
    def of(run: Run) -> "_Layout":
        lens = lengths(run)
        return _Layout(lens=lens, off=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))


def _check_follows(leader: Run, follower: Run, lead: _Layout, follow: _Layout, *, what: str, against: str
                   ) -> np.ndarray:
    """Check that `follower` (forced / scored) replays `leader`'s tokens; return the
    per-sequence number of steps the two share."""
    check_matched(leader, follower, what=what, against=against)
    n = np.minimum(lead.lens, follow.lens)
    if np.array_equal(lead.lens, follow.lens):
        rows_l = rows_f = slice(None)
    else:
        rows_l, rows_f = segment_rows(lead.off[:-1], n), segment_rows(follow.off[:-1], n)
    tok_l, tok_f = leader.steps.token_id[rows_l], follower.steps.token_id[rows_f]
    bad = np.flatnonzero(tok_l != tok_f)
    if bad.size:
        off = np.concatenate([[0], np.cumsum(n)])
        seq = int(np.searchsorted(off, bad[0], side="right") - 1)
        raise DataError(
            f"{what} run sequence {seq} step {int(bad[0] - off[seq])} has token {int(tok_f[bad[0]])} but the "
            f"{against} run has {int(tok_l[bad[0]])}; a {what} run must follow its {against} tokens"
        )
    return n


def _path(reference: Run, other: Run, ref: _Layout, oth: _Layout, n: np.ndarray, tol: Tolerances, lim: _Limits
          ) -> _Path:
    """Step stats of the first n[i] steps of each sequence pair (same context)."""
    if np.array_equal(ref.lens, oth.lens):
        # equal lengths: row i of one run pairs with row i of the other, so select the
        # first n[i] steps of each sequence with a mask instead of gathering rows
        local = np.arange(len(reference.steps), dtype=np.int64) - np.repeat(ref.off[:-1], ref.lens)
        st = S.compare_steps(reference.steps, other.steps, keep=local < np.repeat(n, ref.lens))
    else:
        st = S.compare_steps(reference.steps, other.steps, reference_rows=segment_rows(ref.off[:-1], n),
                             candidate_rows=segment_rows(oth.off[:-1], n))
    off = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
    return _Path(stats=st, off=off, agg=_aggregate(st, off, tol, lim))


def _baselines(reference: Run, candidate: Run, ref: _Layout, cand: _Layout, al: Alignment, tol: Tolerances
               ) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's check_outputs_equal and check_logprobs_close, per sequence (True = pass).

    check_logprobs_close walks to the first mismatch within the shorter sequence and
    requires each side's token to be in the other side's top-N logprobs there, then
    stops; a strict prefix passes (vLLM only warns on the text)."""
    texts_equal = np.fromiter(
        (r.text == c.text for r, c in zip(reference.sequences, candidate.sequences)), bool, len(al))
    exact = (al.t_star < 0) & texts_equal
    close = np.ones(len(al), bool)
    mismatch = np.flatnonzero((al.t_star >= 0) & (al.t_star < np.minimum(al.reference_len, al.candidate_len)))
    if mismatch.size:
        t = al.t_star[mismatch]
        rr, cr = ref.off[mismatch] + t, cand.off[mismatch] + t
        n = min(tol.baseline_topn, reference.steps.k, candidate.steps.k)
        ref_tok = reference.steps.token_id[rr]
        cand_tok = candidate.steps.token_id[cr]
        in_cand = (candidate.steps.topk_ids[cr, :n] == ref_tok[:, None]).any(1)
        in_ref = (reference.steps.topk_ids[rr, :n] == cand_tok[:, None]).any(1)
        close[mismatch] = in_cand & in_ref
    return exact, close


def _text_metrics(run: Run, diverged: np.ndarray) -> list[dict]:
    from diffcheck.judging.quality import text_metrics  # lazy: written beside this core, not needed to import it

    return [text_metrics(s.text, n_tokens=s.n_tokens) if d else {} for s, d in zip(run.sequences, diverged.tolist())]


def _sequence_verdicts(judge: _Judge, *, fast: list[bool], layouts, exact: np.ndarray, close: np.ndarray
                       ) -> list[SequenceVerdict]:
    """One SequenceVerdict per sequence: built directly where `fast`, else by `judge`.

    Per-step curves for plots are views into flat columns, negated once for all
    sequences. The loop runs once per sequence, so it works on Python lists."""
    reference, candidate, scored = judge.reference, judge.candidate, judge.scored
    al, pre, fpath, metrics = judge.alignment, judge.before, judge.forced_path, judge.metrics
    ref, cand, scored_layout = layouts
    ref_nll_all, cand_nll_all = _nll(reference.steps.logprob), _nll(candidate.steps.logprob)
    scored_nll_all = _nll(scored.steps.logprob) if scored is not None else None
    nll_means = {"ref_nll_reference_mean": (ref_nll_all, ref), "candidate_nll_mean": (cand_nll_all, cand)}
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
                evidence=(f"tokens identical over {n} steps and within the noise floor: mean KL "
                          f"{stats['kl_mean']:.2g} (margin {judge.limits.kl_margin:.2g}), max {stats['kl_max']:.2g}",),
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
    tolerances: Tolerances = Tolerances(),
    candidate_id: str = "",
    reference_id: str = "",
    token_text: Callable[[int], str] | None = None,
    text_metrics: bool = True,
    floor: Floor | None = None,
    tests: int | None = None,
) -> CaseVerdict:
    """Judge every candidate sequence against its reference sequence.

    `forced`: the candidate teacher-forced along the reference's tokens; `scored`: the
    reference's logprobs of the candidate's tokens. `token_text` renders a token id for
    evidence (e.g. a tokenizer's decode); without it tokens show as ``#id``.
    ``text_metrics=False`` skips the seed's text metrics, which are per-character
    Python and can cost more than the whole numeric comparison: every
    `SequenceVerdict.quality` is then empty and the text-metric signal is off.
    `floor`: the reference's noise floor (`floor.build_floor`); without one, margins
    sit at diffcheck's resolution and the summary says so. `tests`: how many
    sequences are judged at once across every comparison of the command (default:
    this comparison's), for the multiple-testing correction.
    """
    tol = tolerances
    _check_kind(reference, "generate", "reference")
    _check_kind(candidate, "generate", "candidate")
    floor = floor if floor is not None else Floor()
    lim = _Limits.of(floor, tol)
    change = spec_change(reference, candidate)
    budget = budget_for(change, tol)
    ref, cand = _Layout.of(reference), _Layout.of(candidate)
    al = align(reference, candidate, reference_len=ref.lens, candidate_len=cand.lens)
    pre = _path(reference, candidate, ref, cand, al.shared_prefix, tol, lim)
    fpath = scored_layout = None
    if forced is not None:
        _check_kind(forced, "forced", "forced")
        forced_layout = _Layout.of(forced)
        n = _check_follows(reference, forced, ref, forced_layout, what="forced", against="reference")
        fpath = _path(reference, forced, ref, forced_layout, n, tol, lim)
    if scored is not None:
        _check_kind(scored, "scored", "scored")
        scored_layout = _Layout.of(scored)
        _check_follows(candidate, scored, cand, scored_layout, what="scored", against="candidate")
    exact, close = _baselines(reference, candidate, ref, cand, al, tol)
    # Text metrics only where they can matter: an identical sequence's text is the
    # reference's, so it cannot raise a text signal (reports fill those in for display).
    metrics = _text_metrics(candidate, al.t_star >= 0) if text_metrics else [{} for _ in candidate.sequences]
    judge = _Judge(reference=reference, candidate=candidate, scored=scored, layouts=(ref, cand, scored_layout),
                   alignment=al, before=pre, forced_path=fpath, tol=tol, limits=lim, budget=budget, change=change,
                   tests=tests or len(al), metrics=metrics, token_text=token_text)

    # The case summary's percentiles partition every same-context step: run them on a
    # thread (numpy releases the GIL there) while this thread judges sequences.
    pool = ThreadPoolExecutor(max_workers=1) if S.WORKERS > 1 else None
    try:
        summaries = [S.summarize(p.stats) if pool is None else pool.submit(S.summarize, p.stats)
                     for p in (pre, fpath) if p is not None]
        # identical and plainly within the floor: judged without a Python-level look
        fast = ((al.t_star < 0) & pre.agg.ok & (fpath.agg.ok if fpath is not None else True)).tolist()
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
                  "loss_margin": lim.loss_margin, "far_kl": lim.far},
        "signals": {"forced": forced is not None, "scored": scored is not None, "floor": floor.measured},
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
