"""The factor model of narrowing: each case as a set of `Literal`s ``key=value``.

`case_factors` builds them from resolved configs: every engine, env and sampling
key whose value differs from the baseline's in at least one case gives each case a
literal with that case's value (``default`` where the case leaves it unset), plus
the case's explicit factors (``code=fixed``, a build; ``decode_graph=FULL``, a fact
the config does not spell out), which replace a config literal of the same name.
`PRECISION_KEYS` names the literals that change the precision spec.

Pure: no engine, no files. Literal order is deterministic (sorted by text).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from diffcheck.judging.floor import SPEC_KEYS

DEFAULT = "default"  # the value of a key a case leaves unset (the case language's reset word)
SOURCES = ("engine", "sampling", "env", "factor")
PRECISION_KEYS = frozenset(SPEC_KEYS) | {"model"}


@dataclass(frozen=True, order=True)
class Literal:
    """``key=value``: `name` is the raw key, `source` where it lives (engine, sampling, env, factor)."""

    source: str
    name: str
    value: Any

    @property
    def key(self) -> str:
        """The display key: engine, env and explicit factors bare, sampling keys as ``sampling.<name>``."""
        return f"sampling.{self.name}" if self.source == "sampling" else self.name

    @property
    def value_text(self) -> str:
        if isinstance(self.value, bool):
            return "true" if self.value else "false"
        if isinstance(self.value, float) and self.value.is_integer():
            return str(int(self.value))
        return str(self.value)

    def __str__(self) -> str:
        return f"{self.key}={self.value_text}"

    def sort_key(self) -> str:
        return str(self)


def sorted_literals(literals: Iterable[Literal]) -> tuple[Literal, ...]:
    return tuple(sorted(literals, key=Literal.sort_key))


def conjunction_text(literals: Iterable[Literal]) -> str:
    lits = sorted_literals(literals)
    return " ∧ ".join(str(lit) for lit in lits) if lits else "(always)"


def _flat(config: Mapping[str, Any]) -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {}
    for source in ("engine", "sampling", "env"):
        for name, value in (config.get(source) or {}).items():
            if isinstance(value, list):
                value = json.dumps(value)
            elif isinstance(value, dict):
                value = json.dumps(value, sort_keys=True)
            out[(source, name)] = value
    return out


def case_factors(configs: Mapping[str, Mapping[str, Any]], *, baseline: Mapping[str, Any],
                 explicit: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, frozenset[Literal]]:
    """Each case's literals: `configs` are resolved configs (`cases.resolved_config`) by case id.

    Keys: every engine/sampling/env key whose value differs from `baseline`'s in at least
    one case. Each case gets ``key=<its value>`` for each such key (``default`` when unset).
    ``explicit[case]`` adds factors by name; one named like a config key replaces it.
    """
    explicit = explicit or {}
    base = _flat(baseline)
    flats = {cid: _flat(cfg) for cid, cfg in configs.items()}
    keys = sorted({k for flat in flats.values() for k in set(flat) | set(base) if flat.get(k, DEFAULT) != base.get(k, DEFAULT)})
    out = {}
    for cid, flat in flats.items():
        own = explicit.get(cid, {})
        lits = {Literal(source, name, flat.get((source, name), DEFAULT)) for source, name in keys if name not in own}
        lits |= {Literal("factor", name, value) for name, value in own.items()}
        out[cid] = frozenset(lits)
    return out
