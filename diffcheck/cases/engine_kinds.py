"""Engine kinds as a case names them: the valid kinds and the static rules on their keys.

Pure specification: it imports no engine (`diffcheck.engines.registry` maps a kind to its
class and imports the module on first use), so a suite that loads checks ``engine.kind``
and the keys a kind takes before any engine exists.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

# kind -> the module whose @register_engine(kind) class serves it. Add a kind here and in that module.
ENGINE_MODULES = {
    "vllm": "diffcheck.engines.vllm_offline",
    "openai": "diffcheck.engines.openai_server",
    "hf": "diffcheck.engines.hf",
}
KINDS = tuple(ENGINE_MODULES)

# Keys only some kinds take (the others would silently ignore them).
_ONLY_FOR = {"base_url": ("openai",), "served_model_name": ("openai",), "api_key_env": ("openai",)}
# Keys a kind cannot honour, with the values that mean "as the kind always runs" (None: unset).
_HF_FIXED = {
    "kv_cache_dtype": (None, "auto"), "quantization": (None,), "tensor_parallel_size": (None, 1),
    "enforce_eager": (None, True), "compile_mode": (None, 0), "cudagraph_mode": (None, "NONE"),
    "attention_backend": (None,),
}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def unknown_kind(kind: Any) -> str:
    return f"engine.kind {kind!r} is not a known engine (valid: {', '.join(sorted(KINDS))})"


def check_config(engine: dict[str, Any], env: dict[str, str]) -> str | None:
    """Why a merged engine table (and env) cannot work with its kind, or None. No engine is imported."""
    kind = engine.get("kind") or "vllm"
    if kind not in ENGINE_MODULES:
        return unknown_kind(kind)
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
