"""`diffcheck reduce` on the real engine: a fault case with three prompts, 24 tokens and one
irrelevant config key shrinks to one prompt, the fault's env alone, a step count near the onset;
its standalone script exits 1 on the candidate and 0 on the reference in a fresh process.

One reduce for the whole module (the session fixture `reduced`), interrupted by Ctrl-C after its
third probe and run again: J, the eager fp32 reference;
E, J with the stale-metadata fault from decode step 4 and max_num_seqs = 2 (a key the failure
does not need). The script runs in a fresh interpreter of this venv; it imports only vLLM, and
the fault acts through diffcheck's vLLM plugin, which this venv has installed (a real bug would
need vLLM alone). Within this module at most one engine runs at a time.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from factories import write_suite

pytestmark = pytest.mark.engine
EVENTUALLY_S = 300  # how long processes may take to go after Ctrl-C before the test calls them left over

PROMPTS = [
    {"id": "bicycle", "text": "Describe a bicycle in two sentences."},
    {"id": "tea", "text": "How do I make a cup of green tea?"},
    {"id": "rain", "text": "Why does it rain?"},
]
CASES = {
    "J": {"role": "reference", "description": "eager fp32 reference"},
    "E": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "stale metadata from step 4",
          "env": {"DIFFCHECK_FAULT": "stale-decode-metadata", "DIFFCHECK_FAULT_STEP": "4"},
          "engine": {"max_num_seqs": 2}},
}
MAX_TOKENS = 24


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="200")
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-m", "diffcheck.cli", *args], capture_output=True, text=True, env=env,
                          timeout=900, **kw)


@pytest.fixture(scope="session")
def reduced(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reduce")
    suite = write_suite(folder / "cases", CASES, name="red", description="reduce on the real engine", prompts=PROMPTS,
                        sampling={"max_tokens": MAX_TOKENS, "temperature": 0.7, "top_p": 0.95, "top_k": 20,
                                  "seed": 1234, "logprobs": 20},
                        engine={"dtype": "float32", "enforce_eager": True, "max_model_len": 1024,
                                "kv_cache_memory_gib": 1})
    goldens = folder / "goldens"
    rec = _cli("golden", "record", "J", "--suite", str(suite), "--goldens", str(goldens))
    assert rec.returncode == 0, rec.stdout + rec.stderr[-3000:]
    out = folder / "out"
    target = folder / "cases" / "reduced.toml"
    args = ["reduce", "E", "--suite", str(suite), "--goldens", str(goldens), "--out", str(out)]
    # Ctrl-C once probe 3 is done (probe 4 runs), then the same command again: it resumes
    first, rc_first, survivors = _interrupted(args, after="reduce E: probe 3 ")
    from diffcheck.storage import ledger

    before = ledger.Ledger.open(goldens).entries()
    res = _cli(*args, "--write-case", str(target), "--json", str(folder / "reduce.json"))
    print(res.stderr[-6000:])  # the probe lines, for -s and for a failure's report
    return {"res": res, "out": out, "target": target, "json": folder / "reduce.json", "goldens": goldens,
            "suite": suite, "first": first, "rc_first": rc_first, "survivors": survivors, "before": before,
            "after": ledger.Ledger.open(goldens).entries()}


def _interrupted(args, *, after: str):
    """Run `diffcheck *args`, SIGINT its process group (Ctrl-C) once a line holding `after` shows;
    (its output, its exit code, the processes it left, killed here)."""
    import psutil

    env = dict(os.environ, COLUMNS="200")
    env.pop("PYTHONPATH", None)
    proc = subprocess.Popen([sys.executable, "-m", "diffcheck.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if after in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if seen.wait(timeout=900):
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
    try:
        rc = proc.wait(timeout=EVENTUALLY_S)  # a hang guard, as below
    except subprocess.TimeoutExpired:
        rc = None
    reader.join(timeout=10)

    def group() -> list[int]:
        out = []
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(p.info["pid"]) == proc.pid:
                    out.append(p.info["pid"])
            except (ProcessLookupError, PermissionError):
                continue
        return out

    deadline = time.monotonic() + EVENTUALLY_S  # a hang guard, not a measure of speed
    while group() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = group()
    for pid in left:  # ours: left by the interrupted run
        os.kill(pid, signal.SIGKILL)
    return "".join(lines), rc, left


def test_an_interrupted_reduce_resumes_without_repeating_a_probe(reduced):
    assert reduced["rc_first"] == 130, reduced["first"][-3000:]
    assert not reduced["survivors"], f"processes left running after Ctrl-C: {reduced['survivors']}"
    done = sum(1 for line in reduced["first"].splitlines() if line.startswith("reduce E: probe "))
    assert done >= 3, reduced["first"][-3000:]
    doc = json.loads(reduced["json"].read_text())
    assert all(p["reused"] for p in doc["probes"][:done]), doc["probes"]  # the probes done before Ctrl-C
    assert not any(p["reused"] for p in doc["probes"][done:]), doc["probes"]
    before, after = reduced["before"], reduced["after"]
    assert len({e.key for e in after}) == len(after), "a probe ran twice"
    assert {e.case_id for e in after[len(before):]} == {p["case"] for p in doc["probes"][done:]}


def test_reduce_ends_with_one_prompt_the_fault_alone_and_steps_near_the_onset(reduced):
    res = reduced["res"]
    assert res.returncode == 1, res.stdout + res.stderr[-4000:]  # the reduced case still fails
    doc = json.loads(reduced["json"].read_text())
    assert doc["verdict"] in ("GIBBERISH", "DEGRADED") and doc["final_verdict"] == doc["verdict"]
    assert len(doc["prompts"]) == 1 and doc["original_prompts"] == 3
    assert doc["dropped"] == ["max_num_seqs"]
    assert set(doc["config_delta"]) == {"env.DIFFCHECK_FAULT", "env.DIFFCHECK_FAULT_STEP"}
    onset = doc["onset"] if doc["onset"] is not None else doc["t_star"]
    assert onset is not None and doc["max_tokens"] <= MAX_TOKENS and 0 < doc["max_tokens"] - onset <= 16
    # every probe line was shown, and every probe is a case of its own
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("reduce E: probe ")]  # not the live frames
    assert len(lines) == len(doc["probes"]) and len(doc["probes"]) <= doc["bound"] + 2, res.stderr[-3000:]
    assert len({p["case"] for p in doc["probes"]}) == len(doc["probes"])
    assert all(p["case"].startswith("E.r") for p in doc["probes"][1:])


def test_the_written_case_loads_and_the_report_says_what_was_found(reduced):
    from diffcheck import cases

    suite = cases.load_suite(reduced["target"])
    cand = suite.cases["E-reduced"]
    assert cand.references == ("J-for-E-reduced",)
    assert cand.env["DIFFCHECK_FAULT"] == "stale-decode-metadata" and cand.engine.max_num_seqs is None
    assert len(cases.load_prompts(cand)) == 1
    report = (reduced["out"] / "report.md").read_text()
    for needle in ("## Versions", "vLLM", "torch", "## Configuration delta", "env.DIFFCHECK_FAULT", "## Probes",
                   "from the ledger", "```python"):
        assert needle in report, needle


def test_the_script_imports_no_diffcheck_and_exits_1_on_the_candidate_0_on_the_reference(reduced):
    script = reduced["out"] / "reduce.py"
    tree = ast.parse(script.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "diffcheck" not in imported and "vllm" in imported
    # Both runs put each side's vLLM engine core in the side's own process (vLLM's own variable; the
    # script passes the environment on to its sides): one vLLM import per side instead of two, ~15 s
    # instead of ~45 s a side on the 2-core machine. Otherwise the script runs as a user runs it.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFCHECK", "PYTHONPATH"))}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    bug = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600,
                         cwd=reduced["out"])
    assert bug.returncode == 1, bug.stdout + bug.stderr[-3000:]
    assert "THE BUG SHOWS" in bug.stdout and "<- t*" in bug.stdout
    control = subprocess.run([sys.executable, str(script), "--candidate", "reference"], capture_output=True, text=True,
                             env=env, timeout=600, cwd=reduced["out"])
    assert control.returncode == 0, control.stdout + control.stderr[-3000:]
    assert "no bug: exit 0" in control.stdout


def test_a_second_reduce_runs_no_engine_for_a_probe_the_ledger_holds(reduced):
    from diffcheck.storage import ledger

    before = len(ledger.Ledger.open(reduced["goldens"]).entries())
    again = _cli("reduce", "E", "--suite", str(reduced["suite"]), "--goldens", str(reduced["goldens"]), "--out",
                 str(reduced["out"]), "--json", str(reduced["out"] / "again.json"))
    assert again.returncode == 1, again.stderr[-3000:]
    doc = json.loads((reduced["out"] / "again.json").read_text())
    assert all(p["reused"] for p in doc["probes"]), doc["probes"]
    assert len(ledger.Ledger.open(reduced["goldens"]).entries()) == before
