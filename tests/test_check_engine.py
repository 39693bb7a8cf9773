"""The regression check in one command, on the real engine, with the progress a user sees.

One module-scoped golden (the smoke suite's J, eager fp32) and, in order:

1. ``diffcheck check`` on the smoke suite, output to pipes (CI): J re-run against its own
   golden, S1 against J, the labelled fault E left to the self-test; one exit code; plain
   lines, no bar frames.
2. ``diffcheck compare J --force`` on a pseudo-terminal: J re-run with today's engine and
   judged IDENTICAL against its golden, the fresh run stored as J.run.parquet (candidate
   role) and the golden untouched; the live display goes from the engine's start-up phases
   to tokens/s in order, its elapsed times never going back and moving while vLLM is silent
   (no wall-clock bound: a loaded machine stretches every phase).
3. A "new build" whose numerics differ. diffcheck cannot install another vLLM here, so the
   new build is simulated honestly through the one thing that changes numerics without
   touching the engine's code: a second suite file, ``newbuild/smoke.toml``, with the same
   suite name (so the same golden folder, the same golden J) whose J differs only in
   ``dtype = "bfloat16"``. Its config digest differs, so the ledger never reuses the fp32
   run for it, and the run's metadata says dtype bfloat16, as a real upgrade that changed
   the compute dtype would. ``diffcheck check`` must report J's golden as moved (not
   IDENTICAL), with the dtype change, and the golden must stay as it was.

Engines start one at a time, each in its own ``diffcheck`` process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, SMOKE_CASES, write_smoke_suite
from diffcheck.engines import vllm_progress
from diffcheck.core import types as policy
from diffcheck.storage import store
from diffcheck.core.types import Verdict
from factories import write_suite
from terminal import run_in_pty, text_of, updates
from test_progress import assert_counters_move_forward, live_frames

pytestmark = pytest.mark.engine
TIMEOUT_S = 900


def diffcheck(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diffcheck.cli", *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S, **kw)


def verdicts(path: Path) -> dict[tuple[str, str], str]:
    data = json.loads(path.read_text())
    return {(c["candidate_id"], c["reference_id"]): c["verdict"] for c in data["cases"]}


def no_bar_frames(res: subprocess.CompletedProcess) -> None:
    for stream in (res.stdout, res.stderr):
        assert "\r" not in stream and "\x1b" not in stream


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("check")
    suite = write_smoke_suite(tmp / "cases")
    goldens = tmp / "goldens"
    res = diffcheck("golden", "record", "J", "--suite", str(suite), "--goldens", str(goldens))
    assert res.returncode == 0, res.stderr[-3000:]
    golden = store.run_path(goldens, "smoke", "J")
    return {"tmp": tmp, "suite": suite, "goldens": goldens, "golden": golden, "golden_bytes": golden.read_bytes()}


def test_check_runs_the_suite_the_way_ci_wants_it(world):
    out = world["tmp"] / "check.json"
    res = diffcheck("check", "--suite", str(world["suite"]), "--goldens", str(world["goldens"]), "--json", str(out))
    got = verdicts(out)
    assert set(got) == {("J", "J"), ("S1", "J")}, res.stdout
    assert got[("J", "J")] == "IDENTICAL"
    worst = Verdict.worst(Verdict[v] for v in got.values())
    assert res.returncode == policy.exit_code(worst), res.stderr[-3000:]
    assert "left out: E: labelled fault (expect GIBBERISH)" in res.stdout
    assert "  J      IDENTICAL     unchanged" in res.stdout and "no golden moved" in res.stdout
    no_bar_frames(res)
    assert "J: engine start:" in res.stderr, res.stderr  # the progress lines are there, as plain lines
    assert world["golden"].read_bytes() == world["golden_bytes"]


def test_compare_a_reference_judges_a_fresh_run_against_its_golden_with_live_progress(world):
    out = world["tmp"] / "compare-J.json"
    env = {**os.environ, "TERM": "xterm-256color"}
    rc, chunks = run_in_pty([sys.executable, "-m", "diffcheck.cli", "compare", "J", "--force", "--suite",
                             str(world["suite"]), "--goldens", str(world["goldens"]), "--json", str(out)],
                            env=env, timeout=TIMEOUT_S)
    text = text_of(chunks)
    assert rc == 0, text[-3000:]
    assert verdicts(out) == {("J", "J"): "IDENTICAL"}
    fresh = store.read_run(store.run_path(world["goldens"], "smoke", "J", role="candidate"))
    assert fresh.meta.role == "candidate" and fresh.meta.kind == "generate"
    assert world["golden"].read_bytes() == world["golden_bytes"]  # never written over
    in_order = ("J: engine start: importing vLLM", "J: generating", "tok/s", "J: shutting the engine down")
    for shown in in_order:
        assert shown in text, shown
    firsts = [text.index(shown) for shown in in_order]
    assert firsts == sorted(firsts), dict(zip(in_order, firsts))
    # The phases read from vLLM's log come and go as fast as vLLM logs them; the display
    # redraws 4 times a second, so a phase shorter than that may never be drawn. At least
    # one of them must be: the engine core's start takes seconds.
    from_log = {label.split(":")[0].split("{")[0].strip() for _, label in vllm_progress.PHASES}
    drawn = [text.index(f"J: engine start: {phase}") for phase in from_log if f"J: engine start: {phase}" in text]
    assert drawn, sorted(from_log)
    assert firsts[0] < min(drawn) and max(drawn) < firsts[1]  # vLLM's phases between the import and generating
    frames = live_frames(updates(chunks))
    assert_counters_move_forward(frames)
    # The engine start takes seconds in which vLLM logs nothing new: the display went on redrawing,
    # some start-up phase's elapsed time counting on screen.
    starting = {}
    for _, _, activity, seconds in frames:
        if activity.startswith("J: engine start: "):
            starting.setdefault(activity, set()).add(seconds)
    assert any(len(counted) >= 2 for counted in starting.values()), starting


def test_a_new_build_that_moves_the_numerics_is_reported_as_a_moved_golden(world):
    newbuild = write_suite(world["tmp"] / "newbuild", {"J": SMOKE_CASES["J"]}, name="smoke",
                           description="the smoke suite's J on a 'new build' whose compute dtype is bfloat16",
                           prompts=ROOT / "cases" / "prompts" / "smoke-en.toml",
                           sampling={"max_tokens": 24, "temperature": 0.7, "top_p": 0.95, "top_k": 20, "seed": 1234,
                                     "logprobs": 20},
                           engine={"dtype": "bfloat16", "enforce_eager": True, "max_model_len": 1024,
                                   "kv_cache_memory_gib": 1})
    out = world["tmp"] / "newbuild.json"
    res = diffcheck("check", "--suite", str(newbuild), "--goldens", str(world["goldens"]), "--json", str(out))
    verdict = Verdict[verdicts(out)[("J", "J")]]
    assert verdict is not Verdict.IDENTICAL and verdict is not Verdict.ERROR, res.stdout
    assert res.returncode == policy.exit_code(verdict), res.stderr[-3000:]
    move = json.loads(out.read_text())["meta"]["goldens"][0]
    assert move["case"] == "J" and move["moved"] is True and move["benign"] == policy.passes(verdict)
    assert move["spec_change"] == {"dtype": ["float32", "bfloat16"]} and move["config_changed"] is True
    assert f"  J      {verdict.name}" in res.stdout and "moved, " in res.stdout and "moved: J" in res.stdout
    no_bar_frames(res)
    fresh = store.read_run(store.run_path(world["goldens"], "smoke", "J", role="candidate"))
    assert fresh.meta.engine["effective"]["dtype"] in ("bfloat16", "torch.bfloat16")
    assert world["golden"].read_bytes() == world["golden_bytes"]
    # compare says the same, from the ledger (same config, engine, model, golden): no second engine run
    again = diffcheck("compare", "J", "--suite", str(newbuild), "--goldens", str(world["goldens"]))
    assert "J: reused run from" in again.stdout and verdict.name in again.stdout
    assert again.returncode == policy.exit_code(verdict)
