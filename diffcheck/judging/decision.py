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

    margin = max(floor_factor × the floor's largest benign value, min_effect)

where ``min_effect`` is the case's minimum effect of interest (a practical threshold the user
sets, `Margin` says which of the two set it), and is decided by two one-sided tests (TOST),
with ``z = Φ⁻¹(1 − α/m)`` and m the tests of the comparison (`family`: Bonferroni over
every sequence's tests, the far-step rule included, and the planned looks; the same m
whichever command judges the candidate):

- *beyond* when the lower confidence bound ``estimate − z·se`` exceeds the margin
  (a difference shown);
- *within* (equivalence shown) only when the upper bound ``estimate + z·se`` is inside
  the margin **and** the evidence is not thin;
- otherwise *undecided*: absence of evidence is never a pass.

Evidence is *thin* when the path has fewer than ``min_steps`` steps (too few for a
standard error worth the name: less than one batch-means block by default), or when the
minimum detectable effect of this many blocks, ``(z + z_β) · σ_floor · √(2/n_blocks)``
(the two-sample power formula of TensorRT-LLM's accuracy suite), is above the margin:
an effect of the margin's size would likely go unseen. On a floor of exactly zero (the
CPU lane) there is no σ_floor to plan with, so the path's own spread of block means stands
in for it: a path that wanders too much to show an effect of the margin's size is thin, not
a pass; a forced replay that is bitwise identical (estimate 0, se 0) is plainly within. Each result
carries both bounds, the p-values of "within" and of "beyond", the minimum detectable
effect, and, when undecided, what would decide it (`undecided_reasons`).

A spec-changing candidate is tested the same way against its *budget* instead of
the floor (a precision cost, reported the way llama.cpp reports a quantization).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from diffcheck.judging.floor import BLOCK, FLOOR_ZERO, Floor, block_means

_N = NormalDist()


@dataclass(frozen=True)
class Effect:
    """One tested effect on one path (nats per step)."""

    name: str  # "KL" or "loss"
    estimate: float
    se: float
    margin: float
    lower: float  # one-sided lower confidence bound
    p_within: float  # one-sided p-value of "the effect is within the margin" (small: beyond)
    mde: float  # minimum detectable effect above the margin at (alpha, beta)
    n_steps: int
    beyond: bool  # the lower bound is beyond the margin: a difference shown
    upper: float = math.inf  # one-sided upper confidence bound
    p_beyond: float = 1.0  # one-sided p-value of "the effect reaches the margin" (small: within)
    within: bool = False  # the upper bound is inside the margin and the evidence is not thin: equivalence shown
    thin: str = ""  # why the evidence is too thin to show equivalence ("" when it is not)
    set_by: str = ""  # what set the margin: "floor", "min_effect" or "budget" (`Margin`)

    @property
    def status(self) -> str:
        return "beyond" if self.beyond else ("within" if self.within else "undecided")

    def text(self) -> str:
        se = f" ± {self.se:.2g}" if math.isfinite(self.se) else ""
        thin = f"; thin evidence: {self.thin}" if self.thin else ""
        status = {"beyond": "beyond", "within": "within"}.get(self.status, "undecided against")
        by = f" set by {self.set_by}" if self.set_by else ""
        return (f"{self.name} {self.estimate:.3g}{se} over {self.n_steps} steps, {status} its margin "
                f"{self.margin:.3g}{by} (bounds {self.lower:.3g} to {self.upper:.3g}, p {self.p_within:.2g} / "
                f"{self.p_beyond:.2g}, detectable {self.mde:.2g}{thin})")

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("name", "estimate", "se", "margin", "lower", "upper", "p_within",
                                               "p_beyond", "mde", "n_steps", "beyond", "within", "thin",
                                               "set_by")}


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


# The tests one sequence runs on its decision path: the two effects against the floor's
# margins, and the far-step rule (`far_step_threshold`); a spec-changing candidate adds the
# two effects against its precision budget.
SEQUENCE_TESTS = ("KL", "loss", "far step")
BUDGET_TESTS = ("budget KL", "budget loss")
RULE = ("Bonferroni per comparison (a candidate against one reference): every test of every sequence "
        "(KL, loss, far step; budget KL and loss for a spec change) x the planned looks")


@dataclass(frozen=True)
class Family:
    """The tests one comparison runs, which its multiple-testing correction counts (`family`)."""

    sequences: int
    per_sequence: tuple[str, ...]
    looks: int = 1

    @property
    def m(self) -> int:
        return max(self.sequences, 1) * len(self.per_sequence) * max(self.looks, 1)

    def z(self, alpha: float) -> float:
        return z_value(alpha, self.m)

    def as_dict(self, alpha: float) -> dict:
        return {"rule": RULE, "sequences": self.sequences, "per_sequence": list(self.per_sequence),
                "looks": self.looks, "m": self.m, "alpha": alpha, "alpha_per_test": alpha / self.m,
                "z": self.z(alpha), "text": self.text(alpha)}

    def text(self, alpha: float) -> str:
        looks = f"; x {self.looks} planned looks" if self.looks > 1 else ""
        return (f"{self.m} tests ({self.sequences} sequences x {len(self.per_sequence)}: "
                f"{', '.join(self.per_sequence)}{looks}) at alpha {alpha:g} / {self.m}: z {self.z(alpha):.2f}")


