"""Fault injection inside real vLLM, for diffcheck's self-tests.

Each fault is a small patch of one real vLLM code path that reproduces a real bug
class from a chosen decode step on (see `spec` for the environment contract and the
exact meaning of "decode step", and docs/faults.md for the table). A fault is
selected by DIFFCHECK_FAULT in a case's ``env``; vLLM runs `register()` in every
one of its processes (API/driver, engine core, workers) through the
``vllm.general_plugins`` entry point ``diffcheck`` (``diffcheck.plugins:register``, which calls this).

Contract:

- Without DIFFCHECK_FAULT, `register()` returns at once: no patch and no import of
  vLLM internals, so production runs are untouched.
- An unknown fault or a bad option is a one-line `ConfigError`: when a suite loads
  (``diffcheck.cases`` checks each case's env with `spec.parse_env`, so ``diffcheck
  cases check`` refuses a typo), from `validate_env` (which the engine calls before
  building ``vllm.LLM``) and from `register()` itself (so a bad name can never be
  silently ignored inside the engine). A fault option a fault module reads must be in
  `spec.ENV_OPTIONS` and its fault's ``options``, or every suite using it is refused.
- `register()` is idempotent per process: patches are applied once.
- In each process that patches, the fault logs "diffcheck fault <name> active from
  decode step N in pid P" and appends a "patched" line to DIFFCHECK_FAULT_MARKER; the
  process that runs the model appends an "acting" line the first time it acts.

This package knows nothing about cases, runs or verdicts.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping

from diffcheck.cases.faults import CATALOGUE, FAULTS, FaultSpec, describe, names_for_lane, parse_env, valid_names

__all__ = [
    "FAULTS", "CATALOGUE", "FaultSpec", "describe", "names_for_lane", "register", "validate_env", "valid_names",
    "active_spec",
]


def validate_env(env: Mapping[str, str]) -> None:
    """Raise ConfigError (one line) if `env` selects an unknown fault or a bad option.

    Only the DIFFCHECK_FAULT* keys are read; an env without DIFFCHECK_FAULT (and
    without fault options) is valid and means "no fault".
    """
    parse_env(env)


def active_spec() -> FaultSpec | None:
    """The fault patched into this process, if any."""
    from diffcheck.faults import runtime  # light: it imports vLLM only when installing a patch

    return runtime.STATE.spec


def register() -> None:
    """vLLM general-plugin entry point: patch the selected fault into this process."""
    spec = parse_env(os.environ)
    if spec is None:
        return
    from diffcheck.faults import runtime

    state = runtime.STATE
    if state.spec is not None:
        if state.spec != spec:
            # Patches close over their spec; a second, different fault in one process
            # would leave the first one half in place.
            from diffcheck.core.errors import ConfigError

            other = spec.label if spec.label != state.spec.label else f"{spec.label} with other options"
            raise ConfigError(
                f"fault {state.spec.label!r} is already patched into pid {os.getpid()}; "
                f"cannot switch to {other!r} in the same process"
            )
        return
    if spec.info.takes_step:  # a fault that acts from capture on needs no step count
        runtime.install_clock(spec)
    module = importlib.import_module(f"diffcheck.faults.{spec.info.module}")
    module.install(spec)
    state.installed.add(spec.name)
    state.spec = spec
    runtime.announce(spec)
