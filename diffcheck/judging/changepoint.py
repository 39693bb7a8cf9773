"""Change detectors over one sequence's per-step curve: where it left its baseline.

`cusum` finds an upward shift of a curve's mean (the onset of a persistent loss of
likelihood, say); `persistent_onset` the first flagged step that starts a window in
which most steps are flagged. Knows numpy and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NLL_CAP = 50.0  # an -inf logprob counts as 50 nats: decisive, but keeps sums finite


@dataclass(frozen=True)
class ChangePoint:
    """Where a per-step curve left its baseline: `onset` (first step of the change)
    and `alarm` (step at which the evidence became conclusive)."""

    onset: int
    alarm: int


def cusum(
    x: np.ndarray, *, baseline: float, drift: float, threshold: float, step_cap: float = np.inf
) -> ChangePoint | None:
    """One-sided CUSUM for an upward shift of x above `baseline`.

    S_t = max(0, S_{t-1} + min(x_t - baseline - drift, step_cap)); alarm at the first t
    with S_t > threshold; onset = the step after S last sat at 0 before the alarm (the
    maximum-likelihood change point for a mean shift). `drift` is the allowance a
    healthy curve may exceed the baseline by without accumulating evidence; `step_cap`
    bounds what one step can add, so a single outlier cannot alarm alone. Computed in
    closed form: S_t = C_t - min_{j<=t} C_j with C the cumulative sum (C_0 = 0).
    """
    y = np.minimum(np.minimum(np.asarray(x, np.float64), NLL_CAP) - (baseline + drift), step_cap)
    if y[y > 0].sum() <= threshold:  # S_t never exceeds the total positive evidence
        return None
    c = np.concatenate([[0.0], np.cumsum(y)])
    running_min = np.minimum.accumulate(c)
    s = c[1:] - running_min[1:]
    over = np.flatnonzero(s > threshold)
    if over.size == 0:
        return None
    alarm = int(over[0])
    low = running_min[alarm + 1]
    head = c[: alarm + 1]
    onset = alarm - int(np.argmax(head[::-1] == low))  # last time S was 0
    return ChangePoint(onset=onset, alarm=alarm)


def persistent_onset(flags: np.ndarray, *, window: int, fraction: float) -> int | None:
    """First step t that is flagged and starts a window of `window` steps (cut at the
    end of the curve) of which at least `fraction` are flagged. A window cut below half
    its length by the end of the curve cannot start persistence, so one flag on the
    last steps does not count as persistent."""
    flags = np.asarray(flags, bool)
    n = flags.shape[0]
    if n == 0 or not flags.any():
        return None
    t = np.arange(n)
    end = np.minimum(t + window, n)
    width = end - t
    cs = np.concatenate([[0], np.cumsum(flags)])
    count = cs[end] - cs[t]
    min_width = min(max(1, -(-window // 2)), n)
    ok = flags & (width >= min_width) & (count >= fraction * width)
    hit = np.flatnonzero(ok)
    return int(hit[0]) if hit.size else None
