"""The JSON report: one file, a stable schema, written atomically.

Knows how to turn `CaseVerdict`s into plain JSON values; judges nothing.

Schema (``version`` 1; a change that removes or renames a key bumps it, a new
key does not)::

    {
      "schema": "diffcheck.report",
      "version": 1,
      "meta": {...},                        # as given by the caller
      "verdict": "GIBBERISH",               # worst case verdict; IDENTICAL when no cases
      "counts": {"IDENTICAL": 3, ...},      # sequences per verdict, over all cases
      "speed": {...} | null,                # decode tokens/s of candidate and references
                                            # (diffcheck.report.speed.speed_summary); null = not given
      "cases": [{
        "candidate_id": str, "reference_id": str,
        "verdict": str,                     # a Verdict name
        "error": str | null,                # set when verdict is ERROR
        "summary": {...},
        "config_delta": {path: {"reference": value, "candidate": value}},
        "baselines": {"exact_match": bool | null, "check_logprobs_close": bool | null},
                                            # whole case; null = not recorded
        "sequences": [{
          "index": int, "prompt_id": str, "verdict": str,
          "t_star": int | null, "onset": int | null,
          "shared_prefix": int, "reference_len": int, "candidate_len": int,
          "evidence": [str, ...],           # most important first
          "stats": {...}, "baselines": {name: bool}, "quality": {...},
          "series": {name: [float | null, ...]}   # index = step
        }]
      }]
    }

Values are converted as: numpy scalars and arrays -> numbers and lists (float32
series in their shortest exact form), NaN and ±inf -> null (JSON has neither), enums -> their name, tuples/sets -> lists,
anything else unknown -> ``str(value)``. The output is valid strict JSON
(``allow_nan=False``).
"""

from __future__ import annotations

import enum
import json
import math
import os
import re
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from diffcheck.report import atomic_write_text, case_baselines
from diffcheck.core.types import CaseVerdict, SequenceVerdict, Verdict

SCHEMA = "diffcheck.report"
VERSION = 1


def to_jsonable(value: Any) -> Any:
    """A plain JSON value for ``value`` (see the module docstring for the rules)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (int, np.integer)) and not isinstance(value, np.bool_):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, (float, np.floating)):
        f = float(value)
        return f if math.isfinite(f) else None
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "f" and value.ndim == 1:
            finite = np.isfinite(value)
            if value.dtype.itemsize < 8:
                # numpy prints float32 shortest-first ("0.1", not "0.10000000149011612"):
                # half the bytes, and float32(parsed) is still the exact stored value.
                texts = value.astype(str)
                return [float(t) if ok else None for t, ok in zip(texts, finite)]
            return [x if ok else None for x, ok in zip(value.tolist(), finite)]
        if value.dtype.kind == "f":
            return [to_jsonable(row) for row in value]
        return to_jsonable(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((to_jsonable(v) for v in value), key=repr)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def config_delta_dict(delta: Mapping[str, Any]) -> dict[str, Any]:
    """``{path: {"reference": value, "candidate": value}}`` of a config delta, as JSON values."""
    out = {}
    for path, value in delta.items():
        if isinstance(value, (tuple, list)) and len(value) == 2:
            out[str(path)] = {"reference": to_jsonable(value[0]), "candidate": to_jsonable(value[1])}
        else:
            out[str(path)] = to_jsonable(value)
    return out


def sequence_dict(sequence: SequenceVerdict, *, include_series: bool = True) -> dict[str, Any]:
    series = sequence.series if include_series else {}
    return {
        "index": int(sequence.index),
        "prompt_id": str(sequence.prompt_id),
        "verdict": sequence.verdict.name,
        "t_star": to_jsonable(sequence.t_star),
        "onset": to_jsonable(sequence.onset),
        "shared_prefix": int(sequence.shared_prefix),
        "reference_len": int(sequence.reference_len),
        "candidate_len": int(sequence.candidate_len),
        "evidence": [str(e) for e in sequence.evidence],
        "stats": to_jsonable(sequence.stats),
        "baselines": to_jsonable(sequence.baselines),
        "quality": to_jsonable(sequence.quality),
        "series": {str(k): to_jsonable(np.asarray(v)) for k, v in series.items()},
    }


def case_dict(case: CaseVerdict, *, include_series: bool = True) -> dict[str, Any]:
    return {
        "candidate_id": str(case.candidate_id),
        "reference_id": str(case.reference_id),
        "verdict": case.verdict.name,
        "error": case.error,
        "summary": to_jsonable(case.summary),
        "config_delta": config_delta_dict(case.config_delta),
        "baselines": case_baselines(case),
        "sequences": [sequence_dict(s, include_series=include_series) for s in case.sequences],
    }


def report_dict(
    verdicts: Iterable[CaseVerdict], meta: Mapping[str, Any] | None = None, *, include_series: bool = True,
    speed: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole report as plain JSON values (what `write_json` writes)."""
    cases = list(verdicts)
    counts = {v.name: 0 for v in Verdict}
    for case in cases:
        for sequence in case.sequences:
            counts[sequence.verdict.name] += 1
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "meta": to_jsonable(dict(meta or {})),
        "verdict": Verdict.worst(c.verdict for c in cases).name,
        "counts": counts,
        "speed": to_jsonable(speed) if speed is not None else None,
        "cases": [case_dict(c, include_series=include_series) for c in cases],
    }


def write_json(
    path: str | os.PathLike,
    verdicts: Iterable[CaseVerdict],
    meta: Mapping[str, Any] | None = None,
    *,
    indent: int | None = 1,
    include_series: bool = True,
    speed: Mapping[str, Any] | None = None,
) -> Path:
    """Write the report to ``path`` atomically; returns the path.

    ``include_series=False`` leaves every ``series`` empty (``{}``): a small
    file for ledgers and CI artifacts that do not plot.
    """
    report = report_dict(verdicts, meta, include_series=include_series, speed=speed)
    return atomic_write_text(path, dumps(report, indent=indent) + "\n")


def render_json(result) -> str:
    """The registry's renderer for results with verdicts (a comparison, a check): what `write_json` writes."""
    return dumps(report_dict(result.verdicts, result.meta, speed=result.speed)) + "\n"


def render_data(result) -> str:
    """The registry's renderer for plain data (`diffcheck.report.results.DataReport`)."""
    return json.dumps(result.data, indent=2, default=str) + "\n"


def dumps(report: dict[str, Any], *, indent: int | None = 1) -> str:
    """Strict JSON text of a `report_dict`; indented, but each series on one line.

    One number per line would make a 1000-step series 1000 lines; the series are
    put in as placeholders and swapped for their compact text after indenting.
    """
    if indent is None:
        return json.dumps(report, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    tag = uuid.uuid4().hex  # a placeholder no real string can collide with
    compact: list[str] = []
    cases = []
    for case in report["cases"]:
        sequences = []
        for sequence in case["sequences"]:
            series = {}
            for name, values in sequence["series"].items():
                compact.append(json.dumps(values, allow_nan=False, separators=(",", ":")))
                series[name] = f"{tag}:{len(compact) - 1}"
            sequences.append({**sequence, "series": series})
        cases.append({**case, "sequences": sequences})
    text = json.dumps({**report, "cases": cases}, indent=indent, allow_nan=False, ensure_ascii=False)
    return re.sub(f'"{tag}:(\\d+)"', lambda m: compact[int(m.group(1))], text)
