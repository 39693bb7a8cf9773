"""The case language's schema: the `Case` data, the keys each table takes, and the
one-line errors (`_Errors`) that name the file, the case, the key and what is valid.

Part of `diffcheck.cases`: the package docstring has the rules of the language.
Knows nothing about engines: an `EngineConfig` is data.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffcheck.core.errors import ConfigError
from diffcheck.cases import engine_kinds as registry
from diffcheck.core.types import ROLES, Verdict

DEFAULT_SUITE = "default"
RESET = "default"  # the value that resets an inherited sampling/engine key
# Cases with one of these tags run only when named (by id): too slow for a 2-core CPU, or needing a GPU.
NOT_BY_DEFAULT = ("slow", "gpu")
EXPECTABLE = ("IDENTICAL", "BENIGN_DRIFT", "WITHIN_BUDGET", "DEGRADED", "GIBBERISH")
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
ENGINE_KINDS = registry.KINDS  # a static map: no engine module is imported
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")  # case ids name golden folders
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling. None means "engine default"."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    logprobs: int | None = None  # top-k logprobs captured per step
    min_tokens: int | None = None
    stop: tuple[str, ...] | None = None


@dataclass(frozen=True)
class EngineConfig:
    """Engine construction. None means "engine default"; `extra` goes verbatim to the constructor."""

    kind: str = "vllm"
    tensor_parallel_size: int | None = None
    attention_backend: str | None = None
    cudagraph_mode: str | None = None
    compile_mode: int | None = None
    enforce_eager: bool | None = None
    dtype: str | None = None
    kv_cache_dtype: str | None = None
    quantization: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_gib: float | None = None
    seed: int | None = None
    trust_remote_code: bool | None = None
    base_url: str | None = None  # kind "openai": a server that already runs (else diffcheck starts one)
    served_model_name: str | None = None  # kind "openai": the model name the server answers to
    api_key_env: str | None = None  # kind "openai" at base_url: the environment variable holding its API key
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Expect:
    """A case's label for `diffcheck selftest`: the verdict it must (or must not) get."""

    verdict: Verdict | None = None
    not_verdict: tuple[Verdict, ...] = ()
    onset: int | None = None
    onset_tolerance: int = 0

    def matches(self, verdict: Verdict, onset: int | None = None) -> bool:
        if verdict in self.not_verdict:
            return False
        if self.verdict is not None and verdict is not self.verdict:
            return False
        if self.onset is not None:
            return onset is not None and abs(onset - self.onset) <= self.onset_tolerance
        return True


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    chat: bool = True  # apply the model's chat template
    system: str | None = None  # None: the template's own system message, if any


@dataclass(frozen=True)
class Case:
    id: str
    suite: str
    role: str  # "reference" | "candidate"
    description: str
    references: tuple[str, ...]
    model: str  # a known model id or a path, ${VAR} expanded
    prompts_file: Path
    sampling: Sampling
    engine: EngineConfig
    env: dict[str, str]
    expect: Expect | None
    tolerances: dict[str, float]
    tags: tuple[str, ...]
    inherits: str | None
    source: Path
    # The minimum effect of interest the user set ({"kl": ..., "loss": ...}, either or both; the
    # judge's defaults fill the rest: `judging.tolerances.Tolerances.of_case`).
    min_effect: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    path: Path
    cases: dict[str, Case]


# --- the schema -------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    """One typed key: kind is int | number | bool | str | enum | strlist | table."""

    kind: str
    choices: tuple[str, ...] = ()
    lo: float | None = None
    hi: float | None = None
    above: float | None = None  # exclusive lower bound
    finite: bool = True  # inf is refused except where it means "no limit" (tolerances)


