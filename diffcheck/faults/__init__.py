"""Fault injection inside real vLLM, for diffcheck's self-tests.

Each fault is a small patch of one real vLLM code path that reproduces a real bug
class from a chosen decode step on (see `spec` for the environment contract and the
exact meaning of "decode step", and docs/faults.md for the table). A fault is
selected by DIFFCHECK_FAULT in a case's ``env``; vLLM runs `register()` in every
one of its processes (API/driver, engine core, workers) through the
``vllm.general_plugins`` entry point ``diffcheck`` (``diffcheck.plugins:register``, which calls this).

Contract:

- Without DIFFCHECK_FAULT, `register()` returns at once: no patch and no import of
  vLLM internals, so production runs are untouched. diffcheck's own self-test engines may
  set DIFFCHECK_SWITCHABLE_FAULTS=1 instead: every CPU-lane fault is patched in, each running
  vLLM's code path unchanged until `switch()` makes it the active one (one engine serves the
  fault cases of one configuration; `diffcheck.engines.session.EngineSession`).
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

from diffcheck.cases.faults import (CATALOGUE, ENV_SWITCHABLE, FAULTS, FaultSpec, describe, names_for_lane, parse_env,
                                    valid_names)

__all__ = [
    "FAULTS", "CATALOGUE", "FaultSpec", "describe", "names_for_lane", "register", "validate_env", "valid_names",
    "active_spec", "switch",
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
    """vLLM general-plugin entry point: patch the selected fault into this process.

    With ``DIFFCHECK_SWITCHABLE_FAULTS=1`` every CPU-lane fault is patched in (each runs vLLM's own
    code path unchanged until it is the active one) and the selected one, if any, is made active;
    `switch` changes it later.
    """
    spec = parse_env(os.environ)
    switchable = os.environ.get(ENV_SWITCHABLE, "").strip() == "1"
    if spec is None and not switchable:
        return
    from diffcheck.faults import runtime

    state = runtime.STATE
    if state.switchable or state.spec is not None:
        if not state.switchable and state.spec != spec:
            # Patches installed for one fault only; a second, different one would need its own.
            from diffcheck.core.errors import ConfigError

            other = spec.label if spec.label != state.spec.label else f"{spec.label} with other options"
            raise ConfigError(
                f"fault {state.spec.label!r} is already patched into pid {os.getpid()}; "
                f"cannot switch to {other!r} in the same process"
            )
        return
    if switchable and spec is not None and spec.info.lane != "cpu":
        from diffcheck.core.errors import ConfigError

        raise ConfigError(f"fault {spec.label!r} cannot be switched in at runtime (lane {spec.info.lane}): "
                          f"start its engine without {ENV_SWITCHABLE}")
    infos = [info for info in CATALOGUE if info.lane == "cpu"] if switchable else [spec.info]
    if any(info.takes_step for info in infos):  # a fault that acts from capture on needs no step count
        runtime.install_clock(spec.label if spec is not None else "switchable faults")
    for info in infos:
        importlib.import_module(f"diffcheck.faults.{info.module}").install()
        state.installed.add(info.name)
    state.switchable = switchable
    runtime.activate(spec)


def switch(env: Mapping[str, str]) -> str | None:
    """Make the fault `env` selects this process's active fault (None: none), in a process that
    `register` set up with ``DIFFCHECK_SWITCHABLE_FAULTS=1``; its label, or None. A bad env, a
    fault outside the CPU lane, or a process without every fault patched in is a one-line ConfigError."""
    from diffcheck.core.errors import ConfigError
    from diffcheck.faults import runtime

    spec = parse_env(env)
    if not runtime.STATE.switchable:
        raise ConfigError(f"pid {os.getpid()} was not started with {ENV_SWITCHABLE}=1: its fault cannot be switched")
    if spec is not None and spec.info.lane != "cpu":
        raise ConfigError(f"fault {spec.label!r} cannot be switched in at runtime (lane {spec.info.lane}; valid: "
                          f"{', '.join(names_for_lane('cpu'))})")
    runtime.activate(spec)
    return spec.label if spec is not None else None
