"""``diffcheck bisect``: find the commit that broke a case, through ``git bisect run``.

Longer than 400 lines because it holds git bisect's driver, its signal handling (a Ctrl-C must always restore the repository) and the per-commit step.

The engine's repository (a vLLM source tree, a plugin or a package used through
PYTHONPATH) is bisected between a good and a bad revision. At each commit the
step (``python -m diffcheck.workflows.bisect --step PLAN``, run by ``git bisect run``):

1. looks the commit's run up in the ledger: a cached verdict answers at once,
   so a repeated bisect costs no engine run;
2. runs ``--build`` in the repository: failure -> 125 (skip, never blamed);
3. runs ``diffcheck compare CASE --suite S --bisect-codes`` in a subprocess with
   ``PYTHONPATH=<repo>:...`` (each commit's code is imported fresh): 0 good,
   1 bad, anything else (engine failure, crash) 125 skip. Exit 1 counts as bad
   only when the ledger holds the regression verdict for this commit's run:
   Python exits 1 on an uncaught exception too.

The repository is left exactly as found: branch or detached HEAD, and work
tree, also after Ctrl-C, SIGTERM or an engine crash (`restore` runs in a
``finally`` with those signals held off). Only a SIGKILL of this process can
leave a bisect in progress; the next run refuses with the command that ends it.

Ctrl-C works however the process was started: a shell without job control
starts a background command (``diffcheck bisect ... &`` in a script, a CI
runner) with SIGINT ignored, and Python then installs no KeyboardInterrupt
handler, so the bisect installs its own (`_Interrupts`). An inherited SIGHUP
ignore (``nohup``) is kept.

Knows git (the ``git`` command) and the ledger. Knows nothing about engines or
verdict rules: the compare subprocess judges, this module maps exit codes.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from diffcheck.core.errors import DiffcheckError, EngineError
from diffcheck.core.types import Verdict

GOOD, BAD, SKIP = 0, 1, 125
ABORT = 128  # git bisect run aborts on >= 128: an internal error must not be "skipped" at every commit
PROGRESS = "bisect: "  # step lines the parent shows; the rest of git's chatter goes to the log
_STOP_GRACE_S = 20
Echo = Callable[[str], None]


@dataclass(frozen=True)
class RepoState:
    branch: str | None  # None: detached HEAD
    head: str
    porcelain: tuple[str, ...]  # `git status --porcelain` lines

    def describe(self) -> str:
        return f"{self.branch or 'detached HEAD'} at {self.head[:10]}"


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
    code: int  # what the step told git: 0, 1 or 125
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
        return 0 if self.first_bad else 3


# -- git ---------------------------------------------------------------------------------------


def git(repo: str | Path, *args: str, check: bool = True) -> str:
    res = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if check and res.returncode != 0:
        last = (res.stderr.strip().splitlines() or [res.stdout.strip() or "no output"])[-1]
        raise DiffcheckError(f"{repo}: git {' '.join(args)} failed: {last}")
    return res.stdout.strip()


def repo_state(repo: str | Path) -> RepoState:
    branch = git(repo, "symbolic-ref", "-q", "--short", "HEAD", check=False) or None
    porcelain = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True,
                               text=True).stdout.splitlines()
    return RepoState(branch=branch, head=git(repo, "rev-parse", "HEAD"), porcelain=tuple(porcelain))


def bisect_in_progress(repo: str | Path) -> bool:
    path = Path(git(repo, "rev-parse", "--git-path", "BISECT_START"))
    return (path if path.is_absolute() else Path(repo) / path).exists()


def check_repo(repo: str | Path, good: str, bad: str) -> tuple[str, str, int]:
    """Refuse a repository that cannot be bisected safely; returns (good sha, bad sha, commits in range)."""
    top = subprocess.run(["git", "-C", str(repo), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode != 0:
        raise DiffcheckError(f"--repo {repo}: not a git repository")
    if Path(top.stdout.strip()).resolve() != Path(repo).resolve():
        raise DiffcheckError(f"--repo {repo}: give the repository's top folder ({top.stdout.strip()})")
    if bisect_in_progress(repo):
        raise DiffcheckError(f"--repo {repo}: a git bisect is already in progress; end it with "
                             f"`git -C {repo} bisect reset` first")
    dirty = git(repo, "status", "--porcelain", "--untracked-files=no")
    if dirty:
        raise DiffcheckError(f"--repo {repo}: the work tree has uncommitted changes "
                             f"({dirty.splitlines()[0].strip()}, ...); commit or stash them first")
    shas = []
    for option, rev in (("--good", good), ("--bad", bad)):
        sha = git(repo, "rev-parse", "--verify", "-q", f"{rev}^{{commit}}", check=False)
        if not sha:
            raise DiffcheckError(f"{option} {rev}: no such commit in {repo}")
        shas.append(sha)
    good_sha, bad_sha = shas
    if good_sha == bad_sha:
        raise DiffcheckError(f"--good {good} and --bad {bad} are the same commit ({good_sha[:10]})")
    if subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", good_sha, bad_sha]).returncode != 0:
        raise DiffcheckError(f"--good {good} ({good_sha[:10]}) is not an ancestor of --bad {bad} ({bad_sha[:10]})")
    return good_sha, bad_sha, int(git(repo, "rev-list", "--count", f"{good_sha}..{bad_sha}"))


def restore(repo: str | Path, original: RepoState) -> tuple[RepoState, tuple[str, ...]]:
    """End any bisect and put branch, HEAD and tracked files back; returns (state, new porcelain lines).

    Tracked changes at this point are the bisect's own (a dirty tree was refused
    at the start), so they are reset. Untracked files a build left are reported,
    never deleted: they may be caches the user wants to keep.
    """
    if git(repo, "status", "--porcelain", "--untracked-files=no", check=False):
        git(repo, "reset", "--hard", "-q", check=False)
    if bisect_in_progress(repo):
        git(repo, "bisect", "reset", check=False)
    now = repo_state(repo)
    if (now.branch, now.head) != (original.branch, original.head):
        target = [original.branch] if original.branch else ["--detach", original.head]
        git(repo, "checkout", "-q", *target, check=False)
        now = repo_state(repo)
    if (now.branch, now.head) != (original.branch, original.head):
        where = original.branch or original.head
        raise DiffcheckError(f"{repo}: could not restore {original.describe()} (now {now.describe()}); "
                             f"run `git -C {repo} checkout {where}`")
    left = tuple(line for line in now.porcelain if line not in set(original.porcelain))
    return now, left


class _Interrupts:
    """SIGINT, SIGTERM and SIGHUP raise KeyboardInterrupt, once; then no signal may cut the cleanup short.

    - The handler is installed for SIGINT even where SIGINT was inherited
      ignored (see the module docstring); SIGHUP keeps an inherited ignore.
    - The first signal switches all three to SIG_IGN before it raises, and
      `hold` does the same on the normal path, so a second Ctrl-C landing in
      the ``finally`` cannot skip the restore. Commands the restore runs
      inherit the ignore: a Ctrl-C sent to the terminal's process group does
      not kill a ``git reset`` half-way either.
    - `deferred` covers starting ``git bisect run``: a signal then is kept and
      raised once the Popen object is known, so the child it started is
      always stopped (a KeyboardInterrupt inside Popen would leave it running).
    """

    def __init__(self) -> None:
        self.previous: dict[int, object] = {}
        self.deferring = False
        self.pending: int | None = None

    def __enter__(self) -> "_Interrupts":
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            current = signal.getsignal(s)
            self.previous[s] = current
            if not (s == signal.SIGHUP and current == signal.SIG_IGN):
                signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)

    def _handler(self, signum, frame) -> None:
        if self.deferring:
            self.pending = signum
            return
        self.hold()
        raise KeyboardInterrupt(f"signal {signum}")

    def hold(self) -> None:
        """From here on the three signals are ignored (until `__exit__`)."""
        for s in self.previous:
            signal.signal(s, signal.SIG_IGN)

    @contextmanager
    def deferred(self):
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        if self.pending is not None:
            self._handler(self.pending, None)


def _stop(proc: subprocess.Popen) -> None:
    """End git bisect run and everything under it (step, compare, engine processes): its own process group."""
    for sig, wait in ((signal.SIGTERM, _STOP_GRACE_S), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# -- the parent: drive git bisect run ----------------------------------------------------------


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
    with _Interrupts() as interrupts:
        try:
            watch = StepWatch(plan, n_commits)
            watch.saw(git(repo, "bisect", "start", bad, good, "--"))
            cmd = ["git", "-C", repo, "bisect", "run", sys.executable, "-m", "diffcheck.workflows.bisect", "--step",
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
                _stop(proc)
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


_FIRST_BAD = re.compile(r"^# first bad commit: \[([0-9a-f]{40})\]")
_POSSIBLE = re.compile(r"^# possible first bad commit: \[([0-9a-f]{40})\]")


def parse_bisect_log(text: str) -> tuple[str | None, tuple[str, ...]]:
    """(first bad commit, or None; the possible first bad commits when only skipped ones were left)."""
    first = next((m.group(1) for m in map(_FIRST_BAD.match, text.splitlines()) if m), None)
    possible = tuple(m.group(1) for m in map(_POSSIBLE.match, text.splitlines()) if m)
    return first, possible


def read_steps(path: Path) -> tuple[StepResult, ...]:
    if not path.exists():
        return ()
    return tuple(StepResult(**json.loads(line)) for line in path.read_text().splitlines() if line.strip())


def prepare(case_id: str, *, repo: str | Path, good: str, bad: str, suite: str = "default",
            goldens: str | Path | None = None, build: str | None = None, strict: bool = False,
            verbose: bool = False, step_cmd: str | None = None, log_dir: str | Path | None = None) -> Plan:
    """Check what can be checked before the repository is touched; returns the plan for `run_bisect`."""
    from diffcheck import cases as casesmod
    from diffcheck.workflows import runner
    from diffcheck.core.errors import ConfigError

    root = runner.goldens_root(goldens).resolve()
    loaded = casesmod.load_suite(suite)
    case = casesmod.get_case(loaded, case_id)
    if not case.references:
        raise ConfigError(f"case '{case_id}' has no references to compare against (it is a {case.role}); "
                          "bisect a candidate case")
    for ref in case.references:
        runner.load_golden(root, loaded.name, ref)  # missing: one line with the command that records it
    is_path = str(suite).endswith(".toml") or "/" in str(suite)
    return Plan(
        repo=str(Path(repo).resolve()), good=good, bad=bad, case_id=case_id,
        suite=str(Path(suite).resolve()) if is_path else str(suite), root=str(root),
        cases_dir=str(Path(casesmod.cases_dir()).resolve()), cwd=os.getcwd(),
        log_dir=str(log_dir) if log_dir else tempfile.mkdtemp(prefix=f"diffcheck-bisect-{case_id}-"),
        build=build, strict=strict, verbose=verbose, step_cmd=step_cmd,
    )


# -- the step: one commit ----------------------------------------------------------------------


def verdict_code(verdict: Verdict, *, strict: bool = False) -> int | None:
    """The bisect code a judged verdict maps to; None for ERROR (never cached: it may be transient)."""
    if verdict is Verdict.ERROR:
        return None
    from diffcheck.core.types import fails

    return BAD if fails(verdict, strict=strict) else GOOD


def _run_logged(cmd, *, shell: bool, cwd: str, env: dict, log_path: Path, verbose: bool) -> int:
    if verbose:  # inherit: git bisect run's output, which the parent shows in full
        return subprocess.run(cmd, shell=shell, cwd=cwd, env=env).returncode
    with open(log_path, "w") as log:
        return subprocess.run(cmd, shell=shell, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode


def _cached(led, key: str, strict: bool) -> tuple[int, Verdict] | None:
    hit = led.lookup(key)
    if hit is None or hit.verdict is None:
        return None
    code = verdict_code(hit.verdict, strict=strict)
    return None if code is None else (code, hit.verdict)


def step(plan: Plan) -> int:
    """Judge the checked-out commit; returns 0 good, 1 bad, 125 skip."""
    from diffcheck import cases as casesmod
    from diffcheck.storage import ledger
    from diffcheck.workflows import runner

    t0 = time.monotonic()
    commit = git(plan.repo, "rev-parse", "HEAD")
    subject = git(plan.repo, "log", "-1", "--format=%s")
    short = commit[:10]
    led = ledger.Ledger.open(plan.root)

    def done(verdict: str, code: int, *, reused: bool = False, runs: int = 0) -> int:
        result = StepResult(commit=commit, subject=subject, verdict=verdict, code=code, reused=reused,
                            seconds=round(time.monotonic() - t0, 2), engine_runs=runs)
        with open(Path(plan.log_dir) / "steps.jsonl", "a") as f:
            f.write(json.dumps(asdict(result)) + "\n")
        how = "from the ledger" if reused else f"{runs} engine run{'s' * (runs != 1)}"
        label = {GOOD: "good", BAD: "bad", SKIP: "skip"}[code]
        print(f"{PROGRESS}{short} {subject}: {verdict} -> {label} ({how}, {result.seconds:.1f}s)", flush=True)
        return code

    suite = casesmod.load_suite(plan.suite, cases_dir=Path(plan.cases_dir))
    case = casesmod.get_case(suite, plan.case_id)
    goldens = {r: runner.load_golden(Path(plan.root), suite.name, r) for r in case.references}
    key = ledger.key_for(case, goldens=goldens)
    hit = _cached(led, key, plan.strict)
    if hit:
        return done(hit[1].name, hit[0], reused=True)
    env = dict(os.environ)
    if plan.build:
        rc = _run_logged(plan.build, shell=True, cwd=plan.repo, env=env,
                         log_path=Path(plan.log_dir) / f"{short}-build.log", verbose=plan.verbose)
        if rc != 0:
            return done(f"build failed (exit {rc})", SKIP)
        after = ledger.key_for(case, goldens=goldens)  # a build that rewrites tracked files changes the code state
        if after != key:
            key = after
            hit = _cached(led, key, plan.strict)
            if hit:
                return done(hit[1].name, hit[0], reused=True)
    before = led.engine_runs(plan.case_id)
    if plan.step_cmd:
        cmd, shell = plan.step_cmd, True
    else:
        cmd = [sys.executable, "-m", "diffcheck.cli", "compare", plan.case_id, "--suite", plan.suite,
               "--bisect-codes"] + (["--strict"] if plan.strict else [])
        shell = False
    rc = _run_logged(cmd, shell=shell, cwd=plan.cwd, env=env,
                     log_path=Path(plan.log_dir) / f"{short}-compare.log", verbose=plan.verbose)
    runs = led.engine_runs(plan.case_id) - before
    entry = led.lookup(key)
    judged = entry.verdict if entry is not None else None
    if rc == GOOD:
        return done(judged.name if judged else "pass", GOOD, runs=runs)
    if rc == BAD and judged is not None and verdict_code(judged, strict=plan.strict) == BAD:
        return done(judged.name, BAD, runs=runs)
    if rc == BAD:
        # Exit 1 is also what Python gives an uncaught exception: without the
        # regression verdict in the ledger it is a crash, and a crash is skipped, never blamed.
        return done("crashed (exit 1, no verdict)", SKIP, runs=runs)
    return done(f"engine failure (exit {rc})", SKIP, runs=runs)


def main(argv: list[str] | None = None) -> int:
    """``python -m diffcheck.workflows.bisect --step PLAN.json``: the command git bisect run calls."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "--step":
        print("usage: python -m diffcheck.workflows.bisect --step PLAN.json (run by `diffcheck bisect`)", file=sys.stderr)
        return ABORT
    plan = Plan(**json.loads(Path(args[1]).read_text()))
    try:
        return step(plan)
    except EngineError as exc:
        print(f"{PROGRESS}engine failure: {exc.message} -> skip", flush=True)
        return SKIP
    except DiffcheckError as exc:
        # The same at every commit (a missing golden, a bad suite): stop rather than skip them all.
        print(f"{PROGRESS}error: {exc.message} -> abort", flush=True)
        return ABORT
    except Exception:
        import traceback

        traceback.print_exc()
        print(f"{PROGRESS}internal error in the bisect step -> abort", flush=True)
        return ABORT


if __name__ == "__main__":
    sys.exit(main())
