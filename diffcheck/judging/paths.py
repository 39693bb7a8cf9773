"""Same-context paths of one comparison: which step pairs share a context (before t*,
or the forced replay along the reference), their per-step statistics, and their
per-sequence reductions in one vectorized pass. Knows runs and `stats`; no verdicts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from diffcheck.core.errors import DataError
from diffcheck.judging import stats as S
from diffcheck.judging.align import check_matched, lengths, segment_rows
from diffcheck.judging.decision import Margin, far_step_threshold, margins
from diffcheck.judging.floor import Floor
from diffcheck.judging.signals import departed
from diffcheck.judging.tolerances import Tolerances
from diffcheck.core.types import Run


@dataclass(frozen=True)
class Aggregate:
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
    n_departed: np.ndarray  # steps past the departure marks of `departure`

    def table(self, prefix: str = "") -> list[dict[str, Any]]:
        """The per-sequence stats dicts, built from Python lists in one go (this runs
        for every sequence, identical ones included)."""
        names = ("n", "kl_mean", "kl_max", "loss_mean", "same_top1", "dp_rms", "dlogprob_abs_max", "n_far")
        columns = [getattr(self, name).tolist() for name in names]
        firsts = [f if f >= 0 else None for f in self.first_far.tolist()]
        keys = [prefix + name for name in names] + [prefix + "first_far"]
        return [dict(zip(keys, row)) for row in zip(*columns, firsts)]


@dataclass(frozen=True)
class Limits:
    """The floor turned into numbers for one comparison."""

    floor: Floor
    kl_margin: float
    loss_margin: float
    far: float  # a single step's KL beyond this is far outside anything benign
    margins: tuple[Margin, ...] = ()  # (KL, loss): what set each margin

    @staticmethod
    def of(floor: Floor, tol: Tolerances, *, tests: int = 1, steps: int = 1) -> "Limits":
        """`tests`: the comparison's tests (`decision.family`); `steps`: the most same-context steps
        one sequence's far-step rule reads."""
        m_kl, m_loss = margins(floor, factor=tol.floor_factor, min_effect_kl=tol.min_effect_kl,
                               min_effect_loss=tol.min_effect_loss)
        far = far_step_threshold(floor, far_factor=tol.far_factor, far_kl=tol.far_kl, alpha=tol.alpha, tests=tests,
                                 steps=steps)
        return Limits(floor, m_kl.value, m_loss.value, far, (m_kl, m_loss))


def aggregate(st: S.StepStats, off: np.ndarray, tol: Tolerances, lim: Limits) -> Aggregate:
    n = np.diff(off)
    safe = np.maximum(n, 1)
    absd = np.abs(st.dlogprob)
    far = st.kl > lim.far
    kl_mean = S.segment_sum(st.kl, off) / safe
    loss_mean = -S.segment_sum(st.dlogprob, off) / safe
    n_far = S.segment_sum(far, off).astype(np.int64)
    return Aggregate(
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
        n_departed=S.segment_sum(departed(st, absd, tol), off),
    )


@dataclass(frozen=True)
class SamePath:
    """Same-context step pairs of one comparison, with per-sequence offsets [S+1]."""

    stats: S.StepStats
    off: np.ndarray
    agg: Aggregate

    def of(self, i: int) -> S.StepStats:
        return self.stats.slice(int(self.off[i]), int(self.off[i + 1]))


@dataclass(frozen=True)
class Layout:
    """A run's per-sequence lengths and offsets [S+1], computed once per comparison."""

    lens: np.ndarray
    off: np.ndarray

    @staticmethod
    def of(run: Run) -> "Layout":
        lens = lengths(run)
        return Layout(lens=lens, off=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))


def check_follows(leader: Run, follower: Run, lead: Layout, follow: Layout, *, what: str, against: str
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


def same_context_path(reference: Run, other: Run, ref: Layout, oth: Layout, n: np.ndarray, tol: Tolerances, lim: Limits
          ) -> SamePath:
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
    return SamePath(stats=st, off=off, agg=aggregate(st, off, tol, lim))
