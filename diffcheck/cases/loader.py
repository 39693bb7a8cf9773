"""Loading suites: files, inheritance, ``${VAR}`` expansion, references."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from diffcheck.core.errors import ConfigError
from diffcheck.core.types import ROLES, Verdict
from diffcheck.cases.schema import (
    CASE_KEYS, CONFIG_KEYS, ENGINE_SPEC, EXPECTABLE, RESET, SAMPLING_SPEC, Case, EngineConfig,
    Expect, Sampling, Suite, display_path,
)
from diffcheck.cases.prompts import _prompts_digest, _read_prompts
from diffcheck.cases.schema import (_is_file, _read_toml, _ID, _VAR, _Errors, _Spec, _check_layer, _check_value, _plain, _q, _valid)  # noqa: F401


def _default_cases_dir() -> Path:
    from diffcheck.core import config

    return config.cases_dir()


def cases_dir() -> Path:
    """Where the project's suites live: $DIFFCHECK_CASES, else [tool.diffcheck] cases, else ./cases
    (`diffcheck.core.config`)."""
    return _default_cases_dir()


def list_suites(cases_dir: Path | None = None) -> list[str]:
    """Names of the suites in `cases_dir` (default: `cases_dir()`), sorted."""
    folder = Path(cases_dir) if cases_dir is not None else _default_cases_dir()
    return sorted(p.stem for p in folder.glob("*.toml")) if folder.is_dir() else []


def _suite_path(name_or_path: str | Path, folder: Path | None) -> Path:
    text = str(name_or_path)
    if text.endswith(".toml") or os.sep in text or "/" in text:
        return Path(text)
    from diffcheck.core import config

    folder = Path(folder) if folder is not None else _default_cases_dir()
    found = config.suite_file(text, folder)  # the project's suite, else the one shipped with diffcheck
    if found is None:
        path = folder / f"{text}.toml"
        known = list_suites(folder)
        shipped = config.shipped_suites()
        raise _Errors(path)(None, f"no such suite {_q(text)} (available: {', '.join(known) or 'none'})"
                                  + (f"; diffcheck ships {', '.join(shipped)}" if shipped else ""))
    return found


def load_suite(name_or_path: str | Path | None = None, *, cases_dir: Path | None = None) -> Suite:
    """A suite by name (``<cases>/<name>.toml``, else the suite of that name shipped with diffcheck)
    or by path; refused whole on any error. None: the project's default suite (`diffcheck.core.config`)."""
    if name_or_path is None:
        from diffcheck.core import config

        name_or_path = config.default_suite()
    path = _suite_path(name_or_path, cases_dir)
    return parse_suite(_read_toml(path), path=path)


def parse_suite(data: Any, *, path: Path) -> Suite:
    """Validate and resolve an already-parsed suite table (`path` names it and anchors `prompts`)."""
    path = Path(path)
    err = _Errors(path)
    if not isinstance(data, dict):
        raise err(None, f"must be a table, got {_q(data)}")
    unknown = [k for k in data if k not in ("suite", "defaults", "cases")]
    if unknown:
        raise err(None, f"unknown top-level key {_q(unknown[0])} (valid: cases, defaults, suite)")
    head = data.get("suite")
    if not isinstance(head, dict):
        raise err(None, "missing [suite] table with name and description")
    for k, v in head.items():
        if k not in ("name", "description"):
            raise err("[suite]", f"unknown key {_q(k)} (valid: description, name)")
        if not isinstance(v, str):
            raise err("[suite]", f"{k} must be a string, got {_q(v)}")
    if head.get("name") != path.stem:
        got = f", got {_q(head['name'])}" if "name" in head else ""
        raise err("[suite]", f"name must equal the file stem {_q(path.stem)}{got}")
    defaults = data.get("defaults", {})
    _check_layer(defaults, CONFIG_KEYS, err, "[defaults]")
    raw_cases = data.get("cases")
    if not isinstance(raw_cases, dict) or not raw_cases:
        raise err(None, "no cases: add at least one [cases.ID] table")
    for cid, raw in raw_cases.items():
        if not isinstance(cid, str) or not _ID.match(cid):
            raise err(f"case {_q(cid)}", "case ids must match [A-Za-z0-9][A-Za-z0-9_.-]* (they name golden folders)")
        _check_layer(raw, CASE_KEYS, err, f"case {_q(cid)}")
    merged = {cid: _resolve_chain(cid, raw_cases, defaults, err) for cid in raw_cases}
    cases = {cid: _build_case(cid, merged[cid], raw_cases[cid], suite=path.stem, path=path, err=err)
             for cid in raw_cases}
    _check_references(cases, err)
    return Suite(name=path.stem, description=head.get("description", ""), path=path, cases=cases)


