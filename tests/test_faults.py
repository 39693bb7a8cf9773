"""diffcheck.faults without an engine: the env contract, the no-fault path, the step clock, the docs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diffcheck.core.errors import ConfigError
from diffcheck.faults import FAULTS, describe, names_for_lane, register, valid_names, validate_env
from diffcheck.faults import runtime
from diffcheck.cases.faults import DEFAULT_STEP, ENV_OPTIONS, ENV_SEED, MAX_FAULT_SEED, parse_env

REPO = Path(__file__).resolve().parents[1]


def _one_line_config_error(env: dict) -> str:
    with pytest.raises(ConfigError) as info:
        validate_env(env)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- validate_env ------------------------------------------------------------------------


@pytest.mark.parametrize("name", valid_names())
def test_validate_env_accepts_every_fault_and_fixed_variant(name):
    spec = parse_env({"DIFFCHECK_FAULT": name})
    validate_env({"DIFFCHECK_FAULT": name, **({"DIFFCHECK_FAULT_STEP": "4"} if spec.info.takes_step else {})})
    assert spec.label == name
    assert spec.fixed == name.endswith(":fixed")
    assert spec.step == DEFAULT_STEP


def test_every_fault_has_a_fixed_variant():
    assert len(FAULTS) >= 3
    for name in FAULTS:
        buggy, fixed = parse_env({"DIFFCHECK_FAULT": name}), parse_env({"DIFFCHECK_FAULT": f"{name}:fixed"})
        assert (buggy.fixed, fixed.fixed) == (False, True) and buggy.info == fixed.info, name
        assert {name, f"{name}:fixed"} <= set(valid_names())


def test_lanes_split_the_catalogue():
    cpu, cuda = set(names_for_lane("cpu")), set(names_for_lane("cuda"))
    assert cpu | cuda == set(FAULTS) and not cpu & cuda
    assert {"stale-decode-metadata", "kv-write-corruption", "rope-offset", "lost-head"} <= cpu
    assert "seq-lens-copy" in cuda


def test_no_fault_is_valid_and_means_none():
    validate_env({})
    validate_env({"PATH": "/bin", "DIFFCHECK_FAULT": ""})
    assert parse_env({"OTHER": "1"}) is None


def test_unknown_fault_is_a_one_line_error_listing_valid_names():
    message = _one_line_config_error({"DIFFCHECK_FAULT": "x"})
    assert message.startswith("unknown fault 'x' in DIFFCHECK_FAULT (valid: ")
    for name in valid_names():
        assert name in message


def test_unknown_fixed_suffix_is_rejected():
    message = _one_line_config_error({"DIFFCHECK_FAULT": "lost-head:fast"})
    assert "unknown fault 'lost-head:fast'" in message


@pytest.mark.parametrize(
    "env, fragment",
    [
        ({"DIFFCHECK_FAULT": "rope-offset", "DIFFCHECK_FAULT_STEP": "soon"}, "DIFFCHECK_FAULT_STEP='soon' is not an integer"),
        ({"DIFFCHECK_FAULT": "rope-offset", "DIFFCHECK_FAULT_STEP": "-1"}, "DIFFCHECK_FAULT_STEP=-1 must be >= 0"),
        ({"DIFFCHECK_FAULT": "lost-head", "DIFFCHECK_FAULT_HEAD": "-2"}, "DIFFCHECK_FAULT_HEAD=-2 must be >= 0"),
        ({"DIFFCHECK_FAULT": "kv-write-corruption", "DIFFCHECK_FAULT_LAYER": "first"}, "DIFFCHECK_FAULT_LAYER='first'"),
        ({"DIFFCHECK_FAULT": "rope-offset", "DIFFCHECK_FAULT_HEAD": "1"}, "DIFFCHECK_FAULT_HEAD does not apply to fault 'rope-offset'"),
        ({"DIFFCHECK_FAULT": "stale-decode-metadata", "DIFFCHECK_FAULT_LAYER": "3"}, "does not apply to fault 'stale-decode-metadata'"),
        ({"DIFFCHECK_FAULT": "rope-offset", "DIFFCHECK_FAULT_OFFSET": "0"}, "DIFFCHECK_FAULT_OFFSET=0 would make"),
        ({"DIFFCHECK_FAULT_STEP": "8"}, "DIFFCHECK_FAULT_STEP is set but DIFFCHECK_FAULT is not"),
        ({"DIFFCHECK_FAULT": "seq-lens-copy", "DIFFCHECK_FAULT_STEP": "3"}, "DIFFCHECK_FAULT_STEP does not apply to fault 'seq-lens-copy'"),
        ({"DIFFCHECK_FAULT": "lost-head", "DIFFCHECK_FAULT_LAYERS": "1"}, "unknown variable DIFFCHECK_FAULT_LAYERS"),
    ],
)
def test_bad_options_are_one_line_errors(env, fragment):
    assert fragment in _one_line_config_error(env)


def test_options_are_parsed_with_fault_defaults():
    spec = parse_env({"DIFFCHECK_FAULT": "lost-head", "DIFFCHECK_FAULT_STEP": "7", "DIFFCHECK_FAULT_LAYER": "all"})
    assert (spec.step, spec.layer, spec.head) == (7, None, 0)
    spec = parse_env({"DIFFCHECK_FAULT": "kv-write-corruption:fixed", "DIFFCHECK_FAULT_LAYER": "5"})
    assert (spec.fixed, spec.layer, spec.layer_matches(5), spec.layer_matches(4)) == (True, 5, True, False)
    assert parse_env({"DIFFCHECK_FAULT": "rope-offset", "DIFFCHECK_FAULT_OFFSET": "-3"}).offset == -3


# --- register() --------------------------------------------------------------------------


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFCHECK_FAULT")}
    return subprocess.run([sys.executable, "-c", code], env={**clean_env, **env}, capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def test_register_without_fault_imports_nothing_from_vllm():
    code = (
        "import sys, json, diffcheck.faults as f\n"
        "f.register(); f.register()\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'vllm' or m.startswith(('vllm.', 'torch', "
        "'diffcheck.faults.runtime')))))\n"
    )
    proc = _python(code, {})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_register_rejects_unknown_fault(monkeypatch):
    monkeypatch.setenv("DIFFCHECK_FAULT", "no-such-fault")
    with pytest.raises(ConfigError, match="unknown fault 'no-such-fault' in DIFFCHECK_FAULT"):
        register()


def test_register_is_idempotent_and_refuses_a_second_fault(tmp_path):
    """Patches go in once per process; the marker gets one 'patched' line from this pid."""
    marker = tmp_path / "marker.jsonl"
    code = (
        "import os, diffcheck.faults as f\n"
        "from diffcheck.core.errors import ConfigError\n"
        "f.register(); f.register()\n"
        "from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder as B\n"
        "from vllm.v1.worker.gpu_model_runner import GPUModelRunner as R\n"
        "assert not hasattr(B.build.__wrapped__, '__wrapped__'), 'build wrapped twice'\n"
        "assert not hasattr(R._build_attention_metadata.__wrapped__, '__wrapped__'), 'clock wrapped twice'\n"
        "os.environ['DIFFCHECK_FAULT'] = 'lost-head'\n"
        "try:\n"
        "    f.register()\n"
        "except ConfigError as e:\n"
        "    print('REFUSED', e)\n"
    )
    proc = _python(code, {"DIFFCHECK_FAULT": "stale-decode-metadata", "DIFFCHECK_FAULT_MARKER": str(marker)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REFUSED fault 'stale-decode-metadata' is already patched" in proc.stdout
    events = [json.loads(line) for line in marker.read_text().splitlines()]
    assert [e["event"] for e in events] == ["patched"]
    assert events[0]["fault"] == "stale-decode-metadata" and events[0]["step"] == DEFAULT_STEP
    assert "diffcheck fault stale-decode-metadata active from decode step 32 in pid" in proc.stdout + proc.stderr


# --- the decode-step clock ---------------------------------------------------------------


def test_clock_counts_decode_passes_since_the_last_prefill():
    clock = runtime.DecodeClock()
    seen = []
    for max_query_len in (1, 7, 1, 1, 1, 3, 1):  # a dummy decode, prefill, 3 decodes, mixed batch, decode
        clock.advance(max_query_len=max_query_len, for_capture=False)
        seen.append((clock.step, clock.epoch))
    assert seen == [(0, 0), (None, 1), (0, 1), (1, 1), (2, 1), (None, 2), (0, 2)]


def test_clock_ignores_graph_capture_builds():
    clock = runtime.DecodeClock()
    clock.advance(max_query_len=5, for_capture=False)
    clock.advance(max_query_len=1, for_capture=False)
    clock.advance(max_query_len=1, for_capture=True)
    assert clock.step is None and clock.decode_passes == 1 and clock.epoch == 1
    clock.advance(max_query_len=1, for_capture=False)
    assert clock.step == 1


def test_acting_starts_at_step_n_and_writes_one_acting_line(tmp_path, monkeypatch):
    marker = tmp_path / "logs" / "m.jsonl"  # a folder the marker makes
    spec = parse_env({"DIFFCHECK_FAULT": "rope-offset", "DIFFCHECK_FAULT_STEP": "2", "DIFFCHECK_FAULT_MARKER": str(marker)})
    monkeypatch.setattr(runtime, "STATE", runtime._State(spec=spec))
    # no vLLM group in this process (an in-process engine of this test session may have made one)
    monkeypatch.delitem(sys.modules, "vllm.distributed.parallel_state", raising=False)
    clock = runtime.STATE.clock
    flags = []
    for max_query_len in (9, 1, 1, 1, 1):
        clock.advance(max_query_len=max_query_len, for_capture=False)
        flags.append(runtime.acting(spec))
    assert flags == [False, False, False, True, True]
    events = [json.loads(line) for line in marker.read_text().splitlines()]
    assert [(e["event"], e["step"], e["pid"]) for e in events] == [("acting", 2, os.getpid())]
    assert (events[0]["tp_rank"], events[0]["tp_size"]) == (None, None)


def test_attn_noise_seed_unset_keeps_the_unseeded_stream_and_each_seed_draws_its_own():
    import torch

    from diffcheck.faults.attn_noise import generator_seed

    assert generator_seed(40, 3, None) == 1_000_003 * 40 + 3  # unset: today's noise exactly
    seeds = [generator_seed(40, 3, s) for s in (None, 0, 1, 2, MAX_FAULT_SEED)]
    assert len(set(seeds)) == 5 and all(0 <= s < 2**32 for s in seeds)  # torch reads 32 bits of a seed
    draws = {tuple(torch.randn(4, generator=torch.Generator().manual_seed(s)).tolist()) for s in seeds}
    assert len(draws) == 5


def test_fault_seed_is_an_attn_noise_option_parsed_into_the_spec():
    noise = {"DIFFCHECK_FAULT": "attn-noise"}
    assert ENV_SEED == "DIFFCHECK_FAULT_SEED" and ENV_SEED in ENV_OPTIONS
    assert ENV_SEED in parse_env(noise).info.options
    assert parse_env(noise).seed is None and parse_env({**noise, ENV_SEED: " "}).seed is None  # the unseeded stream
    assert parse_env({**noise, ENV_SEED: "7"}).seed == 7
    assert parse_env({**noise, ENV_SEED: "0"}).seed == 0
    assert parse_env({**noise, ENV_SEED: str(MAX_FAULT_SEED)}).seed == MAX_FAULT_SEED
    assert parse_env({"DIFFCHECK_FAULT": "attn-noise:fixed", ENV_SEED: "3"}).seed == 3
    validate_env({**noise, ENV_SEED: "7", "DIFFCHECK_FAULT_SCALE": "0.05", "DIFFCHECK_FAULT_STEP": "8"})
    # two specs that differ only in their seed are different faults (register() refuses to switch)
    assert parse_env({**noise, ENV_SEED: "1"}) != parse_env({**noise, ENV_SEED: "2"}) != parse_env(noise)
    assert parse_env({**noise, ENV_SEED: "1"}) == parse_env({**noise, ENV_SEED: "1"})
    for name in FAULTS:
        if name != "attn-noise":
            assert parse_env({"DIFFCHECK_FAULT": name}).seed is None


@pytest.mark.parametrize("bad", ["x", "-1", str(MAX_FAULT_SEED + 1), "1.5", "1e3"])
def test_fault_seed_refuses_non_integers_and_out_of_range_values_in_one_line(bad):
    message = _one_line_config_error({"DIFFCHECK_FAULT": "attn-noise", ENV_SEED: bad})
    assert message.startswith(f"{ENV_SEED}=") and f"0..{MAX_FAULT_SEED}" in message


@pytest.mark.parametrize("name", ["lost-head", "stale-decode-metadata", "seq-lens-copy"])
def test_fault_seed_does_not_apply_to_a_fault_that_takes_none(name):
    message = _one_line_config_error({"DIFFCHECK_FAULT": name, ENV_SEED: "1"})
    assert f"{ENV_SEED} does not apply to fault {name!r}" in message


def test_fault_seed_without_a_fault_is_refused():
    assert f"{ENV_SEED} is set but DIFFCHECK_FAULT is not" in _one_line_config_error({ENV_SEED: "1"})


@pytest.mark.parametrize(
    "name, index",
    [("model.layers.12.self_attn.attn", 12), ("model.layers.0.self_attn.attn", 0), ("lm_head", None), ("", None)],
)
def test_layer_index_from_vllm_layer_names(name, index):
    assert runtime.layer_index(name) == index


# --- docs --------------------------------------------------------------------------------


def test_describe_lists_every_fault_and_the_readme_carries_it():
    table = describe()
    for name in FAULTS:
        assert f"`{name}`" in table
    doc = (REPO / "docs" / "faults.md").read_text()
    assert table in doc, "docs/faults.md is out of date: paste diffcheck.faults.describe() into it"