SAMPLING_SPEC = {
    "max_tokens": _Spec("int", lo=1),
    "temperature": _Spec("number", lo=0),
    "top_p": _Spec("number", above=0, hi=1),
    "top_k": _Spec("int", lo=-1),  # -1 (and 0) disable top-k in vLLM
    "seed": _Spec("int"),
    "ignore_eos": _Spec("bool"),
    "skip_special_tokens": _Spec("bool"),
    "logprobs": _Spec("int", lo=0),
    "min_tokens": _Spec("int", lo=0),
    "stop": _Spec("strlist"),
}
ENGINE_SPEC = {
    "kind": _Spec("enum", ENGINE_KINDS),
    "tensor_parallel_size": _Spec("int", lo=1),
    "attention_backend": _Spec("str"),  # free: forks add backends (FLASH_ATTN_V100)
    "cudagraph_mode": _Spec("enum", CUDAGRAPH_MODES),
    "compile_mode": _Spec("int", lo=0, hi=3),
    "enforce_eager": _Spec("bool"),
    "dtype": _Spec("enum", DTYPES),
    "kv_cache_dtype": _Spec("enum", KV_CACHE_DTYPES),
    "quantization": _Spec("str"),
    "max_model_len": _Spec("int", lo=1),
    "max_num_seqs": _Spec("int", lo=1),
    "max_num_batched_tokens": _Spec("int", lo=1),
    "enable_prefix_caching": _Spec("bool"),
    "enable_chunked_prefill": _Spec("bool"),
    "gpu_memory_utilization": _Spec("number", above=0, hi=1),
    "kv_cache_memory_gib": _Spec("number", above=0),
    "seed": _Spec("int"),
    "trust_remote_code": _Spec("bool"),
    "base_url": _Spec("str"),
    "served_model_name": _Spec("str"),
    "api_key_env": _Spec("str"),
    "extra": _Spec("table"),
}
EXPECT_SPEC = {
    "verdict": _Spec("enum", EXPECTABLE),
    "not_verdict": _Spec("strlist", EXPECTABLE),
    "onset": _Spec("int", lo=0),
    "onset_tolerance": _Spec("int", lo=0),
}
CONFIG_KEYS = ("model", "prompts", "sampling", "engine", "env", "tolerances", "min_effect", "tags")
MIN_EFFECT_KEYS = ("kl", "loss")  # min_effect = { kl = mean KL per step, loss = mean loss per step } (nats)
# Tolerance names that are the minimum effect of interest, spelled `min_effect = { ... }` instead.
MIN_EFFECT_TOLERANCES = {"kl_resolution": "kl", "loss_resolution": "loss", "min_effect_kl": "kl",
                         "min_effect_loss": "loss"}
CASE_KEYS = ("inherits", "role", "references", "description", "expect") + CONFIG_KEYS
_TYPE_NAMES = {"int": "an integer", "number": "a number", "bool": "true or false", "str": "a string",
               "strlist": "a list of strings", "table": "a table"}


def _q(value: Any, limit: int = 60) -> str:
    """repr on one line, shortened: error messages stay one line whatever the input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _valid(options) -> str:
    return "valid: " + ", ".join(sorted(options))


def _check_value(key: str, value: Any, spec: _Spec) -> str | None:
    """The reason `value` is wrong for `spec`, or None."""
    kind = spec.kind
    if kind in ("int", "number"):
        is_int = isinstance(value, int) and not isinstance(value, bool)
        ok = is_int or (kind == "number" and isinstance(value, float) and not math.isnan(value))
        if not ok or (isinstance(value, float) and spec.finite and math.isinf(value)):
            what = _TYPE_NAMES[kind] if not spec.finite or kind == "int" else "a finite number"
            return f"{key} must be {what}, got {_q(value)}"
        checks = []
        if spec.lo is not None:
            checks.append((f">= {spec.lo:g}", value >= spec.lo))
        if spec.above is not None:
            checks.append((f"> {spec.above:g}", value > spec.above))
        if spec.hi is not None:
            checks.append((f"<= {spec.hi:g}", value <= spec.hi))
        if not all(ok for _, ok in checks):
            return f"{key} must be {' and '.join(text for text, _ in checks)}, got {_q(value)}"
        return None
    if kind == "bool":
        return None if isinstance(value, bool) else f"{key} must be true or false, got {_q(value)}"
    if kind == "str":
        return None if isinstance(value, str) and value else f"{key} must be a non-empty string, got {_q(value)}"
    if kind == "enum":
        if isinstance(value, str) and value in spec.choices:
            return None
        return f"{key} must be one of {', '.join(spec.choices)}; got {_q(value)}"
    if kind == "strlist":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return f"{key} must be a list of strings, got {_q(value)}"
        bad = [v for v in value if spec.choices and v not in spec.choices]
        return f"{key} has {_q(bad[0])} ({_valid(spec.choices)})" if bad else None
    if kind == "table":
        return None if isinstance(value, dict) else f"{key} must be a table, got {_q(value)}"
    raise AssertionError(kind)


def check_min_effect(value: Any) -> str | None:
    """The reason `value` is not a valid ``min_effect`` table, or None."""
    if not isinstance(value, dict):
        return (f"min_effect must be a table like {{ kl = 1e-3, loss = 0.02 }} (mean KL and mean loss per "
                f"step, nats), got {_q(value)}")
    for k, v in value.items():
        if k not in MIN_EFFECT_KEYS:
            return f"unknown key {_q(f'min_effect.{k}')} ({_valid(MIN_EFFECT_KEYS)})"
        reason = _check_value(f"min_effect.{k}", v, _Spec("number", lo=0))
        if reason:
            return reason + " (nats per step)"
    return None


def _plain(value: Any) -> bool:
    """True for what JSON can hold: engine.extra must go into the config digest."""
    if isinstance(value, dict):
        return all(_plain(v) for v in value.values())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    if isinstance(value, float):
        return not math.isnan(value)
    return isinstance(value, (str, int, bool))


# Every character str.splitlines() breaks on, escaped: user text inside an
# error (a path, a key) must not break the one-line contract.
_LINE_BREAKS = {ord(c): repr(c)[1:-1] for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}


class _Errors:
    """Formats one-line errors with the file and the case they are about."""

    def __init__(self, path: Path):
        self.path = path

    def __call__(self, where: str | None, message: str) -> ConfigError:
        head = display_path(self.path) + (f": {where}" if where else "")
        return ConfigError(f"{head}: {message}".translate(_LINE_BREAKS))


def display_path(path: Path) -> str:
    """`path` relative to the working directory when it is below it, else as given."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except (OSError, ValueError):
        return str(path)


