"""diffcheck's vLLM general plugin: the faults, then plugin modules named in the environment.

vLLM calls `register()` in every process it starts (API process, engine core,
workers) through the ``vllm.general_plugins`` entry point. In an engine process
diffcheck started, it first makes that process end with its parent
(`diffcheck.core.lifeline`). It then registers
diffcheck's own faults (a no-op unless ``DIFFCHECK_FAULT`` is set), then imports
every module named in ``DIFFCHECK_PLUGIN_MODULES="mod1,mod2"`` and calls its
``register()``, in order, once per process.

Why: a plugin or package repository can then be tested (and bisected) from a
plain checkout on PYTHONPATH, with no reinstall at each commit. A case turns it
on with ``env = { DIFFCHECK_PLUGIN_MODULES = "toyplugin" }``.

A module that cannot be imported, or has no callable ``register``, raises: a
plugin silently skipped would make a broken commit look clean. Knows nothing
about vLLM itself.
"""

from __future__ import annotations

import importlib
import os

ENV_MODULES = "DIFFCHECK_PLUGIN_MODULES"

_registered: set[str] = set()  # modules whose register() already ran in this process


class PluginError(ImportError):
    """A module named in DIFFCHECK_PLUGIN_MODULES is missing or has no register()."""


def module_names(value: str | None = None) -> list[str]:
    """The module names in ``DIFFCHECK_PLUGIN_MODULES`` (or `value`), in order, blanks dropped."""
    raw = os.environ.get(ENV_MODULES, "") if value is None else value
    return [name.strip() for name in raw.split(",") if name.strip()]


def register() -> None:
    """Entry point of group ``vllm.general_plugins``."""
    from diffcheck import faults
    from diffcheck.core import lifeline

    lifeline.bind_to_parent()  # an engine process diffcheck started ends with its parent
    faults.register()
    for name in module_names():
        if name in _registered:
            continue
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            where = os.environ.get("PYTHONPATH") or "(unset)"
            raise PluginError(f"{ENV_MODULES}: cannot import {name!r}: {type(exc).__name__}: {exc} "
                              f"(PYTHONPATH={where})") from exc
        hook = getattr(module, "register", None)
        if not callable(hook):
            raise PluginError(f"{ENV_MODULES}: module {name!r} ({getattr(module, '__file__', '?')}) "
                              "has no callable register()")
        hook()
        _registered.add(name)
