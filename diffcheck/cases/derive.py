"""Derived cases: a case cut down to fewer prompts, fewer decode steps, a smaller config delta.

`diffcheck reduce` runs such cases as probes; each is a proper `Case` with its own id (so
its runs, files and ledger rows are its own) whose configuration is the candidate's with
some of its delta from the reference taken back to the reference's values. The pieces:

- `derive`: the probe case: delta keys dropped (taken back to the reference's values; which
  keys differ is the factor model's business, `judging.reduce.delta_units`), prompts file,
  max_tokens, engine overrides.
- `prompts_toml`, `case_toml`: the TOML text of a prompt subset and of a case (fully
  resolved: no ``inherits``), for the probe's prompt file and ``--write-case``.

Pure: no engine, no file written here (the caller writes what these return).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

from diffcheck.cases.identity import config_digest
from diffcheck.cases.schema import Case, Prompt


def values(case: Case) -> dict[tuple[str, str], Any]:
    """Every key `case` sets, as ``{(source, name): value}`` (source: engine, sampling, env)."""
    out = {}
    for source, obj in (("engine", case.engine), ("sampling", case.sampling)):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is not None and value != {} and not (source == "engine" and f.name == "kind" and value == "vllm"):
                out[(source, f.name)] = value
    for name, value in case.env.items():
        out[("env", name)] = value
    return out


def _apply(case: Case, source: str, name: str, value: Any) -> Case:
    """`case` with one key set (None: unset)."""
    if source == "env":
        env = dict(case.env)
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
        return dataclasses.replace(case, env=env)
    obj = getattr(case, source)
    if not any(f.name == name for f in dataclasses.fields(obj)):
        raise ValueError(f"{source} has no key {name!r}")
    default = next(f for f in dataclasses.fields(obj) if f.name == name)
    if value is None and default.default_factory is not dataclasses.MISSING:  # engine.extra
        value = default.default_factory()
    elif value is None and default.default is not dataclasses.MISSING:
        value = default.default
    return dataclasses.replace(case, **{source: dataclasses.replace(obj, **{name: value})})


def derive(case: Case, reference: Case, *, drop: Iterable[tuple[str, str]] = (),
           prompts_file: Path | None = None, max_tokens: int | None = None,
           engine: dict[str, Any] | None = None, probe_id: str | None = None) -> Case:
    """A probe of `case`: the keys in `drop` ((source, name)) taken back to `reference`'s values,
    `prompts_file` (a subset of its prompts), `max_tokens`, and `engine` overrides.

    Its id is ``<case>.r<8 hex>`` of its own config digest (the case's own id when nothing was
    cut) unless `probe_id` is given; its
    only reference is `reference`; labels (expect) are dropped, since the probe is not the case.
    """
    probe = case
    ref_values = values(reference)
    for source, name in drop:
        probe = _apply(probe, source, name, ref_values.get((source, name)))
    if prompts_file is not None:
        probe = dataclasses.replace(probe, prompts_file=Path(prompts_file))
    if max_tokens is not None:
        probe = _apply(probe, "sampling", "max_tokens", int(max_tokens))
    for name, value in (engine or {}).items():
        probe = _apply(probe, "engine", name, value)
    probe = dataclasses.replace(probe, references=(reference.id,), expect=None, inherits=None,
                                description=f"reduce probe of {case.id}")
    digest = config_digest(probe)
    if probe_id is None and digest == config_digest(case):
        probe_id = case.id  # nothing cut: the case itself (its ledger rows, e.g. an earlier compare, count)
    ident = probe_id or f"{case.id}.r{digest[:8]}"
    return dataclasses.replace(probe, id=ident)


# -- TOML text --------------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML for {type(value).__name__}")


def prompts_toml(prompts: Sequence[Prompt], *, header: str = "") -> str:
    """A prompts file holding `prompts`, in order."""
    lines = [f"# {line}" for line in header.splitlines()] + ([""] if header else [])
    for p in prompts:
        lines += ["[[prompt]]", f"id = {_toml_value(p.id)}", f"text = {_toml_value(p.text)}"]
        if not p.chat:
            lines.append("chat = false")
        if p.system is not None:
            lines.append(f"system = {_toml_value(p.system)}")
        lines.append("")
    return "\n".join(lines)


def case_toml(case: Case, *, case_id: str, prompts: str, role: str, references: Sequence[str] = (),
              description: str = "") -> str:
    """``[cases.<case_id>]`` with `case`'s resolved configuration spelled out (no inherits), its
    prompts file given as `prompts` (relative to the suite file)."""
    out = [f"[cases.{json.dumps(case_id)}]", f"role = {_toml_value(role)}"]
    if references:
        out.append(f"references = {_toml_value(list(references))}")
    if description:
        out.append(f"description = {_toml_value(description)}")
    out += [f"model = {_toml_value(case.model)}", f"prompts = {_toml_value(prompts)}"]
    if case.tags:
        out.append(f"tags = {_toml_value(list(case.tags))}")
    for source, obj in (("sampling", case.sampling), ("engine", case.engine)):
        rows = []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is None or value == {}:
                continue
            rows.append(f"{f.name} = {_toml_value(list(value) if isinstance(value, tuple) else value)}")
        if rows:
            out += ["", f"[cases.{json.dumps(case_id)}.{source}]"] + rows
    if case.env:
        out += ["", f"[cases.{json.dumps(case_id)}.env]"] + [f"{k} = {_toml_value(v)}" for k, v in
                                                            sorted(case.env.items())]
    if case.min_effect:
        out += ["", f"[cases.{json.dumps(case_id)}.min_effect]"] + [f"{k} = {_toml_value(v)}" for k, v in
                                                                   sorted(case.min_effect.items())]
    if case.tolerances:
        out += ["", f"[cases.{json.dumps(case_id)}.tolerances]"] + [f"{k} = {_toml_value(v)}" for k, v in
                                                                   sorted(case.tolerances.items())]
    return "\n".join(out) + "\n"
