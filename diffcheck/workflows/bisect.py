"""``diffcheck bisect``: find the commit that broke a case, through ``git bisect run``.

The engine's repository (a vLLM source tree, a plugin or a package used through
PYTHONPATH) is bisected between a good and a bad revision. `prepare` checks what
can be checked before the repository is touched (suite, case, goldens) and returns
the `Plan`; `run_bisect` checks the repository, starts ``git bisect run`` with
``python -m diffcheck.workflows.bisect_step --step PLAN`` at each commit (the step
judges the commit: `diffcheck.workflows.bisect_step`), follows its progress
(`StepWatch`) and reads the answer and the steps' results back.

The repository is left exactly as found: branch or detached HEAD, and work
tree, also after Ctrl-C, SIGTERM or an engine crash (`git_bisect.restore` runs in
a ``finally`` with those signals held off, `git_bisect.Interrupts`). Only a SIGKILL
of this process can leave a bisect in progress; the next run refuses with the
command that ends it.

Exit code of the command (`BisectResult.exit_code`): `EXIT_PASS` when a first bad
commit was found, `EXIT_ENGINE` (3) when the bisect could not conclude (only
skipped commits left, or the step aborted).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from diffcheck.core.errors import EXIT_ENGINE, EXIT_PASS
from diffcheck.workflows.git_bisect import (  # noqa: F401  (bisect_in_progress: importable here too)
    Interrupts, RepoState, bisect_in_progress, check_repo, git, parse_bisect_log, repo_state, restore, stop_group,
)

PROGRESS = "bisect: "  # step lines the parent shows; the rest of git's chatter goes to the log
Echo = Callable[[str], None]


@dataclass(frozen=True)
class Plan:
    """Everything a step needs; written as JSON for the step processes."""

    repo: str
    good: str
    bad: str
    case_id: str
    suite: str  # name, or an absolute path to a suite file
    root: str  # goldens root, absolute
    cases_dir: str  # absolute
    cwd: str  # where compare runs (the user's working folder)
    log_dir: str
    build: str | None = None
    strict: bool = False
    verbose: bool = False
    step_cmd: str | None = None  # tests only: replaces the compare command, same exit-code contract


@dataclass(frozen=True)
class StepResult:
    commit: str
    subject: str
    verdict: str  # a Verdict name, "build failed", "engine failure", ...
    code: int  # what the step told git: EXIT_PASS, EXIT_REGRESSION or EXIT_BISECT_SKIP (0, 1, 125)
    reused: bool  # answered from the ledger, no engine run
    seconds: float
    engine_runs: int = 0


@dataclass(frozen=True)
class BisectResult:
    first_bad: str | None
    subject: str = ""
    diffstat: str = ""
    candidates: tuple[str, ...] = ()  # when only skipped commits were left
    steps: tuple[StepResult, ...] = ()
    engine_runs: int = 0
    n_commits: int = 0
    log_dir: str = ""
    restored: RepoState | None = None
    left_behind: tuple[str, ...] = ()  # porcelain lines that appeared during the bisect
    failure: str = ""  # why git bisect run stopped without an answer

    @property
    def exit_code(self) -> int:
        """`EXIT_PASS` when a first bad commit was found; else `EXIT_ENGINE`, the code of a run that gave no verdict."""
        return EXIT_PASS if self.first_bad else EXIT_ENGINE


def step_env(plan: Plan) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (plan.repo, os.environ.get("PYTHONPATH", "")) if p)
    env["DIFFCHECK_GOLDENS"] = plan.root
    env["DIFFCHECK_CASES"] = plan.cases_dir
    env["DIFFCHECK_BISECT_REPO"] = plan.repo
    return env


def run_bisect(plan: Plan, *, echo: Echo = print) -> BisectResult:
    """Bisect `plan.repo` between good and bad; the repository is restored whatever happens."""
    from diffcheck.storage import ledger

    repo = plan.repo
    good, bad, n_commits = check_repo(repo, plan.good, plan.bad)
    led = ledger.Ledger.open(plan.root)
    runs_before = led.engine_runs(plan.case_id)
    original = repo_state(repo)
    Path(plan.log_dir).mkdir(parents=True, exist_ok=True)
    plan_file = Path(plan.log_dir) / "plan.json"
    plan_file.write_text(json.dumps(asdict(plan), indent=2))
    steps_file = Path(plan.log_dir) / "steps.jsonl"
    steps_file.unlink(missing_ok=True)
    echo(f"{PROGRESS}case {plan.case_id} (suite {plan.suite}) over {n_commits} commits of {repo}: "
         f"good {good[:10]}, bad {bad[:10]}; logs in {plan.log_dir}")
    proc, lines, rc, bisect_log, interrupted, watch = None, [], None, "", False, None
    with Interrupts() as interrupts:
        try:
            watch = StepWatch(plan, n_commits)
            watch.saw(git(repo, "bisect", "start", bad, good, "--"))
            cmd = ["git", "-C", repo, "bisect", "run", sys.executable, "-m", "diffcheck.workflows.bisect_step", "--step",
                   str(plan_file)]
            # A session of its own: Ctrl-C reaches only this process, which then stops the
            # whole group (step, compare, engine) before restoring the repository.
            with interrupts.deferred():
                proc = subprocess.Popen(cmd, cwd=repo, env=step_env(plan), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
            with open(Path(plan.log_dir) / "git-bisect.log", "w") as log:
                for line in proc.stdout:
                    log.write(line)
                    watch.saw(line)
                    lines.append(line.rstrip("\n"))
                    if plan.verbose or line.startswith(PROGRESS):
                        echo(line.rstrip("\n"))
            rc = proc.wait()
            bisect_log = git(repo, "bisect", "log", check=False)
            interrupts.hold()
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            interrupts.hold()  # already so, unless another exception got here
            if watch is not None:
                watch.close()
            if proc is not None and proc.poll() is None:
                stop_group(proc)
            restored, left = restore(repo, original)
            if interrupted:
                echo(f"{PROGRESS}interrupted; repository restored: {restored.describe()}")
    first_bad, candidates = parse_bisect_log(bisect_log)
    failure = ""
    if not first_bad:
        tail = [ln for ln in lines if ln and not ln.startswith(PROGRESS)][-3:]
        failure = f"git bisect run exited {rc}: " + (" | ".join(tail) or "no output")
    subject = diffstat = ""
    if first_bad:
        subject = git(repo, "log", "-1", "--format=%s", first_bad)
        diffstat = git(repo, "show", "--stat", "--format=", first_bad)
    return BisectResult(first_bad=first_bad, subject=subject, diffstat=diffstat, candidates=candidates,
                        steps=read_steps(steps_file), engine_runs=led.engine_runs(plan.case_id) - runs_before,
                        n_commits=n_commits, log_dir=plan.log_dir, restored=restored, left_behind=left,
                        failure=failure)


_BISECTING = re.compile(r"^\[([0-9a-f]{40})\] (.*)$")


class StepWatch:
    """The parent's live view of a bisect: "step k of about ⌈log2 N⌉", the commit under test, and
    the last progress line of that commit's build or compare log (what the step is doing now).

    Fed git bisect's own output (`saw`): ``[sha] subject`` names the next commit, a step's
    ``bisect: ...`` line ends the current step. A thread follows the step's log files.
    """

    def __init__(self, plan: Plan, n_commits: int):
        from diffcheck.core import progress

        self.plan, self.shown = plan, progress.current()
        self.about = max(1, math.ceil(math.log2(max(n_commits, 2))))
        self.step, self.commit, self.subject, self.detail = 0, "", "", ""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._follow, name="diffcheck-bisect-watch", daemon=True)
        self.thread.start()

    def saw(self, text: str) -> None:
        for line in text.splitlines():
            m = _BISECTING.match(line.strip())
            if m:
                self.commit, self.subject, self.detail = m.group(1), m.group(2), ""
                self.step += 1
                self.shown.stage(f"bisect {self.plan.case_id}: step {self.step} of about {self.about}: "
                                 f"{self.commit[:10]} {self.subject}")
                self.shown.activity(f"{self.commit[:10]}: starting the step")

    def status(self) -> str:
        """What the stage line says now (for tests and logs)."""
        return (f"step {self.step} of about {self.about}: {self.commit[:10]} {self.subject}" if self.commit
                else "starting")

    def _follow(self) -> None:
        while not self.stop.wait(1.0):
            if not self.commit:
                continue
            short = self.commit[:10]
            line = ""
            for name in (f"{short}-compare.log", f"{short}-build.log"):
                line = _last_line(Path(self.plan.log_dir) / name)
                if line:
                    break
            if line and line != self.detail:
                self.detail = line
                self.shown.activity(f"{short}: {line}")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def _last_line(path: Path, limit: int = 4096) -> str:
    """The last non-empty line of a log file (its last `limit` bytes), without control characters."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            data = f.read()
    except OSError:
        return ""
    lines = [ln.strip() for ln in re.split(r"[\r\n]", data.decode("utf-8", errors="replace")) if ln.strip()]
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|[\x00-\x1f]", "", lines[-1])[:200] if lines else ""



