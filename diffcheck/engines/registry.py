"""The engine registry: ``engine.kind`` in a case names an engine.

In the style of lm-evaluation-harness's ``@register_model``: an engine module
decorates its class with ``@register_engine(kind, capabilities=...)``, and
`engine_class(kind)` imports the module that kind names and returns the class it
registered. The kinds themselves are a static name -> module map
(`ENGINE_MODULES`), so the case schema knows the valid kinds, and refuses a typo
when a suite loads, without importing any engine: this module imports nothing but
`diffcheck.core.errors`. The static rules on which engine keys a kind takes
(`check_config`) live here for the same reason.

Capabilities, what a comparison can ask of an engine (`CAPABILITIES`):

- ``generate``: sample the case's prompts;
- ``topk_logprobs``: the top-k logprobs at every generated step;
- ``forced_replay``: teacher-force a reference run through the decode path;
- ``prompt_scoring``: another run's tokens scored through prompt logprobs (prefill);
- ``replicas``: noise-floor replicas (`diffcheck calibrate`); a replica is a forced
  replay, so an engine has it exactly when it has ``forced_replay``.

A class declares what it can do in general; `Engine.unavailable(engine_cfg)` says
what it cannot do for one configuration and why (an ``openai`` engine at a
``base_url`` cannot load diffcheck's forcing processor into a server it did not
start). `unavailable(case)` turns that into the lines ``compare`` prints.
"""

from __future__ import annotations

import importlib
import re
from typing import Any
from urllib.parse import urlsplit

CAPABILITIES = ("generate", "topk_logprobs", "forced_replay", "prompt_scoring", "replicas")
LABELS = {"generate": "generation", "topk_logprobs": "top-k logprobs", "forced_replay": "forced replay",
          "prompt_scoring": "scoring", "replicas": "noise-floor replicas"}

# kind -> the module whose @register_engine(kind) class serves it. Add a kind here and in that module.
ENGINE_MODULES = {
    "vllm": "diffcheck.engines.vllm_offline",
    "openai": "diffcheck.engines.openai_server",
    "hf": "diffcheck.engines.hf",
}
KINDS = tuple(ENGINE_MODULES)

_REGISTRY: dict[str, type] = {}

# Keys only some kinds take (the others would silently ignore them).
_ONLY_FOR = {"base_url": ("openai",), "served_model_name": ("openai",), "api_key_env": ("openai",)}
# Keys a kind cannot honour, with the values that mean "as the kind always runs" (None: unset).
_HF_FIXED = {
    "kv_cache_dtype": (None, "auto"), "quantization": (None,), "tensor_parallel_size": (None, 1),
    "enforce_eager": (None, True), "compile_mode": (None, 0), "cudagraph_mode": (None, "NONE"),
    "attention_backend": (None,),
}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def register_engine(kind: str, *, capabilities: tuple[str, ...], description: str = ""):
    """Class decorator: `kind` names this engine class in cases (``engine.kind``)."""
    unknown = [c for c in capabilities if c not in CAPABILITIES]
    if unknown:
        raise ValueError(f"engine {kind!r}: unknown capability {unknown[0]!r} (valid: {', '.join(CAPABILITIES)})")
    if ("replicas" in capabilities) != ("forced_replay" in capabilities):
        raise ValueError(f"engine {kind!r}: a noise-floor replica is a forced replay; declare both or neither")

    def decorate(cls):
        if kind not in ENGINE_MODULES:
            raise ValueError(f"engine kind {kind!r} is not in registry.ENGINE_MODULES (add it there)")
        if ENGINE_MODULES[kind] != cls.__module__:
            raise ValueError(f"engine kind {kind!r} belongs to {ENGINE_MODULES[kind]}, not {cls.__module__}")
        other = _REGISTRY.get(kind)
        if other is not None and other.__qualname__ != cls.__qualname__:
            raise ValueError(f"engine kind {kind!r} is already registered by {other.__qualname__}")
        cls.kind = kind
        cls.capabilities = frozenset(capabilities)
        cls.description = description
        _REGISTRY[kind] = cls
        return cls

    return decorate


