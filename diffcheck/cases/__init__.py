"""The case language: `cases/<suite>.toml` -> validated, fully resolved `Case`s.

Knows the TOML schema of suites and prompt files, inheritance, ``${VAR}``
expansion, and what defines a run (`resolved_config`, `config_digest`,
`config_delta`). Knows nothing about engines: an `EngineConfig` is data; how a
field maps onto vLLM (``kv_cache_memory_gib`` -> ``VLLM_CPU_KVCACHE_SPACE`` on
CPU, ...) is the engine adapter's business.

Rules of the language (a suite with one bad case is refused whole; every error
is one `ConfigError` line naming the file, the case, the key and what is valid):

- ``[defaults]`` is the implicit base of every case; ``inherits = "ID"`` adds a
  parent. Tables merge recursively (the child's keys win), lists and scalars
  replace. ``expect`` and ``description`` are *not* inherited: they label one
  case, not a configuration (a fault case inheriting a clean case must not
  inherit "not GIBBERISH").
- TOML has no null: ``key = "default"`` in ``sampling``/``engine`` resets an
  inherited value to the engine's own default.
- ``model`` and ``prompts`` expand ``${VAR}`` and ``${VAR:-default}`` from the
  environment; ``prompts`` is relative to the suite file's folder.
- A candidate names its references; references must be cases of role
  ``reference`` with the same prompts (runs are compared prompt by prompt).
- ``env``'s DIFFCHECK_FAULT* keys are checked against the fault registry
  (`diffcheck.cases.faults`, no engine import) after inheritance: a misspelled
  fault or option refuses the suite, not the engine start.
"""

from diffcheck.cases.identity import config_delta, config_digest, resolved_config
from diffcheck.cases.loader import cases_dir, get_case, list_suites, load_suite, parse_suite
from diffcheck.cases.prompts import _read_prompts, load_prompts
from diffcheck.cases.schema import (CASE_KEYS, CONFIG_KEYS, CUDAGRAPH_MODES, DEFAULT_SUITE, DTYPES, ENGINE_KINDS,
                                    ENGINE_SPEC, EXPECT_SPEC, EXPECTABLE, KV_CACHE_DTYPES, NOT_BY_DEFAULT, RESET, SAMPLING_SPEC,
                                    Case, EngineConfig, Expect, Prompt, Sampling, Suite, display_path,
                                    not_by_default)

__all__ = [
    "CASE_KEYS", "CONFIG_KEYS", "CUDAGRAPH_MODES", "DEFAULT_SUITE", "DTYPES", "ENGINE_KINDS", "ENGINE_SPEC",
    "EXPECT_SPEC", "EXPECTABLE", "KV_CACHE_DTYPES", "NOT_BY_DEFAULT", "RESET", "SAMPLING_SPEC", "Case", "EngineConfig", "Expect",
    "Prompt", "Sampling", "Suite", "cases_dir", "config_delta", "config_digest", "display_path", "get_case",
    "list_suites", "load_prompts", "load_suite", "not_by_default", "parse_suite", "resolved_config", "_read_prompts",
]