def family(sequences: int, *, budget: bool = False, looks: int = 1) -> Family:
    """The one count of a comparison's tests: every sequence's tests (`SEQUENCE_TESTS`, and
    `BUDGET_TESTS` for a spec-changing candidate) times the looks a sequential extension plans.

    The family is the comparison, not the command: the candidate's verdict against a reference
    is one claim, and it must not depend on which command asked (``compare`` judges one case,
    ``check``, ``matrix`` and ``selftest`` many; a count over the command gave one candidate z
    2.50 in one and 3.28 in another). A command that reports K comparisons keeps each at
    alpha, so at most K x alpha false alarms are expected over its table."""
    return Family(int(sequences), SEQUENCE_TESTS + (BUDGET_TESTS if budget else ()), max(int(looks), 1))


MIN_STEPS = BLOCK  # default `Tolerances.min_steps`: fewer same-context steps than one block show nothing


def detectable(n: int, sigma_floor: float, *, z: float, beta: float) -> float:
    """Minimum detectable effect of `n` steps: (z + z_β) · σ_floor · √(2/n_blocks)."""
    if not n:
        return math.inf
    return (z + _N.inv_cdf(1.0 - beta)) * sigma_floor * math.sqrt(2.0 / max(n / BLOCK, 1.0))


def effect_test(name: str, values: np.ndarray, *, margin: float, sigma_floor: float, alpha: float,
                beta: float, tests: int, min_steps: int = MIN_STEPS, set_by: str = "") -> Effect:
    """Two one-sided tests of mean(values) against margin at level alpha/tests each:
    beyond when the lower bound exceeds it, within when the upper bound is inside it and
    the evidence is not thin (`min_steps`, the minimum detectable effect)."""
    x = values.astype(np.float64)
    n = int(x.shape[0])
    est = float(x.mean()) if n else 0.0
    se = batch_means_se(x)
    z = z_value(alpha, tests)
    finite = math.isfinite(se)
    lower = est - z * se if finite else -math.inf
    upper = est + z * se if finite else math.inf
    if finite and se > 0:
        p = 1.0 - _N.cdf((est - margin) / se)
        p_beyond = _N.cdf((est - margin) / se)
    else:
        p = 0.0 if (est > margin and finite) else 1.0
        p_beyond = 0.0 if (est < margin and finite) else 1.0
    if sigma_floor > 0 or not n:
        mde = detectable(n, sigma_floor, z=z, beta=beta)
    else:
        # A floor of exactly zero (the CPU lane) has no spread to plan with: this path's own does.
        # se is the spread of its block means over √n_blocks, so this is detectable() with that spread.
        mde = (z + _N.inv_cdf(1.0 - beta)) * math.sqrt(2.0) * se if finite else math.inf
    if n < min_steps:
        thin = f"{n} step{'s' if n != 1 else ''}, fewer than the {min_steps} an equivalence needs (min_steps)"
    elif mde > margin:
        thin = f"{n} steps detect only {mde:.2g}, more than the margin {margin:.3g}"
    else:
        thin = ""
    beyond = bool(lower > margin)
    within = bool(upper <= margin) and not thin and not beyond
    return Effect(name, est, se, margin, lower, p, mde, n, beyond, upper, p_beyond, within, thin, set_by)


@dataclass(frozen=True)
class Budget:
    """The precision cost a spec-changing candidate may have (nats per step)."""

    kl: float
    loss: float


@dataclass(frozen=True)
class Margin:
    """One effect's equivalence margin: max(floor_factor × the floor's value, min_effect)."""

    floor: float  # floor_factor × the floor's largest per-sequence value
    min_effect: float  # the case's minimum effect of interest
    factor: float = 4.0

    @property
    def value(self) -> float:
        return max(self.floor, self.min_effect)

    @property
    def set_by(self) -> str:
        return "min_effect" if self.min_effect > self.floor else "floor"

    def text(self, name: str) -> str:
        other = (f"min_effect {self.min_effect:.3g}" if self.set_by == "floor"
                 else f"{self.factor:g} x floor = {self.floor:.3g}")
        return f"{name} {self.value:.3g} set by {self.set_by} ({other})"

    def as_dict(self) -> dict:
        return {"margin": self.value, "set_by": self.set_by, "floor_x_factor": self.floor,
                "min_effect": self.min_effect}


