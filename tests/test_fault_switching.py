"""Switching faults at runtime, without an engine: which cases share a kept engine, and what a
switch does to a process's fault state. The engine side (a switched fault gives the tokens of
an engine of its own; switched back to clean, the clean engine's) is tests/test_faults_engine.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from diffcheck import cases, faults
from diffcheck.cases.faults import ENV_SWITCHABLE, parse_env, without_faults
from diffcheck.core.errors import ConfigError
from diffcheck.engines import session as sessionmod
from diffcheck.faults import runtime
from diffcheck.workflows import selftest as st

from factories import write_suite

CASES = {
    "J": {"role": "reference", "description": "eager reference"},
    "E": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "stale metadata",
          "env": {"DIFFCHECK_FAULT": "stale-decode-metadata", "DIFFCHECK_FAULT_STEP": "8"},
          "expect": {"verdict": "GIBBERISH"}},
    "C": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "compiled, stale metadata",
          "engine": {"enforce_eager": False},
          "env": {"DIFFCHECK_FAULT": "stale-decode-metadata", "DIFFCHECK_FAULT_STEP": "8"},
          "expect": {"verdict": "GIBBERISH"}},
    "S": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "one sequence at a time",
          "engine": {"max_num_seqs": 1}, "expect": {"not_verdict": ["GIBBERISH"]}},
    "K": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "kv write",
          "env": {"DIFFCHECK_FAULT": "kv-write-corruption", "DIFFCHECK_FAULT_STEP": "8"},
          "expect": {"verdict": "GIBBERISH"}},
    "M": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "lost head, other env too",
          "env": {"DIFFCHECK_FAULT": "lost-head", "VLLM_CPU_SGL_KERNEL": "0"},
          "expect": {"verdict": "DEGRADED"}},
}


@pytest.fixture
def suite(tmp_path):
    return cases.load_suite(write_suite(tmp_path, CASES, name="sw", description="fault switching",
                                        prompts=[{"id": "a", "text": "Hello"}],
                                        engine={"dtype": "float32", "enforce_eager": True}))


def test_only_eager_vllm_cases_with_a_cpu_fault_switch(suite):
    switchable = {cid for cid, case in suite.cases.items() if sessionmod.fault_switchable(case)}
    assert switchable == {"E", "K", "M"}  # J and S have no fault; C is compiled
    gpu = dataclasses.replace(suite.cases["E"], env={"DIFFCHECK_FAULT": "seq-lens-copy"})
    assert not sessionmod.fault_switchable(gpu)


def test_switched_cases_share_a_key_only_when_nothing_but_the_fault_differs(suite):
    key = {cid: sessionmod.config_key(c, faults_switched=True) for cid, c in suite.cases.items()}
    assert key["E"] == key["K"] == key["J"]
    assert key["M"] != key["E"]  # another env variable besides its fault
    assert sessionmod.config_key(suite.cases["E"]) != sessionmod.config_key(suite.cases["K"])
    assert without_faults({"DIFFCHECK_FAULT": "x", "DIFFCHECK_FAULT_STEP": "3", "OTHER": "1"}) == {"OTHER": "1"}


class _Recorder:
    """Stands in for an engine: what it was opened with, and the faults switched into it."""

    def __init__(self, case, **_):
        self.opened_env = dict(case.env)
        self.switched: list[dict] = []
        self.closed = False

    def switch_fault(self, env):
        self.switched.append(dict(env))

    def close(self):
        self.closed = True


def test_rebound_switches_faults_in_one_engine_and_never_hands_it_to_a_clean_case(suite, monkeypatch):
    monkeypatch.setattr(sessionmod, "open_engine", _Recorder)
    pool = sessionmod.EngineSession(switch_faults=True)
    e = pool.rebound(suite.cases["E"], echo=lambda _: None)
    assert e.opened_env[ENV_SWITCHABLE] == "1" and e.opened_env["DIFFCHECK_FAULT"] == "stale-decode-metadata"
    assert not pool.kept and e.env == suite.cases["E"].env  # the run records the case's env, not the switch
    k = pool.rebound(suite.cases["K"], echo=lambda _: None)
    assert k is e and pool.kept and e.switched == [suite.cases["K"].env]
    clean = pool.rebound(suite.cases["J"], echo=lambda _: None)  # same configuration, no fault
    assert clean is not e and e.closed and ENV_SWITCHABLE not in clean.opened_env
    plain = sessionmod.EngineSession()  # without switch_faults every fault is an engine of its own
    first = plain.rebound(suite.cases["E"], echo=lambda _: None)
    second = plain.rebound(suite.cases["K"], echo=lambda _: None)
    assert second is not first and ENV_SWITCHABLE not in first.opened_env


def test_selftest_runs_cases_of_one_kept_engine_together_and_reports_in_file_order(suite):
    chosen = st.labelled_cases(suite)
    assert [c.id for c in chosen] == ["E", "C", "S", "K", "M"]
    assert [c.id for c in st.in_engine_order(chosen)] == ["E", "K", "C", "S", "M"]


@pytest.fixture
def fresh_state(monkeypatch):
    monkeypatch.setattr(runtime, "STATE", runtime._State())
    return runtime.STATE


def test_activate_restarts_the_decode_clock_and_marks_the_new_fault(fresh_state, tmp_path):
    clock = fresh_state.clock
    clock.advance(max_query_len=7, for_capture=False)
    for _ in range(5):
        clock.advance(max_query_len=1, for_capture=False)
    fresh_state.announced_acting = True
    epoch = clock.epoch
    marker = tmp_path / "m.jsonl"
    spec = parse_env({"DIFFCHECK_FAULT": "kv-write-corruption", "DIFFCHECK_FAULT_STEP": "3",
                      "DIFFCHECK_FAULT_MARKER": str(marker)})
    runtime.activate(spec)
    assert (clock.decode_passes, clock.step, clock.epoch) == (0, None, epoch + 1)
    assert fresh_state.announced_acting is False
    assert runtime.active("kv-write-corruption") == spec and runtime.active("lost-head") is None
    assert [json.loads(line)["event"] for line in marker.read_text().splitlines()] == ["patched"]
    runtime.activate(None)
    assert runtime.active("kv-write-corruption") is None


def test_switch_refuses_a_process_not_started_switchable_and_a_gpu_fault(fresh_state):
    with pytest.raises(ConfigError, match=ENV_SWITCHABLE):
        faults.switch({"DIFFCHECK_FAULT": "lost-head"})
    fresh_state.switchable = True
    with pytest.raises(ConfigError, match="seq-lens-copy"):
        faults.switch({"DIFFCHECK_FAULT": "seq-lens-copy"})
    with pytest.raises(ConfigError, match="unknown fault"):
        faults.switch({"DIFFCHECK_FAULT": "no-such-fault"})
    assert faults.switch({"DIFFCHECK_FAULT": "lost-head:fixed"}) == "lost-head:fixed"
    assert runtime.active("lost-head").fixed
    assert faults.switch({}) is None and fresh_state.spec is None


def test_a_switchable_process_refuses_a_gpu_fault_at_registration(fresh_state, monkeypatch):
    """Only CPU-lane faults are patched into a switchable process: a GPU fault would silently never act."""
    monkeypatch.setenv(ENV_SWITCHABLE, "1")
    monkeypatch.setenv("DIFFCHECK_FAULT", "seq-lens-copy")
    with pytest.raises(ConfigError, match="cannot be switched in at runtime"):
        faults.register()
    assert fresh_state.spec is None and not fresh_state.installed
