"""The faults inside a real vLLM engine (CPU lane, SmolLM2-135M, greedy, 2 prompts x 48 tokens, N = 16).

One engine per config is the expensive part (~10-25 s start and stop each on CPU, depending
on the machine's load), so a single helper subprocess (``python -m tools.fault_smoke``)
runs every config this session selected, one engine after another, and writes all
token ids, texts and marker lines to one JSON file; the tests below only read it.
Only the configs of the selected tests are run (``-k stale`` starts two engines).
A missing model or a dead engine fails these tests: nothing here skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diffcheck.faults import marker, names_for_lane
from tools.fault_smoke import CLEAN

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[1]
STEP = 16
MAX_TOKENS = 48
FAULT_NAMES = sorted(names_for_lane("cpu"))  # seq-lens-copy needs CUDA graphs
HELPER_TIMEOUT_S = 2400  # 9 engines on a loaded 2-core machine; a hang must still end


def _selected_configs(session) -> list[str]:
    configs = {CLEAN}
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
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFCHECK_FAULT")}
    cmd = [sys.executable, "-m", "tools.fault_smoke", "--out", str(out), "--step", str(STEP),
           "--max-tokens", str(MAX_TOKENS), *configs]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=HELPER_TIMEOUT_S)
    if not out.exists():
        pytest.fail(f"fault smoke helper wrote no results (rc={proc.returncode}): {' '.join(cmd)}\n"
                    f"{proc.stderr[-4000:]}", pytrace=False)
    payload = json.loads(out.read_text())
    results = {r["config"]: r for r in payload["results"]}
    print(f"\nfault smoke: {len(configs)} engines in {payload['wall_s']} s: "
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
