"""Prompt files: ``[[prompt]]`` tables (id, text, chat, system)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from diffcheck.cases.schema import Case, Prompt, _Errors, _Spec, _check_value, _digest, _q, _read_toml, _valid


_PROMPT_KEYS = ("id", "text", "chat", "system")


def _read_prompts(path: Path) -> list[Prompt]:
    """``[[prompt]]`` tables (id, text, chat, system); a top-level ``system`` is every prompt's default."""
    err = _Errors(path)
    data = _read_toml(path)
    extra = [k for k in data if k not in ("prompt", "system")]
    if extra or not isinstance(data.get("prompt"), list) or not data["prompt"]:
        what = f"unknown top-level key {_q(extra[0])}" if extra else "no [[prompt]] tables"
        raise err(None, f"{what} (expected [[prompt]] tables with keys chat, id, system, text, "
                        "and optionally a top-level system)")
    shared = data.get("system")
    if shared is not None and (reason := _check_value("system", shared, _Spec("str"))):
        raise err(None, reason)
    prompts, seen = [], set()
    for i, raw in enumerate(data["prompt"]):
        where = f"prompt {i + 1}"
        if not isinstance(raw, dict):
            raise err(where, f"must be a table, got {_q(raw)}")
        for k, v in raw.items():
            if k not in _PROMPT_KEYS:
                raise err(where, f"unknown key {_q(k)} ({_valid(_PROMPT_KEYS)})")
            reason = _check_value(k, v, _Spec("bool" if k == "chat" else "str"))
            if reason:
                raise err(where, reason)
        for k in ("id", "text"):
            if k not in raw:
                raise err(where, f"missing {k!r}")
        if raw["id"] in seen:
            raise err(where, f"duplicate id {_q(raw['id'])}")
        seen.add(raw["id"])
        prompts.append(Prompt(id=raw["id"], text=raw["text"], chat=raw.get("chat", True),
                              system=raw.get("system", shared)))
    return prompts


def load_prompts(case: Case) -> list[Prompt]:
    return _read_prompts(case.prompts_file)


def _prompts_digest(path: Path) -> str:
    """Of the parsed prompts, so reformatting the TOML does not change a run's identity."""
    return _digest([asdict(p) for p in _read_prompts(path)])