def _merge(base: dict, child: dict) -> dict:
    out = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


_NOT_INHERITED = ("expect", "description", "inherits")


def _resolve_chain(cid: str, raw_cases: dict, defaults: dict, err) -> dict:
    chain = [cid]
    while "inherits" in raw_cases[chain[-1]]:
        parent = raw_cases[chain[-1]]["inherits"]
        if parent in chain:
            cycle = chain[chain.index(parent):] + [parent]
            raise err(f"case {_q(cid)}", f"inheritance cycle {' -> '.join(cycle)}")
        if parent not in raw_cases:
            raise err(f"case {_q(chain[-1])}", f"inherits unknown case {_q(parent)} ({_valid(raw_cases)})")
        chain.append(parent)
    merged = dict(defaults)
    for ancestor in reversed(chain[1:]):
        layer = {k: v for k, v in raw_cases[ancestor].items() if k not in _NOT_INHERITED}
        merged = _merge(merged, layer)
    return _merge(merged, raw_cases[cid])


def _expand(text: str, key: str, err, where: str) -> str:
    def sub(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        value = os.environ.get(name)
        if value:
            return value
        if default is not None:
            return default
        raise err(where, f"{key}: environment variable {name} is not set (write ${{{name}:-default}} to give a default)")

    return _VAR.sub(sub, text)


def _typed(cls, raw: dict, spec: dict[str, _Spec]):
    kwargs = {}
    for key, value in raw.items():
        if value == RESET:
            continue  # keep the dataclass default: the engine decides
        kind = spec[key].kind
        if kind == "number":
            value = float(value)  # 1 and 1.0 must give one digest
        elif kind == "strlist":
            value = tuple(value)
        elif kind == "table":
            value = json.loads(json.dumps(value))  # a private deep copy
        kwargs[key] = value
    return cls(**kwargs)


def _build_case(cid: str, merged: dict, own: dict, *, suite: str, path: Path, err) -> Case:
    where = f"case {_q(cid)}"
    for key in ("role", "model", "prompts"):
        if key not in merged:
            hint = f" ({_valid(ROLES)})" if key == "role" else " (set it in [defaults] or the case)"
            raise err(where, f"{key} is required{hint}")
    references = tuple(merged.get("references", ()))
    if merged["role"] == "candidate" and not references:
        raise err(where, "a candidate needs references = [\"ID\", ...] naming reference cases")
    prompts_file = Path(_expand(merged["prompts"], "prompts", err, where))
    if not prompts_file.is_absolute():
        prompts_file = path.parent / prompts_file
    if not _is_file(prompts_file):
        folder = prompts_file.parent
        known = sorted(p.name for p in folder.glob("*.toml")) if folder.is_dir() else []
        raise err(where, f"prompts file {display_path(prompts_file)} does not exist (available: {', '.join(known) or 'none'})")
    _read_prompts(prompts_file)  # refuse the suite now, not when the engine starts
    env = dict(merged.get("env", {}))
    _check_fault_env(env, err, where)
    expect = _build_expect(own.get("expect"), err, where)
    engine = _typed(EngineConfig, merged.get("engine", {}), ENGINE_SPEC)
    _check_engine(engine, env, err, where)
    return Case(
        id=cid,
        suite=suite,
        role=merged["role"],
        description=own.get("description", ""),
        references=references,
        model=_expand(merged["model"], "model", err, where),
        prompts_file=prompts_file,
        sampling=_typed(Sampling, merged.get("sampling", {}), SAMPLING_SPEC),
        engine=engine,
        env=env,
        expect=expect,
        tolerances={k: float(v) for k, v in merged.get("tolerances", {}).items()},
        tags=tuple(merged.get("tags", ())),
        inherits=own.get("inherits"),
        source=path,
        min_effect={k: float(v) for k, v in merged.get("min_effect", {}).items()},
    )


def _check_engine(engine: EngineConfig, env: dict[str, str], err, where: str) -> None:
    """The merged engine table (and env) against its kind's static rules (`diffcheck.engines.registry`)."""
    import dataclasses

    from diffcheck.cases import engine_kinds as registry

    reason = registry.check_config(dataclasses.asdict(engine), env)
    if reason:
        raise err(where, reason)


def _check_fault_env(env: dict[str, str], err, where: str) -> None:
    """The DIFFCHECK_FAULT* keys of the merged env, as the faults will read them: a typo is refused now.

    `diffcheck.cases.faults` is the registry (pure: no vLLM, no torch). Checked after
    inheritance, since a parent may set the fault and a child its step.
    """
    from diffcheck.cases import faults as spec

    try:
        spec.parse_env(env)
    except ConfigError as exc:
        raise err(where, f"env: {exc.message}") from None


def _build_expect(raw: dict | None, err, where: str) -> Expect | None:
    if raw is None:
        return None
    if "verdict" not in raw and "not_verdict" not in raw:
        raise err(where, "expect needs verdict = \"...\" or not_verdict = [...] "
                         f"(valid verdicts: {', '.join(EXPECTABLE)})")
    if "verdict" in raw and raw["verdict"] in raw.get("not_verdict", ()):
        raise err(where, f"expect.verdict {raw['verdict']} is also in expect.not_verdict")
    if "onset" in raw and raw.get("verdict") != "GIBBERISH":
        raise err(where, "expect.onset needs expect.verdict = \"GIBBERISH\" (only gibberish has an onset)")
    if "onset_tolerance" in raw and "onset" not in raw:
        raise err(where, "expect.onset_tolerance needs expect.onset")
    return Expect(
        verdict=Verdict[raw["verdict"]] if "verdict" in raw else None,
        not_verdict=tuple(Verdict[v] for v in raw.get("not_verdict", ())),
        onset=raw.get("onset"),
        onset_tolerance=raw.get("onset_tolerance", 0),
    )


def _check_references(cases: dict[str, Case], err) -> None:
    for case in cases.values():
        where = f"case {_q(case.id)}"
        for ref in case.references:
            if ref == case.id:
                raise err(where, "a case cannot reference itself")
            if ref not in cases:
                raise err(where, f"references unknown case {_q(ref)} ({_valid(cases)})")
            other = cases[ref]
            if other.role != "reference":
                refs = sorted(c.id for c in cases.values() if c.role == "reference")
                raise err(where, f"references {_q(ref)}, which is a candidate (reference cases: {', '.join(refs)})")
            if _prompts_digest(other.prompts_file) != _prompts_digest(case.prompts_file):
                raise err(where, f"prompts {display_path(case.prompts_file)} differ from reference {_q(ref)}'s "
                                 f"{display_path(other.prompts_file)}; runs are compared prompt by prompt")


def get_case(suite: Suite, case_id: str) -> Case:
    if case_id not in suite.cases:
        raise _Errors(suite.path)(None, f"no case {_q(case_id)} in suite {_q(suite.name)} ({_valid(suite.cases)})")
    return suite.cases[case_id]


