"""The noise floor: how far a reference moves under changes that must not matter.

Knows runs and same-context step statistics (`stats`); nothing about engines or
files. A floor is built from *replicas* of one reference: the same configuration
under harmless perturbations (another batch shape, one sequence at a time, a
fresh engine, another prompt order; on a GPU also another attention backend or a
fresh machine). Each replica is compared with the reference's golden on
same-context steps only:

- a *forced* replica was teacher-forced along the golden's tokens: every step counts;
- a *generate* replica (a recorded run, no forcing) counts the steps before its
  first divergence t*, where the two sides still share the context and the token.

From the pooled steps the floor keeps what the decision needs: the largest
per-sequence mean KL and mean loss (−Δlogprob of the reference token) seen under
benign variation, the per-step KL tail, and the spread of block means (for the
minimum detectable effect). Replicas are stored as ordinary runs beside the
goldens (``<ref>.floor-<name>.parquet``), content-hashed and in the manifest, so
a floor is rebuilt from files, never from a hand-set constant.

The precision spec of a run (`precision_spec`) is what a floor is keyed by: the
model and the numeric formats (dtype, KV-cache dtype, quantization). Graph mode,
backend, compile, batching, scheduling and tensor parallelism are spec-neutral.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diffcheck.judging import stats as S
from diffcheck.judging.align import align, lengths, segment_rows
from diffcheck.core.types import Run

SPEC_KEYS = ("dtype", "kv_cache_dtype", "quantization")
FLOOR_ZERO = "floor 0: margins are the minimum effect of interest"  # said wherever a floor of 0 sets no margin
BLOCK = 16  # steps per block for batch-means standard errors (decode steps are correlated over a few tokens)


def precision_spec(run: Run) -> dict[str, Any]:
    """The numeric identity of a run: model digest, dtype, KV-cache dtype, quantization (effective values)."""
    eff = run.meta.engine.get("effective") or {}
    req = run.meta.engine.get("requested") or {}
    spec = {k: eff.get(k, req.get(k)) for k in SPEC_KEYS}
    if spec.get("kv_cache_dtype") in (None, "auto"):
        spec["kv_cache_dtype"] = "auto"
    spec["model"] = run.meta.model.get("digest") or run.meta.model.get("id")
    return spec


def spec_change(reference: Run, candidate: Run) -> dict[str, tuple[Any, Any]]:
    """{key: (reference value, candidate value)} for every precision-spec key that differs."""
    a, b = precision_spec(reference), precision_spec(candidate)
    return {k: (a[k], b[k]) for k in a if a[k] != b[k] and not (a[k] is None or b[k] is None)}


def factors(run: Run, base: Run) -> set[str]:
    """The engine settings (requested or effective) and environment variables in which `run`
    differs from `base`: the factors a replica varies, or a candidate changes, against the
    reference's golden. Only keys both runs record count (a key an older diffcheck did not
    record is not a difference)."""
    out: set[str] = set()
    for table in ("requested", "effective"):
        a, b = base.meta.engine.get(table) or {}, run.meta.engine.get(table) or {}
        out |= {k for k in a.keys() & b.keys() if a[k] != b[k]}
    env_a, env_b = base.meta.env or {}, run.meta.env or {}
    return out | {f"env.{k}" for k in env_a.keys() | env_b.keys() if env_a.get(k) != env_b.get(k)}


@dataclass(frozen=True)
class Floor:
    """Benign same-context variation of one reference, pooled over its replicas."""

    replicas: tuple[str, ...] = ()
    n_steps: int = 0
    kl_seq_max: float = 0.0  # largest per-sequence mean KL of any replica
    loss_seq_max: float = 0.0  # largest per-sequence |mean Δlogprob| of any replica
    kl_step_max: float = 0.0  # largest single-step KL
    kl_step_p999: float = 0.0
    kl_block_sd: float = 0.0  # spread of block means (for the minimum detectable effect)
    loss_block_sd: float = 0.0
    kl_mean: float = 0.0
    loss_mean: float = 0.0
    notes: tuple[str, ...] = field(default=())

    @property
    def measured(self) -> bool:
        return self.n_steps > 0

    def describe(self) -> str:
        if not self.measured:
            return "no noise floor measured for this reference (margins are the minimum effect of interest)"
        zero = f"; {FLOOR_ZERO}" if not (self.kl_seq_max or self.loss_seq_max) else ""
        return (f"floor from {len(self.replicas)} replica(s) ({', '.join(self.replicas)}), {self.n_steps} steps: "
                f"per-sequence mean KL up to {self.kl_seq_max:.3g}, |mean Δlogprob| up to {self.loss_seq_max:.3g}, "
                f"step KL up to {self.kl_step_max:.3g}{zero}")

    def as_dict(self) -> dict[str, Any]:
        return {"replicas": list(self.replicas), "n_steps": self.n_steps, "kl_seq_max": self.kl_seq_max,
                "loss_seq_max": self.loss_seq_max, "kl_step_max": self.kl_step_max,
                "kl_step_p999": self.kl_step_p999, "kl_block_sd": self.kl_block_sd,
                "loss_block_sd": self.loss_block_sd, "kl_mean": self.kl_mean, "loss_mean": self.loss_mean}


def block_means(x: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """Means of consecutive full blocks of `block` steps (a short tail is dropped)."""
    nb = x.shape[0] // block
    if nb == 0:
        return np.zeros(0, np.float64)
    return x[: nb * block].astype(np.float64).reshape(nb, block).mean(1)


def replica_steps(reference: Run, replica: Run) -> list[S.StepStats]:
    """Per-sequence same-context step stats of one replica against the reference golden."""
    ref_lens, rep_lens = lengths(reference), lengths(replica)
    ref_off = np.concatenate([[0], np.cumsum(ref_lens)]).astype(np.int64)
    rep_off = np.concatenate([[0], np.cumsum(rep_lens)]).astype(np.int64)
    if replica.meta.kind == "forced":
        n = np.minimum(ref_lens, rep_lens)
    else:  # generate: the steps before t*, where both sides share the context and the token
        n = align(reference, replica, reference_len=ref_lens, candidate_len=rep_lens).shared_prefix
    st = S.compare_steps(reference.steps, replica.steps, reference_rows=segment_rows(ref_off[:-1], n),
                         candidate_rows=segment_rows(rep_off[:-1], n))
    off = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
    return [st.slice(int(off[i]), int(off[i + 1])) for i in range(len(n))]


def build_floor(reference: Run, replicas: dict[str, Run], *, min_steps: int = 8) -> Floor:
    """Pool every replica's same-context steps against `reference` into a `Floor`."""
    if not replicas:
        return Floor()
    kls, losses, seq_kl, seq_loss, kl_blocks, loss_blocks = [], [], [], [], [], []
    for run in replicas.values():
        for st in replica_steps(reference, run):
            if len(st) == 0:
                continue
            kl, d = st.kl.astype(np.float64), st.dlogprob.astype(np.float64)
            kls.append(kl)
            losses.append(-d)
            if len(st) >= min_steps:  # a per-sequence mean of a handful of steps says little
                seq_kl.append(kl.mean())
                seq_loss.append(abs(d.mean()))
            kl_blocks.append(block_means(kl))
            loss_blocks.append(block_means(-d))
    if not kls:
        return Floor(replicas=tuple(replicas), notes=("replicas share no same-context steps with the golden",))
    kl_all, loss_all = np.concatenate(kls), np.concatenate(losses)
    kb, lb = np.concatenate(kl_blocks), np.concatenate(loss_blocks)
    return Floor(
        replicas=tuple(replicas),
        n_steps=int(kl_all.shape[0]),
        kl_seq_max=float(max(seq_kl, default=kl_all.mean())),
        loss_seq_max=float(max(seq_loss, default=abs(loss_all.mean()))),
        kl_step_max=float(kl_all.max()),
        kl_step_p999=float(np.quantile(kl_all, 0.999)),
        kl_block_sd=float(kb.std(ddof=1)) if kb.shape[0] > 1 else float(kl_all.std()),
        loss_block_sd=float(lb.std(ddof=1)) if lb.shape[0] > 1 else float(loss_all.std()),
        kl_mean=float(kl_all.mean()),
        loss_mean=float(loss_all.mean()),
    )
