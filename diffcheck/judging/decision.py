"""Is a departure beyond the noise floor (or the precision budget), and how sure is that?

Knows arrays of same-context per-step statistics and a `Floor`; nothing about runs,
engines or verdict names. Two effects are tested on a path of same-context steps
(the forced replay along the reference, or the steps up to t* without one):

- **amount**: the mean KL(reference ‖ candidate) per step (top-k estimate, `stats`);
- **loss** (direction): −mean Δ, with Δ = candidate − reference logprob of the
  reference's own token. Over tokens the reference sampled, E[−Δ] estimates the
  full-vocabulary KL(R ‖ C): noise is symmetric around 0, damage a one-sided loss.

Steps within a sequence are correlated, so standard errors come from batch means
over blocks of `floor.BLOCK` consecutive steps (a plain per-step error would
overstate confidence). Each effect has an *equivalence margin*:

    margin = max(floor_factor × the floor's largest benign value, resolution)

and is *beyond* only when its one-sided lower confidence bound
``estimate − z·se`` exceeds the margin, with ``z = Φ⁻¹(1 − α/m)`` and m the number of
tests judged at once (Bonferroni: a 20-case matrix does not cry wolf). Each result
carries the p-value of "within the margin" and the minimum detectable effect of this
many blocks, ``(z + z_β) · σ_floor · √(2/n_blocks)`` (the two-sample power formula of
TensorRT-LLM's accuracy suite).

A spec-changing candidate is tested the same way against its *budget* instead of
the floor (a precision cost, reported the way llama.cpp reports a quantization).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from diffcheck.judging.floor import BLOCK, Floor, block_means

_N = NormalDist()


@dataclass(frozen=True)
class Effect:
    """One tested effect on one path (nats per step)."""

    name: str  # "KL" or "loss"
    estimate: float
    se: float
    margin: float
    lower: float  # one-sided lower confidence bound
    p_within: float  # one-sided p-value of "the effect is within the margin"
    mde: float  # minimum detectable effect above the margin at (alpha, beta)
    n_steps: int
    beyond: bool

    def text(self) -> str:
        se = f" ± {self.se:.2g}" if math.isfinite(self.se) else ""
        verdict = "beyond" if self.beyond else "within"
        return (f"{self.name} {self.estimate:.3g}{se} over {self.n_steps} steps, {verdict} its margin {self.margin:.3g} "
                f"(lower bound {self.lower:.3g}, p {self.p_within:.2g}, detectable {self.mde:.2g})")

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("name", "estimate", "se", "margin", "lower", "p_within", "mde",
                                               "n_steps", "beyond")}


def batch_means_se(x: np.ndarray, block: int = BLOCK) -> float:
    """Standard error of the mean of `x` that respects correlation within `block` steps."""
    n = x.shape[0]
    if n < 2:
        return math.inf
    means = block_means(x, block)
    if means.shape[0] >= 4:
        return float(means.std(ddof=1) / math.sqrt(means.shape[0]))
    # too few blocks: treat each block as one observation's worth of information
    return float(x.std(ddof=1) * math.sqrt(min(block, n)) / math.sqrt(n))


def z_value(alpha: float, tests: int = 1) -> float:
    return _N.inv_cdf(1.0 - alpha / max(tests, 1))


def effect_test(name: str, values: np.ndarray, *, margin: float, sigma_floor: float, alpha: float,
                beta: float, tests: int) -> Effect:
    """One-sided test of mean(values) > margin at level alpha/tests."""
    x = values.astype(np.float64)
    n = int(x.shape[0])
    est = float(x.mean()) if n else 0.0
    se = batch_means_se(x)
    z = z_value(alpha, tests)
    lower = est - z * se if math.isfinite(se) else -math.inf
    if math.isfinite(se) and se > 0:
        p = 1.0 - _N.cdf((est - margin) / se)
    else:
        p = 0.0 if (est > margin and math.isfinite(se)) else 1.0
    n_blocks = max(n / BLOCK, 1.0)
    mde = (z + _N.inv_cdf(1.0 - beta)) * sigma_floor * math.sqrt(2.0 / n_blocks) if n else math.inf
    return Effect(name, est, se, margin, lower, p, mde, n, bool(lower > margin))


@dataclass(frozen=True)
class Budget:
    """The precision cost a spec-changing candidate may have (nats per step)."""

    kl: float
    loss: float


def margins(floor: Floor, *, factor: float, kl_resolution: float, loss_resolution: float) -> tuple[float, float]:
    """Equivalence margins for (amount, loss) from the floor, never below diffcheck's resolution."""
    return (max(factor * floor.kl_seq_max, kl_resolution), max(factor * floor.loss_seq_max, loss_resolution))


def decide(kl: np.ndarray, dlogprob: np.ndarray, *, floor: Floor, factor: float, kl_resolution: float,
           loss_resolution: float, alpha: float, beta: float, tests: int,
           budget: Budget | None = None) -> tuple[Effect, Effect, Effect | None, Effect | None]:
    """(amount vs floor, loss vs floor, amount vs budget, loss vs budget) on one path."""
    m_kl, m_loss = margins(floor, factor=factor, kl_resolution=kl_resolution, loss_resolution=loss_resolution)
    loss = -dlogprob.astype(np.float64)
    common = dict(alpha=alpha, beta=beta, tests=tests)
    amount = effect_test("KL", kl, margin=m_kl, sigma_floor=floor.kl_block_sd, **common)
    direction = effect_test("loss", loss, margin=m_loss, sigma_floor=floor.loss_block_sd, **common)
    if budget is None:
        return amount, direction, None, None
    b_amount = effect_test("KL", kl, margin=max(budget.kl, m_kl), sigma_floor=floor.kl_block_sd, **common)
    b_loss = effect_test("loss", loss, margin=max(budget.loss, m_loss), sigma_floor=floor.loss_block_sd, **common)
    return amount, direction, b_amount, b_loss


def far_step_threshold(floor: Floor, *, far_factor: float, far_kl: float) -> float:
    """A single same-context step beyond this KL is far outside anything benign."""
    return max(far_factor * floor.kl_step_max, far_kl)