def _unknown(kind: Any) -> str:
    return f"engine.kind {kind!r} is not a known engine (valid: {', '.join(sorted(KINDS))})"


def engine_class(kind: str) -> type:
    """The class registered for `kind`, importing its module on first use."""
    from diffcheck.core.errors import ConfigError

    if kind not in ENGINE_MODULES:
        raise ConfigError(_unknown(kind))
    if kind not in _REGISTRY:
        importlib.import_module(ENGINE_MODULES[kind])
    if kind not in _REGISTRY:  # a module that forgot its decorator: a bug, not a user error
        raise RuntimeError(f"{ENGINE_MODULES[kind]} registers no engine for kind {kind!r}")
    return _REGISTRY[kind]


def missing(case) -> dict[str, str]:
    """{capability: why} for what the engine of `case` cannot do (empty: it can do everything)."""
    import dataclasses

    cfg = dataclasses.asdict(case.engine)
    cls = engine_class(cfg.get("kind") or "vllm")
    return cls.unavailable(cfg)


def unavailable(case, capabilities: tuple[str, ...] = CAPABILITIES) -> list[str]:
    """One line per missing capability: ``forced replay: not available on engine openai (base_url)``."""
    kind = case.engine.kind or "vllm"
    lines = []
    for cap, why in missing(case).items():
        if cap in capabilities and cap != "replicas":  # replicas follow forced replay: said once
            lines.append(f"{LABELS[cap]}: not available on engine {kind}" + (f" ({why})" if why else ""))
    return lines


def check_config(engine: dict[str, Any], env: dict[str, str]) -> str | None:
    """Why a merged engine table (and env) cannot work with its kind, or None. No engine is imported."""
    kind = engine.get("kind") or "vllm"
    if kind not in ENGINE_MODULES:
        return _unknown(kind)
    for key, kinds in _ONLY_FOR.items():
        if engine.get(key) is not None and kind not in kinds:
            return f"engine.{key} applies to engine.kind {' or '.join(kinds)}, not {kind!r}"
    if kind == "openai":
        if engine.get("api_key_env") is not None and engine.get("base_url") is None:
            return ("engine.api_key_env needs engine.base_url (a server diffcheck starts gets a fresh random "
                    "key of its own)")
        if engine.get("base_url") is not None and env:
            return (f"env ({', '.join(sorted(env))}) cannot reach a server at engine.base_url that is already "
                    "running; start it with that environment, or drop base_url so diffcheck starts it")
    if kind == "hf":
        for key, fine in _HF_FIXED.items():
            value = engine.get(key)
            if value not in fine:
                return (f"engine.{key} = {value!r} cannot apply to engine.kind 'hf' (transformers, eager, no "
                        f"quantization; reset it with \"default\")")
        faults = sorted(k for k in env if k.startswith("DIFFCHECK_FAULT"))
        if faults:
            return f"env {faults[0]}: faults patch vLLM code, and engine.kind 'hf' runs no vLLM"
    return None


def check_base_url(value: str) -> str | None:
    """Why `value` is not a usable ``engine.base_url``, or None."""
    # The value is never echoed: a mistyped URL may carry a credential.
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError:
        return "engine.base_url is not a valid URL (http(s)://HOST[:PORT][/PATH])"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "engine.base_url must be http(s)://HOST[:PORT][/PATH]"
    if parts.username is not None or parts.password is not None:
        return "engine.base_url must not hold credentials; name an environment variable in engine.api_key_env"
    if parts.query or parts.fragment:
        return "engine.base_url must not have a query or fragment"
    return None


def check_env_name(value: str) -> str | None:
    if not _ENV_NAME.match(value):
        return f"engine.api_key_env must be an environment variable name ([A-Za-z_][A-Za-z0-9_]*), got {value!r}"
    return None
