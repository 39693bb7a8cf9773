"""Narrowing: which factors do the bad cases share that no clean case has?

The seed investigation narrowed its cause by hand, reasoning over which config
factors the bad runs shared. This module does that reasoning on verdicts.

Inputs, per case: an outcome (``bad``: `policy.fails`; ``clean``: a pass; cases
without a verdict are left out) and its **factors**, a set of `Literal`s
``key=value`` (`diffcheck.judging.factors`: `case_factors` builds them from
resolved configs; it and `Literal` are importable from here too).

What comes out (`narrow`):

- **Main causes.** The smallest conjunctions of literals true in every bad case
  and in no clean one (exact: every inclusion-minimal hitting set of the clean
  cases, smallest first). When none exists: "no single conjunction explains it:
  N causes" and a cover, built greedily (a cover, not necessarily the smallest).
- **Separate causes (precision changes).** A bad case that changes the precision
  spec (dtype, KV-cache dtype, quantization, model; `floor.SPEC_KEYS`) carries a
  cause of its own kind: diffcheck judges such a change against a budget, not the
  noise floor. When no clean case has that change it is reported as a separate
  cause, and left out of the main analysis; when the case also carries a main
  cause, the report says the matrix cannot tell the two apart.
- **Not needed.** Literals seen only in bad cases that the causes explain
  without them (the seed log's "X is not root").
- **The next cases worth running.** The hypotheses still standing (the other
  minimal conjunctions; "the precision change is a cause on its own" for a
  confounded case) are split by variants of observed bad cases that toggle one
  literal of a hypothesis; the fewest that split every pair are chosen greedily,
  each written as a ready-to-paste TOML case (`diffcheck.judging.next_cases`).

This module holds the search (exact minimal conjunctions, the greedy cover) and
its result (`Narrowing`, with its text).

Pure: no engine, no files. Literal order is deterministic (sorted by text).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from diffcheck.judging.factors import (  # noqa: F401  (Literal, case_factors: importable here too)
    DEFAULT, PRECISION_KEYS, Literal, case_factors, conjunction_text, sorted_literals,
)
from diffcheck.judging.next_cases import NextCase, propose

_MAX_HYPOTHESES = 64  # minimal conjunctions kept per group
_MAX_SUBSETS = 200_000  # subset enumeration budget per group (beyond: greedy hitting set)


@dataclass(frozen=True)
class Cause:
    literals: tuple[Literal, ...]
    cases: tuple[str, ...]  # the bad cases it explains
    kind: str = "main"  # "main" | "precision"
    also_main: tuple[str, ...] = ()  # precision only: its cases that a main cause explains too
    needed: tuple[tuple[Literal, tuple[str, ...]], ...] = ()  # literal -> clean cases that hold without it

    def __str__(self) -> str:
        return conjunction_text(self.literals)


@dataclass(frozen=True)
class Narrowing:
    bad: tuple[str, ...]
    clean: tuple[str, ...]
    causes: tuple[Cause, ...]  # main causes
    single: bool  # one conjunction explains every main bad case
    alternatives: tuple[tuple[Literal, ...], ...] = ()  # other minimal conjunctions still standing (single)
    separate: tuple[Cause, ...] = ()
    not_needed: tuple[tuple[Literal, tuple[str, ...]], ...] = ()
    contradictions: tuple[tuple[str, str], ...] = ()  # (bad, clean) with the same factors
    next_cases: tuple[NextCase, ...] = ()
    unsplit: tuple[str, ...] = ()  # hypothesis pairs no toggle of an observed case splits
    same_output: Mapping[str, str] = field(default_factory=dict)  # case -> an earlier case with its output

    @property
    def main_bad(self) -> tuple[str, ...]:
        return tuple(c for cause in self.causes for c in cause.cases)

    def lines(self, *, skipped: Sequence[str] = ()) -> list[str]:
        """The narrowing as text, one finding per line (terminal and Markdown)."""
        out = [f"narrowing: {len(self.bad)} bad ({', '.join(self.bad) or 'none'}), {len(self.clean)} clean "
               f"({', '.join(self.clean) or 'none'})" + (f"; left out: {', '.join(skipped)}" if skipped else "")]
        if not self.bad:
            out.append("no bad case: nothing to explain")
            return out
        for bad, clean in self.contradictions:
            out.append(f"contradiction: bad {bad} and clean {clean} have the same factors; add the factor that "
                       "tells them apart (the build: factor code=...; the hardware; the client)")
        main_cases = sorted({c for cause in self.causes for c in cause.cases})
        if self.causes and self.single:
            cause = self.causes[0]
            set_aside = "" if len(cause.cases) == len(self.bad) - len(self.contradictions) else \
                " (the others are precision changes, below)"
            which = (f"the bad case {cause.cases[0]}" if len(cause.cases) == 1 else
                     f"all {len(cause.cases)} bad cases ({', '.join(cause.cases)})")
            out.append(f"main cause: one conjunction is true in {which}{set_aside} and in no clean case:")
            out.append(f"  {cause}")
            for lit, held in cause.needed:
                out.append(f"  without {lit} it would also hold in clean {', '.join(held)}")
            if self.alternatives:
                out.append("  other conjunctions as small or minimal that also fit (still standing): "
                           + "; ".join(conjunction_text(a) for a in self.alternatives))
        elif self.causes:
            out.append(f"no single conjunction explains it: {len(self.causes)} causes (a greedy cover of "
                       f"{', '.join(main_cases)}, not necessarily the smallest):")
            for cause in self.causes:
                out.append(f"  {cause}  explains {', '.join(cause.cases)}")
        for cause in self.separate:
            line = (f"separate cause (a precision change): {cause} explains {', '.join(cause.cases)}, "
                    "and no clean case has it")
            if cause.also_main:
                line += (f"; {', '.join(cause.also_main)} also carr{'ies' if len(cause.also_main) == 1 else 'y'} "
                         "a main cause, so this matrix cannot tell whether it is bad on its own")
            out.append(line)
        for lit, where in self.not_needed:
            same = [f"{c}: same output as {self.same_output[c]}" for c in where if c in self.same_output]
            out.append(f"not needed: {lit} (only in bad {', '.join(where)}, explained without it"
                       + (f"; {'; '.join(same)}" if same else "") + ")")
        if self.next_cases:
            out.append(f"next cases worth running ({len(self.next_cases)}):")
            for nc in self.next_cases:
                out.append(f"  {nc.case_id}: {nc.question}")
        elif self.bad:
            out.append("next cases worth running: none; one explanation stands"
                       + (f" (no toggle of an observed case splits: {'; '.join(self.unsplit)})" if self.unsplit else ""))
        return out

    def toml(self) -> str:
        return "\n".join(nc.toml for nc in self.next_cases)


# -- the search ------------------------------------------------------------------------------------


def _consistent(conj: frozenset[Literal], clean: Sequence[frozenset[Literal]]) -> bool:
    return not any(conj <= c for c in clean)


def minimal_conjunctions(pool: frozenset[Literal], clean: Sequence[frozenset[Literal]], *,
                         limit: int = _MAX_HYPOTHESES) -> list[frozenset[Literal]]:
    """Inclusion-minimal subsets of `pool` true in no clean case, smallest first (then by text)."""
    misses = [pool - c for c in clean]  # a conjunction must keep one literal of each: a hitting set
    if any(not m for m in misses):
        return []
    items = sorted_literals(pool)
    found: list[frozenset[Literal]] = []
    budget = _MAX_SUBSETS
    for size in range(0, len(items) + 1):
        if found and size > len(found[0]) + 2:
            break
        for combo in itertools.combinations(items, size):
            budget -= 1
            if budget < 0:
                return found or [_greedy_hitting_set(misses)]
            s = frozenset(combo)
            if any(f <= s for f in found):
                continue
            if all(s & m for m in misses):
                found.append(s)
                if len(found) >= limit:
                    return found
    return found


def _greedy_hitting_set(misses: Sequence[frozenset[Literal]]) -> frozenset[Literal]:
    chosen: set[Literal] = set()
    left = [m for m in misses]
    while left:
        counts: dict[Literal, int] = {}
        for m in left:
            for lit in m:
                counts[lit] = counts.get(lit, 0) + 1
        best = min(counts, key=lambda lit: (-counts[lit], str(lit)))
        chosen.add(best)
        left = [m for m in left if best not in m]
    return frozenset(chosen)


def _needed(conj: frozenset[Literal], clean: Mapping[str, frozenset[Literal]]) -> tuple:
    out = []
    for lit in sorted_literals(conj):
        rest = conj - {lit}
        held = tuple(cid for cid, lits in clean.items() if rest <= lits)
        out.append((lit, held))
    return tuple(out)


def _cover(bad: Sequence[str], facts: Mapping[str, frozenset[Literal]],
           clean: Sequence[frozenset[Literal]]) -> list[tuple[frozenset[Literal], tuple[str, ...]]]:
    """Greedy: grow a group from each uncovered case, keep the term that covers most (then fewest literals)."""
    uncovered = list(bad)
    terms = []
    while uncovered:
        best = None
        for seed in uncovered:
            pool = facts[seed]
            for other in sorted((c for c in uncovered if c != seed), key=lambda c: (-len(pool & facts[c]), c)):
                if _consistent(pool & facts[other], clean):
                    pool = pool & facts[other]
            conj = minimal_conjunctions(pool, clean, limit=1)[0]
            covered = tuple(c for c in uncovered if conj <= facts[c])
            rank = (-len(covered), len(conj), conjunction_text(conj))
            if best is None or rank < best[0]:
                best = (rank, conj, covered)
        _, conj, covered = best
        terms.append((conj, covered))
        uncovered = [c for c in uncovered if c not in covered]
    return terms


def narrow(outcomes: Mapping[str, str], facts: Mapping[str, frozenset[Literal]], *,
           precision_keys: Iterable[str] = PRECISION_KEYS, same_output: Mapping[str, str] | None = None) -> Narrowing:
    """Narrow the cause of the bad cases.

    `outcomes`: case id -> ``bad`` or ``clean`` (others are ignored). `facts`: case id ->
    literals (`case_factors`). `same_output`: case -> an earlier case that generated exactly
    the same output (shown beside literals that changed nothing).
    """
    precision_keys = frozenset(precision_keys)
    bad = tuple(c for c, o in outcomes.items() if o == "bad" and c in facts)
    clean_ids = tuple(c for c, o in outcomes.items() if o == "clean" and c in facts)
    clean_map = {c: facts[c] for c in clean_ids}
    clean = list(clean_map.values())
    contradictions = tuple((b, next(c for c in clean_ids if facts[b] <= facts[c]))
                           for b in bad if not _consistent(facts[b], clean))
    explainable = [b for b in bad if _consistent(facts[b], clean)]

    # Precision changes: a cause of their own kind, when no clean case has them.
    def precision_lits(cid: str) -> frozenset[Literal]:
        return frozenset(lit for lit in facts[cid] if lit.name in precision_keys and lit.value != DEFAULT)

    separate_groups: dict[frozenset[Literal], list[str]] = {}
    main_bad = []
    for b in explainable:
        p = precision_lits(b)
        if p and _consistent(p, clean):
            conj = minimal_conjunctions(p, clean, limit=1)[0]
            separate_groups.setdefault(conj, []).append(b)
        else:
            main_bad.append(b)

    causes: list[Cause] = []
    alternatives: tuple = ()
    single = False
    if main_bad:
        common = frozenset.intersection(*(facts[b] for b in main_bad))
        minimal = minimal_conjunctions(common, clean)
        if minimal:
            single = True
            chosen = minimal[0]
            causes = [Cause(sorted_literals(chosen), tuple(main_bad), needed=_needed(chosen, clean_map))]
            alternatives = tuple(sorted_literals(m) for m in minimal[1:])
        else:
            for conj, covered in _cover(main_bad, facts, clean):
                causes.append(Cause(sorted_literals(conj), covered, needed=_needed(conj, clean_map)))
    separate = []
    for conj, cases in separate_groups.items():
        also = tuple(c for c in cases if any(frozenset(m.literals) <= facts[c] for m in causes))
        separate.append(Cause(sorted_literals(conj), tuple(cases), kind="precision", also_main=also))
    separate.sort(key=lambda c: str(c))

    in_causes = {lit for cause in (*causes, *separate) for lit in cause.literals} | {lit for a in alternatives for lit in a}
    clean_lits = set().union(*clean) if clean else set()
    not_needed: dict[Literal, list[str]] = {}
    for b in explainable:
        for lit in facts[b]:
            if lit not in clean_lits and lit not in in_causes and not (lit.name in precision_keys and lit.value != DEFAULT
                                                                       and b in {c for s in separate for c in s.cases}):
                not_needed.setdefault(lit, []).append(b)
    not_needed_t = tuple((lit, tuple(cases)) for lit, cases in sorted(not_needed.items(), key=lambda kv: str(kv[0])))

    finer = None
    if main_bad and not single:
        # A competing explanation of a cover: each bad case by literals only bad cases carry.
        terms = []
        for cause in causes:
            own = {c: sorted(facts[c] - clean_lits - set(cause.literals), key=str) for c in cause.cases}
            if all(own.values()):
                terms += [frozenset({lit}) for c in cause.cases for lit in own[c]]
            else:
                terms.append(frozenset(cause.literals))
        terms = list(dict.fromkeys(terms))
        finer = terms if set(terms) != {frozenset(c.literals) for c in causes} else None
    next_cases, unsplit = propose(causes, alternatives, separate, facts, outcomes, clean_map, finer)
    return Narrowing(bad=bad, clean=clean_ids, causes=tuple(causes), single=single, alternatives=alternatives,
                     separate=tuple(separate), not_needed=not_needed_t, contradictions=contradictions,
                     next_cases=tuple(next_cases), unsplit=tuple(unsplit), same_output=dict(same_output or {}))

