"""Recorded outcomes: verdicts reached elsewhere (by hand, by an older tool), one line per case.

A suite's hand-run history can be narrowed without running anything
(``diffcheck matrix --from-outcomes FILE``). The file::

    [outcomes]
    suite = "flash-v100-quality"          # the suite whose cases these are
    baseline = "J"                        # factors are taken relative to this case
    factors = { code = "pre-fix" }        # explicit factors every case has unless its line says otherwise

    [ids]
    E = { outcome = "bad", reason = "766 tokens, digit_ratio 0.1286 ...", output = "041eeb92" }
    O = { outcome = "clean", reason = "...", factors = { code = "fixed" }, tokens_per_s = 121.269 }
    C = { outcome = "not-a-verdict", reason = "first-token comparison" }

Per id: ``outcome`` (bad, clean, not-a-verdict) and ``reason`` (one line) are required;
``factors`` (a table of strings, integers or booleans), ``output`` (the recorded output
hash, or a prefix of it: equal values mean "same output"), ``metrics`` (digit_ratio,
weird_runs, repeated_num_runs, max_digit_run, tokens) and ``tokens_per_s`` are optional.
Every error is one line naming the file, the field and what is valid.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffcheck.core.errors import ConfigError

OUTCOMES = ("bad", "clean", "not-a-verdict")
METRICS = ("digit_ratio", "weird_runs", "repeated_num_runs", "max_digit_run", "tokens")
_ID_KEYS = ("outcome", "reason", "factors", "output", "metrics", "tokens_per_s")


@dataclass(frozen=True)
class Recorded:
    case_id: str
    outcome: str
    reason: str
    factors: dict[str, Any] = field(default_factory=dict)  # explicit factors, defaults merged in
    output: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float | None = None


@dataclass(frozen=True)
class Outcomes:
    path: Path
    suite: str
    baseline: str
    ids: dict[str, Recorded]


def _plain_factor(value: Any) -> bool:
    return isinstance(value, (str, int, bool)) and not (isinstance(value, str) and not value)


def load_outcomes(path: str | Path, *, suite=None) -> Outcomes:
    """Read and check an outcomes file; with `suite` (a loaded Suite), every id must be one of its cases."""
    path = Path(path)

    def err(where: str, message: str) -> ConfigError:
        return ConfigError(f"{path}: {where}: {message}".replace("\n", " "))

    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: file does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    unknown = sorted(set(data) - {"outcomes", "ids"})
    if unknown:
        raise err(unknown[0], "unknown table (valid: outcomes, ids)")
    head = data.get("outcomes")
    if not isinstance(head, dict):
        raise err("[outcomes]", "missing table with suite, baseline and optional factors")
    for k in head:
        if k not in ("suite", "baseline", "factors"):
            raise err(f"outcomes.{k}", "unknown key (valid: baseline, factors, suite)")
    for k in ("suite", "baseline"):
        if not isinstance(head.get(k), str) or not head[k]:
            raise err(f"outcomes.{k}", "must be a non-empty string")
    defaults = head.get("factors", {})
    if not isinstance(defaults, dict) or not all(_plain_factor(v) for v in defaults.values()):
        raise err("outcomes.factors", "must be a table of strings, integers or booleans")
    ids = data.get("ids")
    if not isinstance(ids, dict) or not ids:
        raise err("[ids]", "missing: one line per case, ID = { outcome = \"bad\", reason = \"...\" }")
    if suite is not None:
        if head["suite"] != suite.name:
            raise err("outcomes.suite", f"is {head['suite']!r} but the suite given is {suite.name!r}")
        for cid in [head["baseline"], *ids]:
            if cid not in suite.cases:
                where = "outcomes.baseline" if cid == head["baseline"] else f"ids.{cid}"
                raise err(where, f"no case {cid!r} in suite {suite.name!r} (valid: {', '.join(sorted(suite.cases))})")
    out = {}
    for cid, raw in ids.items():
        where = f"ids.{cid}"
        if not isinstance(raw, dict):
            raise err(where, "must be an inline table { outcome = ..., reason = ... }")
        for k in raw:
            if k not in _ID_KEYS:
                raise err(f"{where}.{k}", f"unknown key (valid: {', '.join(sorted(_ID_KEYS))})")
        if raw.get("outcome") not in OUTCOMES:
            raise err(f"{where}.outcome", f"must be one of {', '.join(OUTCOMES)}; got {raw.get('outcome')!r}")
        if not isinstance(raw.get("reason"), str) or not raw["reason"].strip() or "\n" in raw["reason"]:
            raise err(f"{where}.reason", "must be one non-empty line of text")
        factors = raw.get("factors", {})
        if not isinstance(factors, dict) or not all(_plain_factor(v) for v in factors.values()):
            raise err(f"{where}.factors", "must be a table of strings, integers or booleans")
        output = raw.get("output")
        if output is not None and (not isinstance(output, str) or not output):
            raise err(f"{where}.output", "must be a non-empty string (the recorded output hash or its prefix)")
        metrics = raw.get("metrics", {})
        if not isinstance(metrics, dict):
            raise err(f"{where}.metrics", f"must be a table (valid keys: {', '.join(METRICS)})")
        for k, v in metrics.items():
            if k not in METRICS:
                raise err(f"{where}.metrics.{k}", f"unknown metric (valid: {', '.join(METRICS)})")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise err(f"{where}.metrics.{k}", f"must be a number >= 0, got {v!r}")
        tps = raw.get("tokens_per_s")
        if tps is not None and (isinstance(tps, bool) or not isinstance(tps, (int, float)) or tps <= 0):
            raise err(f"{where}.tokens_per_s", f"must be a number > 0, got {tps!r}")
        out[cid] = Recorded(case_id=cid, outcome=raw["outcome"], reason=raw["reason"].strip(),
                            factors={**defaults, **factors}, output=output, metrics=dict(metrics),
                            tokens_per_s=None if tps is None else float(tps))
    return Outcomes(path=path, suite=head["suite"], baseline=head["baseline"], ids=out)
