"""The engine registry: ``engine.kind`` in a case names an engine.

In the style of lm-evaluation-harness's ``@register_model``: an engine module
decorates its class with ``@register_engine(kind, capabilities=...)``, and
`engine_class(kind)` imports the module that kind names and returns the class it
registered. The kinds themselves are a static name -> module map
(`ENGINE_MODULES`, in `diffcheck.cases.engine_kinds` with the static rules on which
engine keys a kind takes), so the case schema knows the valid kinds, and refuses a typo
when a suite loads, without importing any engine.

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
from typing import Any

from diffcheck.cases.engine_kinds import (  # noqa: F401 (re-exported: the kinds and their static rules)
    ENGINE_MODULES, KINDS, check_base_url, check_config, check_env_name, unknown_kind)

CAPABILITIES = ("generate", "topk_logprobs", "forced_replay", "prompt_scoring", "replicas")
LABELS = {"generate": "generation", "topk_logprobs": "top-k logprobs", "forced_replay": "forced replay",
          "prompt_scoring": "scoring", "replicas": "noise-floor replicas"}

_REGISTRY: dict[str, type] = {}


def register_engine(kind: str, *, capabilities: tuple[str, ...], description: str = ""):
    """Class decorator: `kind` names this engine class in cases (``engine.kind``)."""
    unknown = [c for c in capabilities if c not in CAPABILITIES]
    if unknown:
        raise ValueError(f"engine {kind!r}: unknown capability {unknown[0]!r} (valid: {', '.join(CAPABILITIES)})")
    if ("replicas" in capabilities) != ("forced_replay" in capabilities):
        raise ValueError(f"engine {kind!r}: a noise-floor replica is a forced replay; declare both or neither")

    def decorate(cls):
        if kind not in ENGINE_MODULES:
            raise ValueError(f"engine kind {kind!r} is not in diffcheck.cases.engine_kinds.ENGINE_MODULES (add it there)")
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


def engine_class(kind: str) -> type:
    """The class registered for `kind`, importing its module on first use."""
    from diffcheck.core.errors import ConfigError

    if kind not in ENGINE_MODULES:
        raise ConfigError(unknown_kind(kind))
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
