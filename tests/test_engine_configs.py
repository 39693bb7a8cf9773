"""Engine tables of the openai and hf kinds: refused at load when a kind cannot honour them, and what a
configuration cannot do, said in compare's output and the verdict summary. No engine starts here."""

from __future__ import annotations

import pytest

from factories import make_run, write_suite


def _load(tmp_path, engine: dict, env: dict | None = None):
    from diffcheck import cases

    case = {"role": "reference", "description": "r", "engine": engine}
    if env is not None:
        case["env"] = env
    return cases.load_suite(write_suite(tmp_path, {"J": case}))


BAD_ENGINES = {
    "key env without base_url": ({"kind": "openai", "api_key_env": "K"}, None, "engine.api_key_env needs engine.base_url"),
    "bad key env name": ({"kind": "openai", "base_url": "http://h:1", "api_key_env": "1K"}, None,
                         "must be an environment variable name"),
    "not http": ({"kind": "openai", "base_url": "ftp://h/x"}, None, "engine.base_url must be http(s)://"),
    "query": ({"kind": "openai", "base_url": "http://h:1/v1?x=1"}, None, "query or fragment"),
    "env for a running server": ({"kind": "openai", "base_url": "http://h:1"}, {"VLLM_X": "1"},
                                 "cannot reach a server at engine.base_url"),
    "hf fp8 kv": ({"kind": "hf", "kv_cache_dtype": "fp8"}, None, "engine.kv_cache_dtype = 'fp8' cannot apply"),
    "hf compiled": ({"kind": "hf", "enforce_eager": False}, None, "engine.enforce_eager = False cannot apply"),
    "hf fault": ({"kind": "hf"}, {"DIFFCHECK_FAULT": "kv-write-corruption"}, "faults patch vLLM code"),
}


@pytest.mark.parametrize("name", sorted(BAD_ENGINES))
def test_engine_tables_a_kind_cannot_honour_are_refused_at_load(tmp_path, name):
    from diffcheck.core.errors import ConfigError

    engine, env, message = BAD_ENGINES[name]
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, engine, env)
    assert message in info.value.message and "case 'J'" in info.value.message
    assert len(info.value.message.splitlines()) == 1


def test_what_a_configuration_cannot_do_is_said_per_case(tmp_path):
    from diffcheck.engines import registry

    started = _load(tmp_path / "a", {"kind": "openai"}).cases["J"]
    attached = _load(tmp_path / "b", {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"}).cases["J"]
    offline = _load(tmp_path / "c", {"kind": "vllm"}).cases["J"]
    hf = _load(tmp_path / "d", {"kind": "hf"}).cases["J"]
    assert registry.unavailable(started) == registry.unavailable(offline) == registry.unavailable(hf) == []
    assert registry.unavailable(attached) == ["forced replay: not available on engine openai (base_url)"]
    assert set(registry.missing(attached)) == {"forced_replay", "replicas"}
    assert registry.unavailable(attached, ("prompt_scoring",)) == []


def test_compare_states_a_missing_capability_in_its_echo_and_the_verdict_summary(tmp_path):
    """A base_url candidate has no forced replay: compare --run says so, and the summary's signals hold it."""
    from diffcheck import cases
    from diffcheck.workflows import compare as comparemod
    from diffcheck.storage import store

    suite = cases.load_suite(write_suite(tmp_path / "cases", {
        "J": {"role": "reference", "description": "r"},
        "W": {"inherits": "J", "role": "candidate", "references": ["J"],
              "engine": {"kind": "openai", "base_url": "http://127.0.0.1:9"}},
    }, name="t"))
    root = tmp_path / "goldens"
    golden = make_run(lengths=(12, 9), k=4, seed=1, case_id="J", suite="t")
    store.write_run(store.run_path(root, "t", "J"), golden)
    cand = make_run(lengths=(12, 9), k=4, seed=1, case_id="W", suite="t", role="candidate")
    run_file = store.run_path(root, "t", "W", kind="generate", role="candidate")
    store.write_run(run_file, cand)
    lines: list[str] = []
    result = comparemod.compare(suite, "W", root=root, run_file=run_file, echo=lines.append)
    said = [ln for ln in lines if "signals:" in ln]
    assert said and "forced replay: not available on engine openai (base_url)" in said[0]
    (verdict,) = result.verdicts
    assert verdict.summary["signals"]["unavailable"] == ["forced replay: not available on engine openai (base_url)"]
    assert verdict.summary["signals"]["forced"] is False
