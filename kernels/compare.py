"""Error statistics of a candidate output against the float64 reference.

Knows per-dtype tolerances and how to judge one output tensor; nothing about
kernels or graphs. The check is elementwise ``|candidate - reference| <=
atol + rtol * |reference|`` (``torch.testing.assert_close``'s rule); the
statistics reported are the max and mean absolute difference. A NaN or inf in
the candidate counts as an infinite difference, never as a pass.

Tolerances are per dtype because the inputs are already rounded to that dtype
and the reference is computed from those rounded values: what is left is the
kernel's own accumulation and output rounding. bfloat16 keeps 8 significant
bits (relative step 2**-8); float16 keeps 11 (2**-11). Kernels that round the
softmax probabilities to the input dtype before the value product (vLLM's CPU
op does in bf16) sit a few output-roundings off, hence a few steps of margin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def __str__(self) -> str:
        return f"atol={self.atol:.2g} rtol={self.rtol:.2g}"


TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(atol=2e-5, rtol=2e-5),
    "float16": Tolerance(atol=2e-3, rtol=2e-3),
    "bfloat16": Tolerance(atol=1.6e-2, rtol=1.6e-2),
}

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class ErrorStats:
    max_err: float
    mean_err: float
    within: bool  # every element within tolerance
    worst: tuple[int, ...]  # index of the largest difference

    def describe(self, tol: Tolerance) -> str:
        return f"max diff {self.max_err:.3e}, mean diff {self.mean_err:.3e} at {list(self.worst)} ({tol})"


def error_stats(candidate: torch.Tensor, reference: torch.Tensor, tol: Tolerance) -> ErrorStats:
    """Max and mean absolute difference, and whether all elements are within ``tol``."""
    if candidate.shape != reference.shape:
        raise ValueError(f"shape mismatch: candidate {tuple(candidate.shape)} vs reference {tuple(reference.shape)}")
    cand = candidate.detach().to("cpu", torch.float64)
    ref = reference.detach().to("cpu", torch.float64)
    diff = (cand - ref).abs()
    diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, math.inf))
    if diff.numel() == 0:
        return ErrorStats(0.0, 0.0, True, ())
    within = bool((diff <= tol.atol + tol.rtol * ref.abs()).all())
    flat = int(diff.argmax())
    worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    return ErrorStats(max_err=float(diff.max()), mean_err=float(diff.mean()), within=within, worst=worst)


def assert_close(candidate: torch.Tensor, reference: torch.Tensor, tol: Tolerance, *, what: str = "output") -> ErrorStats:
    """Raise AssertionError naming max and mean difference when not within ``tol``."""
    stats = error_stats(candidate, reference, tol)
    if not stats.within:
        raise AssertionError(f"{what}: not close: {stats.describe(tol)}")
    return stats