def margins(floor: Floor, *, factor: float, min_effect_kl: float, min_effect_loss: float) -> tuple[Margin, Margin]:
    """Equivalence margins for (amount, loss): the floor's, never below the minimum effect of interest."""
    return (Margin(factor * floor.kl_seq_max, min_effect_kl, factor),
            Margin(factor * floor.loss_seq_max, min_effect_loss, factor))


def margins_text(floor: Floor, kl: Margin, loss: Margin) -> str:
    """One evidence line: both margins and what set them; on a floor of 0 (or none measured), says so."""
    line = f"margins: {kl.text('KL')}, {loss.text('loss')}"
    if floor.kl_seq_max == 0 and floor.loss_seq_max == 0:
        line = (FLOOR_ZERO if floor.measured else "no floor measured: margins are the minimum effect of interest") \
            + f" ({line[len('margins: '):]})"
    return line


def decide(kl: np.ndarray, dlogprob: np.ndarray, *, floor: Floor, factor: float, min_effect_kl: float,
           min_effect_loss: float, alpha: float, beta: float, tests: int,
           budget: Budget | None = None, min_steps: int = MIN_STEPS
           ) -> tuple[Effect, Effect, Effect | None, Effect | None]:
    """(amount vs floor, loss vs floor, amount vs budget, loss vs budget) on one path, each at
    alpha / `tests` (the comparison's `family`)."""
    m_kl, m_loss = margins(floor, factor=factor, min_effect_kl=min_effect_kl, min_effect_loss=min_effect_loss)
    loss = -dlogprob.astype(np.float64)
    common = dict(alpha=alpha, beta=beta, tests=tests, min_steps=min_steps)
    amount = effect_test("KL", kl, margin=m_kl.value, sigma_floor=floor.kl_block_sd, set_by=m_kl.set_by, **common)
    direction = effect_test("loss", loss, margin=m_loss.value, sigma_floor=floor.loss_block_sd, set_by=m_loss.set_by,
                            **common)
    if budget is None:
        return amount, direction, None, None
    b_amount = effect_test("KL", kl, margin=max(budget.kl, m_kl.value), sigma_floor=floor.kl_block_sd,
                           set_by="budget" if budget.kl >= m_kl.value else m_kl.set_by, **common)
    b_loss = effect_test("loss", loss, margin=max(budget.loss, m_loss.value), sigma_floor=floor.loss_block_sd,
                         set_by="budget" if budget.loss >= m_loss.value else m_loss.set_by, **common)
    return amount, direction, b_amount, b_loss


def undecided_reasons(effects, *, forced: bool, floor_measured: bool, **_) -> list[str]:
    """What would decide effects that are neither beyond nor within their margins (scoring
    would not: it judges the text after t*, not the same-context distributions)."""
    out = []
    for e in effects:
        if e is None or e.beyond or e.within:
            continue
        if e.thin:
            why = f"{e.name}: {e.thin}"
        else:
            why = f"{e.name}: upper bound {e.upper:.3g} is not inside the margin {e.margin:.3g}"
        out.append(why)
    if not out:
        return out
    more = ["more tokens (a longer same-context path)"]
    if not forced:
        more.append("forced replay (every step of the reference in the candidate's context)")
    if not floor_measured:
        more.append("a measured noise floor (diffcheck calibrate)")
    return out + ["would decide it: " + ", ".join(more)]


def far_step_threshold(floor: Floor, *, far_factor: float, far_kl: float, alpha: float = 0.05, tests: int = 1,
                       steps: int = 1) -> float:
    """A single same-context step beyond this KL is far outside anything benign:
    far_factor × the floor's largest step, at least far_kl (a per-step minimum effect of
    interest), and at least the step KL that a benign path of `steps` steps exceeds with
    probability alpha / `tests` under the floor's tail (`far_step_level`): the rule is one of
    each sequence's tests (`family`) and holds its share of alpha."""
    t = max(far_factor * floor.kl_step_max, far_kl)
    scale = _tail_scale(floor)
    if scale > 0:
        t = max(t, scale * math.log(max(steps, 1) * max(tests, 1) / alpha))
    return t


def far_step_level(floor: Floor, threshold: float, *, steps: int) -> float | None:
    """The chance that a benign path of `steps` steps has a step beyond `threshold`, under an
    exponential tail through the floor's largest step KL (scale = largest / ln N over N floor
    steps: the largest of N exponential draws sits near scale × ln N). KL under small logit
    noise is a quadratic form of it, whose tail is exponential. None where the floor has no
    tail to fit (no floor, or a floor of 0: no benign step ever moved)."""
    scale = _tail_scale(floor)
    if scale <= 0:
        return None
    return min(1.0, max(steps, 1) * math.exp(-threshold / scale))


def _tail_scale(floor: Floor) -> float:
    if floor.kl_step_max <= 0 or floor.n_steps < 2:
        return 0.0
    return floor.kl_step_max / math.log(floor.n_steps)