def read_steps(path: Path) -> tuple[StepResult, ...]:
    if not path.exists():
        return ()
    return tuple(StepResult(**json.loads(line)) for line in path.read_text().splitlines() if line.strip())


def prepare(case_id: str, *, repo: str | Path, good: str, bad: str, suite: str = "default",
            goldens: str | Path | None = None, build: str | None = None, strict: bool = False,
            verbose: bool = False, step_cmd: str | None = None, log_dir: str | Path | None = None) -> Plan:
    """Check what can be checked before the repository is touched; returns the plan for `run_bisect`."""
    from diffcheck import cases as casesmod
    from diffcheck import workspace
    from diffcheck.core.errors import ConfigError

    root = workspace.goldens_root(goldens).resolve()
    loaded = casesmod.load_suite(suite)
    case = casesmod.get_case(loaded, case_id)
    if not case.references:
        raise ConfigError(f"case '{case_id}' has no references to compare against (it is a {case.role}); "
                          "bisect a candidate case")
    for ref in case.references:
        workspace.load_golden(root, loaded.name, ref)  # missing: one line with the command that records it
    is_path = str(suite).endswith(".toml") or "/" in str(suite)
    return Plan(
        repo=str(Path(repo).resolve()), good=good, bad=bad, case_id=case_id,
        suite=str(Path(suite).resolve()) if is_path else str(suite), root=str(root),
        cases_dir=str(Path(casesmod.cases_dir()).resolve()), cwd=os.getcwd(),
        log_dir=str(log_dir) if log_dir else tempfile.mkdtemp(prefix=f"diffcheck-bisect-{case_id}-"),
        build=build, strict=strict, verbose=verbose, step_cmd=step_cmd,
    )
