"""One step of ``diffcheck bisect``: judge the checked-out commit and tell ``git bisect run``.

``git bisect run`` calls ``python -m diffcheck.workflows.bisect_step --step PLAN`` at
each commit (`diffcheck.workflows.bisect.run_bisect` starts it). The step

1. looks the commit's run up in the ledger: a cached verdict answers at once,
   so a repeated bisect costs no engine run;
2. runs ``--build`` in the repository: failure -> skip (125, never blamed);
3. runs ``diffcheck compare CASE --suite S --bisect-codes`` in a subprocess with
   ``PYTHONPATH=<repo>:...`` (each commit's code is imported fresh): its exit code
   is what git is told, except that exit 1 counts as bad only when the ledger
   holds a regression verdict for this commit's run (Python exits 1 on an uncaught
   exception too), and any other code (engine failure, crash) is a skip.

What a verdict means for git comes from the policy alone (`core.types.exit_code`
with ``bisect_codes``: pass 0, regression 1, ERROR 125) and the `EXIT_*` constants;
an ERROR in the ledger is never reused (an engine failure may be transient).
`ABORT` (128) is git's own rule: ``git bisect run`` stops on an exit >= 128, which
an error that would recur at every commit (a missing golden, a bad suite) must do
rather than skip them all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from diffcheck.core.errors import EXIT_BISECT_SKIP, EXIT_PASS, EXIT_REGRESSION, DiffcheckError, EngineError
from diffcheck.core.types import Verdict, exit_code
from diffcheck.workflows.bisect import PROGRESS, Plan, StepResult
from diffcheck.workflows.git_bisect import git

ABORT = 128  # git bisect run aborts on >= 128: an internal error must not be "skipped" at every commit
_LABELS = {EXIT_PASS: "good", EXIT_REGRESSION: "bad", EXIT_BISECT_SKIP: "skip"}


def verdict_code(verdict: Verdict, *, strict: bool = False) -> int | None:
    """What a verdict found in the ledger tells git: the policy's exit code under
    ``--bisect-codes``; None for ERROR, which is never reused (it may be transient)."""
    if verdict is Verdict.ERROR:
        return None
    return exit_code(verdict, strict=strict, bisect_codes=True)


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
    """Judge the checked-out commit; returns what git is told: 0 good, 1 bad, 125 skip."""
    from diffcheck import cases as casesmod
    from diffcheck import workspace
    from diffcheck.storage import ledger

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
        print(f"{PROGRESS}{short} {subject}: {verdict} -> {_LABELS[code]} ({how}, {result.seconds:.1f}s)", flush=True)
        return code

    suite = casesmod.load_suite(plan.suite, cases_dir=Path(plan.cases_dir))
    case = casesmod.get_case(suite, plan.case_id)
    goldens = {r: workspace.load_golden(Path(plan.root), suite.name, r) for r in case.references}
    key = workspace.ledger_key(case, goldens=goldens)
    hit = _cached(led, key, plan.strict)
    if hit:
        return done(hit[1].name, hit[0], reused=True)
    env = dict(os.environ)
    if plan.build:
        rc = _run_logged(plan.build, shell=True, cwd=plan.repo, env=env,
                         log_path=Path(plan.log_dir) / f"{short}-build.log", verbose=plan.verbose)
        if rc != 0:
            return done(f"build failed (exit {rc})", EXIT_BISECT_SKIP)
        after = workspace.ledger_key(case, goldens=goldens)  # a build that rewrites tracked files changes the code state
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
    if rc == EXIT_PASS:
        return done(judged.name if judged else "pass", EXIT_PASS, runs=runs)
    if rc == EXIT_REGRESSION and judged is not None and verdict_code(judged, strict=plan.strict) == EXIT_REGRESSION:
        return done(judged.name, EXIT_REGRESSION, runs=runs)
    if rc == EXIT_REGRESSION:
        # Exit 1 is also what Python gives an uncaught exception: without the
        # regression verdict in the ledger it is a crash, and a crash is skipped, never blamed.
        return done("crashed (exit 1, no verdict)", EXIT_BISECT_SKIP, runs=runs)
    if judged is Verdict.INCONCLUSIVE:  # 125 too: undecided is skipped, never called good
        return done("INCONCLUSIVE", EXIT_BISECT_SKIP, runs=runs)
    return done(f"engine failure (exit {rc})", EXIT_BISECT_SKIP, runs=runs)


def main(argv: list[str] | None = None) -> int:
    """``python -m diffcheck.workflows.bisect_step --step PLAN.json``: the command git bisect run calls."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "--step":
        print("usage: python -m diffcheck.workflows.bisect_step --step PLAN.json (run by `diffcheck bisect`)",
              file=sys.stderr)
        return ABORT
    plan = Plan(**json.loads(Path(args[1]).read_text()))
    try:
        return step(plan)
    except EngineError as exc:
        print(f"{PROGRESS}engine failure: {exc.message} -> skip", flush=True)
        return EXIT_BISECT_SKIP
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
