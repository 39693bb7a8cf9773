"""What defines a run: the resolved config, its digest, and the delta between two cases."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from diffcheck.cases.schema import Case, _digest
from diffcheck.cases.prompts import _read_prompts


def _set_fields(obj) -> dict:
    # Unset (engine-default) fields are left out, so adding a field to the
    # language later does not change the digest of every existing case.
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if value is None or value == {}:
            continue
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def resolved_config(case: Case) -> dict:
    """Everything that defines the run, canonical and JSON-able (labels and tolerances excluded)."""
    prompts = _read_prompts(case.prompts_file)
    return {
        "model": case.model,
        "prompts": {"digest": _digest([asdict(p) for p in prompts]), "count": len(prompts)},
        "sampling": _set_fields(case.sampling),
        "engine": _set_fields(case.engine),
        "env": dict(sorted(case.env.items())),
    }


def config_digest(case: Case) -> str:
    return _digest(resolved_config(case))


_ABSENT = object()


def _lookup(tree: Any, path: list) -> Any:
    for key in path:
        if isinstance(tree, dict) and key in tree:
            tree = tree[key]
        else:
            return _ABSENT
    return tree


def config_delta(case: Case, reference_case: Case) -> dict[str, tuple[Any, Any]]:
    """{dotted path: (reference value, candidate value)}; None where one side leaves it unset."""
    from deepdiff import DeepDiff

    reference, candidate = resolved_config(reference_case), resolved_config(case)
    # threshold_to_diff_deeper=0: always per key, even when two tables share few keys
    diff = DeepDiff(reference, candidate, view="tree", threshold_to_diff_deeper=0)
    paths = set()
    for levels in diff.values():
        for level in levels:
            path = level.path(output_format="list")
            # A changed list is shown whole: per-index entries read badly.
            cut = next((i for i, p in enumerate(path) if isinstance(p, int)), len(path))
            paths.add(tuple(path[:cut]))
    delta = {}
    for path in sorted(paths, key=lambda p: [str(k) for k in p]):
        ref, cand = _lookup(reference, list(path)), _lookup(candidate, list(path))
        delta[".".join(str(k) for k in path)] = (None if ref is _ABSENT else ref, None if cand is _ABSENT else cand)
    return delta
