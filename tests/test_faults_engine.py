"""The faults inside a real vLLM engine (CPU lane, SmolLM2-135M, greedy, 2 prompts x 48 tokens, N = 16).

Engine starts are the expensive part, so a single helper subprocess (``python -m
tools.fault_smoke``) runs every config this session selected and writes all token ids,
texts and marker lines to one JSON file; the tests below only read it. The fault configs
share one engine, each switched in in turn, as the self-test runs them; that engine is also
switched back to clean, one fault also runs in an engine of its own (``FRESH``), and the
clean reference runs in a clean engine of its own: the tests hold the switched runs to
those. Only the configs of the selected tests are run. A missing model or a dead engine
fails these tests: nothing here skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diffcheck.cases.faults import ENV_SWITCHABLE
from diffcheck.faults import marker, names_for_lane
from tools.fault_smoke import CLEAN, FRESH, SWITCHED

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[1]
STEP = 16
MAX_TOKENS = 48
FAULT_NAMES = sorted(names_for_lane("cpu"))  # seq-lens-copy needs CUDA graphs
HELPER_TIMEOUT_S = 1800  # 3 engines and 11 generations on a loaded 2-core machine; a hang must still end
FRESH_FAULT = "stale-decode-metadata"  # run in an engine of its own too: a switched fault acts as a fresh one


def _selected_configs(session) -> list[str]:
    configs = {CLEAN, FRESH_FAULT}
    for item in session.items:
        if Path(str(item.fspath)).name == Path(__file__).name and hasattr(item, "callspec"):
            config = item.callspec.params.get("config")
            if config:
                configs.add(config)
    return sorted(configs)


@pytest.fixture(scope="module")
def smoke(request, tmp_path_factory) -> dict:
    """config -> result dict of SmokeResult; also '_driver_pid' and '_wall_s'."""
    out = tmp_path_factory.mktemp("faults") / "smoke.json"
    configs = _selected_configs(request.session)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFCHECK_FAULT", ENV_SWITCHABLE))}
    cmd = [sys.executable, "-m", "tools.fault_smoke", "--out", str(out), "--step", str(STEP),
           "--max-tokens", str(MAX_TOKENS), "--fresh", FRESH_FAULT, *configs]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=HELPER_TIMEOUT_S)
    if not out.exists():
        pytest.fail(f"fault smoke helper wrote no results (rc={proc.returncode}): {' '.join(cmd)}\n"
                    f"{proc.stderr[-4000:]}", pytrace=False)
    payload = json.loads(out.read_text())
    results = {r["config"]: r for r in payload["results"]}
    print(f"\nfault smoke: {len(results)} runs in {payload['wall_s']} s: "
          + ", ".join(f"{c} start {r['start_s']} s gen {r['generate_s']} s" for c, r in results.items()))
    return results


def _result(smoke: dict, config: str) -> dict:
    result = smoke[config]
    if result["error"]:
        pytest.fail(f"engine for {config!r} failed: {result['error']}", pytrace=False)
    return result


def _first_divergence(reference: list[int], candidate: list[int]) -> int | None:
    for t, (r, c) in enumerate(zip(reference, candidate)):
        if r != c:
            return t
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


@pytest.mark.parametrize("config", FAULT_NAMES)
def test_fault_patches_and_acts_inside_engine_processes(smoke, config):
    result = _result(smoke, config)
    outsiders = {os.getpid(), result["driver_pid"]}
    patched = {e["pid"] for e in result["marker_events"] if e["event"] == "patched"}
    acting = [e for e in result["marker_events"] if e["event"] == "acting"]
    assert patched - outsiders, f"no engine-side process patched {config}: {result['marker_events']}"
    assert len(acting) == 1, result["marker_events"]
    assert acting[0]["pid"] not in outsiders and acting[0]["pid"] in patched
    assert acting[0]["step"] == STEP
    assert marker.acting_ranks(result["marker_events"], 1, outsiders=outsiders) == []


@pytest.mark.parametrize("config", FAULT_NAMES)
def test_fault_keeps_tokens_up_to_step_and_changes_them_after(smoke, config):
    clean, faulty = _result(smoke, CLEAN), _result(smoke, config)
    assert len(faulty["token_ids"]) == len(clean["token_ids"]) == 2
    for seq, (reference, candidate) in enumerate(zip(clean["token_ids"], faulty["token_ids"])):
        # Decode step N produces output token N + 1: tokens 0..N cannot change.
        assert candidate[: STEP + 1] == reference[: STEP + 1], f"seq {seq} changed before step {STEP}"
        t_star = _first_divergence(reference, candidate)
        assert t_star is not None, f"{config} left seq {seq} unchanged: {faulty['texts'][seq]!r}"
        assert t_star > STEP


@pytest.mark.parametrize("config", [f"{name}:fixed" for name in FAULT_NAMES])
def test_fixed_variant_restores_the_clean_output_exactly(smoke, config):
    clean, fixed = _result(smoke, CLEAN), _result(smoke, config)
    # The fixed path must really have run (an 'acting' line), not merely been skipped.
    assert [e["step"] for e in fixed["marker_events"] if e["event"] == "acting"] == [STEP]
    assert fixed["token_ids"] == clean["token_ids"]
    assert fixed["texts"] == clean["texts"]


def _mean(values: list) -> float:
    values = [v for v in values if v is not None]
    assert values, "no tokens after the step to score"
    return sum(values) / len(values)


def _digit_ratio(text: str) -> float:
    visible = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in visible) / max(1, len(visible))


@pytest.mark.parametrize("config", ["lost-head"])
def test_lost_head_stays_fluent_but_scores_worse(smoke, config):
    """The hard case: no digit soup, but the clean model finds the text after step N less likely."""
    clean, faulty = _result(smoke, CLEAN), _result(smoke, config)
    assert _mean(faulty["nll_after_step"]) > _mean(clean["nll_after_step"]) + 0.1
    assert _mean(faulty["nll_after_step"]) < 2.0, "lost-head collapsed instead of degrading"
    for text in faulty["texts"]:
        assert _digit_ratio(text) < 0.05, text
        assert sum(c.isalpha() or c.isspace() for c in text) / len(text) > 0.9, text


@pytest.mark.parametrize("config", ["kv-write-corruption"])
def test_kv_write_corruption_collapses_the_text(smoke, config):
    clean, faulty = _result(smoke, CLEAN), _result(smoke, config)
    assert _mean(faulty["nll_after_step"]) > _mean(clean["nll_after_step"]) + 2.0


def test_an_engine_switched_back_to_clean_gives_the_clean_engines_output(smoke):
    """The shared engine, after every fault of the session acted in it, equals a clean engine of its own
    (no fault patched in): no fault leaves anything behind, and the patches change nothing while off."""
    assert _result(smoke, CLEAN + SWITCHED)["token_ids"] == _result(smoke, CLEAN)["token_ids"]
    assert _result(smoke, CLEAN + SWITCHED)["marker_events"] == []


def test_a_fault_switched_in_acts_as_in_an_engine_of_its_own(smoke):
    switched, fresh = _result(smoke, FRESH_FAULT), _result(smoke, FRESH_FAULT + FRESH)
    assert switched["token_ids"] == fresh["token_ids"]
    assert [e["step"] for e in fresh["marker_events"] if e["event"] == "acting"] == [STEP]
    worker = {e["pid"] for e in switched["marker_events"]}
    assert worker.isdisjoint(e["pid"] for e in fresh["marker_events"]), "the fresh engine had its own worker"
