"""The next cases worth running: one-literal toggles of observed bad cases that split
the hypotheses a narrowing leaves standing, each written as a ready-to-paste TOML case.

`propose` takes the narrowing's causes (``.literals``; the separate ones also
``.also_main``), builds one model per standing hypothesis (a list of conjunctions,
bad where any holds), and greedily picks the fewest toggles whose predicted outcomes
split every pair of models. Pure: no engine, no files.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from diffcheck.judging.factors import DEFAULT, Literal, conjunction_text, sorted_literals


@dataclass(frozen=True)
class NextCase:
    case_id: str
    base: str
    toggles: tuple[tuple[Literal, Literal], ...]  # (literal in the base case, its value in the variant)
    question: str  # what the two outcomes would say
    toml: str


def _predicts_bad(model: Sequence[frozenset[Literal]], lits: frozenset[Literal]) -> bool:
    return any(term <= lits for term in model)


def propose(causes, alternatives, separate, facts, outcomes, clean_map, finer=None):
    """The fewest one-literal toggles of observed bad cases that split every standing hypothesis pair."""
    main = [frozenset(c.literals) for c in causes]
    established = [frozenset(s.literals) for s in separate if not s.also_main]
    confounded = [s for s in separate if s.also_main]
    full = main + established + [frozenset(s.literals) for s in confounded]
    if len(confounded) == 1 and not alternatives:
        full_name = f"{confounded[0]} is a cause on its own"
    elif alternatives and not confounded:
        full_name = f"the main cause is {conjunction_text(main[0])}"
    elif finer and not confounded:
        full_name = f"the cover found: {'; '.join(conjunction_text(m) for m in main)}"
    else:
        full_name = "the causes as found"
    models: dict[str, list[frozenset[Literal]]] = {full_name: full}
    for s in confounded:
        models[f"{s} is not a cause on its own"] = [t for t in full if t != frozenset(s.literals)]
    for alt in alternatives:
        models[f"the main cause is {conjunction_text(alt)}"] = [frozenset(alt)] + full[1:]
    if finer:
        models[f"each bad case has its own cause: {'; '.join(conjunction_text(t) for t in finer)}"] = \
            finer + full[len(main):]
    names = list(models)
    pairs = {(a, b) for i, a in enumerate(names) for b in names[i + 1:]}
    if not pairs:
        return [], []
    values: dict[tuple[str, str], set] = {}
    for lits in facts.values():
        for lit in lits:
            values.setdefault((lit.source, lit.name), set()).add(lit.value)
    relevant = {lit for model in models.values() for term in model for lit in term}
    observed = set(facts.values())
    candidates = []
    bad_ids = [c for c, o in outcomes.items() if o == "bad" and c in facts]
    for base in bad_ids:
        for lit in sorted_literals(facts[base] & relevant):
            for value in sorted(values[(lit.source, lit.name)] - {lit.value}, key=str):
                new = Literal(lit.source, lit.name, value)
                variant = (facts[base] - {lit}) | {new}
                if variant in observed:
                    continue
                preds = {n: _predicts_bad(m, variant) for n, m in models.items()}
                splits = {(a, b) for a, b in pairs if preds[a] != preds[b]}
                if not splits:
                    continue
                nearest = min((len(variant ^ c) for c in clean_map.values()), default=99)
                expressible = new.source in ("engine", "sampling") or (new.source == "env" and value != DEFAULT)
                rank = (not expressible, nearest, len(facts[base]), base, str(lit), str(value))
                candidates.append((rank, base, lit, new, preds, splits))
    chosen, left = [], set(pairs)
    while left:
        scored = [(len(c[5] & left), c) for c in candidates]
        scored = [s for s in scored if s[0]]
        if not scored:
            break
        _, best = min(scored, key=lambda s: (-s[0], s[1][0]))
        chosen.append(best)
        left -= best[5]
    out = [_render(best, models) for best in chosen]
    return out, [f"{a} vs {b}" for a, b in sorted(left)]


_ID_BAD = re.compile(r"[^A-Za-z0-9_-]+")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value), ensure_ascii=False)


def _render(choice, models) -> NextCase:
    _, base, old, new, preds, _ = choice
    case_id = _ID_BAD.sub("_", f"{base}-{old.name}-{new.value_text}").strip("_-") or base
    bad_if = sorted(n for n, p in preds.items() if p)
    clean_if = sorted(n for n, p in preds.items() if not p)
    question = f"{base} with {new} instead of {old}: bad -> {'; '.join(bad_if)}; clean -> {'; '.join(clean_if)}"
    lines = [f"[cases.{case_id}]", f"inherits = {_toml_value(base)}",
             f"description = {_toml_value(f'{base} with {new} instead of {old} (narrowing: next case)')}"]
    if new.source in ("engine", "sampling"):
        lines.append(f"{new.source} = {{ {new.name} = {_toml_value(new.value)} }}")
    elif new.source == "env":
        if new.value == DEFAULT:
            lines.append(f"# env {new.name} unset: inheritance cannot remove an env key; copy {base} without it")
        else:
            lines.append(f"env = {{ {new.name} = {_toml_value(new.value)} }}")
    else:
        lines.append(f"# factor {new}: not a case setting; run this case where it holds (e.g. that build)")
    lines.append(f"# bad: {'; '.join(bad_if)}")
    lines.append(f"# clean: {'; '.join(clean_if)}")
    return NextCase(case_id=case_id, base=base, toggles=((old, new),), question=question, toml="\n".join(lines) + "\n")