def _check_table(raw: Any, key: str, spec: dict[str, _Spec], err, where) -> None:
    if not isinstance(raw, dict):
        raise err(where, f"{key} must be a table, got {_q(raw)}")
    for k, v in raw.items():
        if k not in spec:
            raise err(where, f"unknown key {_q(f'{key}.{k}')} ({_valid(spec)})")
        if v == RESET and key in ("sampling", "engine"):
            continue
        reason = _check_value(f"{key}.{k}", v, spec[k])
        if reason:
            raise err(where, reason)
    if key == "engine":
        for name, check in (("base_url", registry.check_base_url), ("api_key_env", registry.check_env_name)):
            if isinstance(raw.get(name), str) and raw[name] != RESET:
                reason = check(raw[name])
                if reason:
                    raise err(where, reason)
        extra = raw.get("extra", {})
        if isinstance(extra, dict):
            for k, v in extra.items():
                if k in spec:
                    raise err(where, f"engine.extra.{k} duplicates engine.{k}; set it there")
                if not _plain(v):
                    raise err(where, f"engine.extra.{_q(k)} must be a string, number, boolean, list or table, "
                                     f"got {_q(v)}")


def _check_layer(raw: Any, allowed: tuple[str, ...], err, where: str) -> None:
    """Validate one table as written (defaults or one case), before any merging."""
    if not isinstance(raw, dict):
        raise err(where, f"must be a table, got {_q(raw)}")
    for key, value in raw.items():
        if key not in allowed:
            raise err(where, f"unknown key {_q(key)} ({_valid(allowed)})")
        if key in ("sampling", "engine", "expect"):
            _check_table(value, key, {"sampling": SAMPLING_SPEC, "engine": ENGINE_SPEC, "expect": EXPECT_SPEC}[key], err, where)
        elif key in ("model", "prompts", "inherits"):
            if not isinstance(value, str) or not value:
                raise err(where, f"{key} must be a non-empty string, got {_q(value)}")
        elif key == "description":
            if not isinstance(value, str):
                raise err(where, f"description must be a string, got {_q(value)}")
        elif key == "role":
            if value not in ROLES:
                raise err(where, f"role must be one of {', '.join(ROLES)}; got {_q(value)}")
        elif key in ("references", "tags"):
            reason = _check_value(key, value, _Spec("strlist"))
            if reason:
                raise err(where, reason)
        elif key == "env":
            if not isinstance(value, dict):
                raise err(where, f"env must be a table of strings, got {_q(value)}")
            for k, v in value.items():
                if not _ENV_NAME.match(k):
                    raise err(where, f"env name {_q(k)} must match [A-Za-z_][A-Za-z0-9_]*")
                if not isinstance(v, str):
                    raise err(where, f"env.{k} must be a string (quote it), got {_q(v)}")
        elif key == "min_effect":
            reason = check_min_effect(value)
            if reason:
                raise err(where, reason)
        elif key == "tolerances":
            if not isinstance(value, dict):
                raise err(where, f"tolerances must be a table of numbers, got {_q(value)}")
            for k, v in value.items():
                if not _ENV_NAME.match(k):
                    raise err(where, f"tolerance name {_q(k)} must match [A-Za-z_][A-Za-z0-9_]*")
                if k in MIN_EFFECT_TOLERANCES:
                    raise err(where, f"tolerances.{k} is the minimum effect of interest: set min_effect = "
                                     f"{{ {MIN_EFFECT_TOLERANCES[k]} = ... }} instead")
                reason = _check_value(f"tolerances.{k}", v, _Spec("number", finite=False))
                if reason:
                    raise err(where, reason)


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a name too long or otherwise impossible is just absent
        return False


def _read_toml(path: Path) -> dict:
    err = _Errors(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise err(None, "file does not exist") from None
    except (OSError, ValueError) as exc:
        raise err(None, f"cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise err(None, f"not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise err(None, f"invalid TOML: {exc}") from None


def _digest(value: Any) -> str:
    import blake3

    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return blake3.blake3(text.encode("utf-8")).hexdigest()


def not_by_default(case) -> tuple[str, ...]:
    """The tags that keep `case` out of a command unless it is named (`NOT_BY_DEFAULT`); () if none."""
    return tuple(t for t in NOT_BY_DEFAULT if t in case.tags)
