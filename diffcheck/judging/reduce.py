"""The search of `diffcheck reduce`: delta debugging over a failing case's pieces.

Pure: each search takes a predicate ``fails(x) -> bool`` (True: the probe still fails with
the original class) and calls it; no engine, no file. The workflow
(`diffcheck.workflows.reduce`) turns a call into a probe run.

- `ddmin`: Zeller's minimizing delta debugging over a sequence (the delta's units, the
  prompts). The result is 1-minimal: removing any one element makes the failure go away.
  Each distinct subset is asked once (memoized), so the calls are at most the distinct
  subsets visited: about log2(n) for a single cause, n^2 in the worst case.
- `smallest_failing`: bisection for the smallest integer in [lo, hi] that fails, given that
  `hi` fails and failing is monotone (the decode steps: a run that shows the bug at t steps
  shows it at every t' > t). ceil(log2(hi - lo + 1)) calls.
- `delta_units`: a candidate's config delta from its reference as droppable units, from the
  factor model (`judging.factors.case_factors`: one definition of "a key that differs"),
  with a fault's ``DIFFCHECK_FAULT*`` variables kept together (a fault and its step are one
  change: dropping the step alone would only move the fault).
- `probe_bound`: the cost bound of docs/reduce.md, 2·log2(prompts × steps) + delta keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from diffcheck.cases import resolved_config
from diffcheck.judging.factors import case_factors

T = TypeVar("T")
FAULT_PREFIX = "DIFFCHECK_FAULT"


def ddmin(items: Sequence[T], fails: Callable[[tuple[T, ...]], bool]) -> tuple[T, ...]:
    """A 1-minimal subsequence of `items` (order kept) on which `fails` holds.

    `fails(items)` is assumed (the caller has seen it); it is never asked about the empty
    sequence. A subset asked once is not asked again.
    """
    seen: dict[tuple[T, ...], bool] = {}

    def test(sub: tuple[T, ...]) -> bool:
        if sub not in seen:
            seen[sub] = bool(fails(sub))
        return seen[sub]

    current = tuple(items)
    n = 2
    while len(current) >= 2:
        size = len(current)
        chunks = [current[size * i // n: size * (i + 1) // n] for i in range(n)]
        chunks = [c for c in chunks if c]
        reduced = False
        for chunk in chunks:  # a subset alone
            if test(chunk):
                current, n, reduced = chunk, 2, True
                break
        if not reduced and len(chunks) > 2:
            for i in range(len(chunks)):  # a complement
                rest = tuple(x for j, c in enumerate(chunks) if j != i for x in c)
                if test(rest):
                    current, n, reduced = rest, max(n - 1, 2), True
                    break
        if not reduced:
            if n >= size:
                break
            n = min(size, 2 * n)
    return current


def smallest_failing(lo: int, hi: int, fails: Callable[[int], bool]) -> int:
    """The smallest t in [lo, hi] with ``fails(t)``, given ``fails(hi)`` (not asked) and monotone."""
    if lo > hi:
        raise ValueError(f"empty range [{lo}, {hi}]")
    while lo < hi:
        mid = (lo + hi) // 2
        if fails(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


@dataclass(frozen=True, order=True)
class DeltaUnit:
    """One droppable piece of a candidate's delta: the ``(source, name)`` keys that go together."""

    keys: tuple[tuple[str, str], ...]  # source: engine | sampling | env

    @property
    def label(self) -> str:
        names = [n if s in ("env", "engine") else f"{s}.{n}" for s, n in self.keys]
        return ", ".join(names)


def delta_keys(configs: dict[str, dict], candidate: str, baseline: dict) -> list[tuple[str, str]]:
    """The (source, name) keys whose value differs from `baseline` in `candidate`'s resolved config."""
    lits = case_factors({candidate: configs[candidate]}, baseline=baseline)[candidate]
    return sorted((lit.source, lit.name) for lit in lits if lit.source != "factor")


def delta_units(case, reference) -> list[DeltaUnit]:
    """`case`'s delta from `reference` (two `Case`s) as droppable units, sorted by label; a fault's
    env variables are one unit."""
    keys = delta_keys({case.id: resolved_config(case)}, case.id, resolved_config(reference))
    fault = tuple(k for k in keys if k[0] == "env" and k[1].startswith(FAULT_PREFIX))
    units = [DeltaUnit((k,)) for k in keys if k not in fault]
    if fault:
        units.append(DeltaUnit(fault))
    return sorted(units, key=lambda u: u.label)


def probe_bound(n_prompts: int, n_steps: int, n_keys: int) -> int:
    """About how many probes a fault with one cause costs: 2·log2(prompts × steps) + delta keys."""
    return math.ceil(2 * math.log2(max(2, n_prompts * n_steps))) + n_keys
