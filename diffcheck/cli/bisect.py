"""`diffcheck bisect CASE --repo PATH --good REV --bad REV`: the commit that broke a case.

Checks everything it can before touching the repository (the suite, the case,
its goldens, the revisions, a clean work tree), then hands over to
`diffcheck.workflows.bisect.run_bisect` and renders its result: the first bad commit with
subject and diffstat, the per-commit verdict table, the engine runs it took.

Exit codes: 0 a first bad commit was found, 2 usage error, 3 the bisect could
not conclude (only skipped commits left, or the step aborted), 130 interrupted.
"""

from __future__ import annotations

import click

from diffcheck.cli.common import goldens_option, suite_option


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def render_table(steps) -> list[str]:
    """The per-commit verdict table, in the order the commits were tested."""
    head = f"{'commit':<10}  {'subject':<36}  {'verdict':<24}  {'exit':>4}  {'reused':<6}  {'runs':>4}  {'seconds':>7}"
    rows = [head, "-" * len(head)]
    for s in steps:
        rows.append(f"{s.commit[:10]:<10}  {_short(s.subject, 36):<36}  {_short(s.verdict, 24):<24}  {s.code:>4}  "
                    f"{'yes' if s.reused else 'no':<6}  {s.engine_runs:>4}  {s.seconds:>7.1f}")
    return rows


def render(result, *, ledger_path) -> list[str]:
    out = [""]
    if result.first_bad:
        out.append(f"first bad commit: {result.first_bad} {result.subject}")
        out += [f"  {line.strip()}" for line in result.diffstat.splitlines() if line.strip()]
    else:
        out.append(f"no first bad commit: {result.failure}")
        if result.candidates:
            out.append("only skipped commits were left; the first bad commit is one of:")
            out += [f"  {sha}" for sha in result.candidates]
    out.append("")
    out += render_table(result.steps)
    tested = sum(1 for s in result.steps if not s.reused)
    out.append("")
    out.append(f"engine runs: {result.engine_runs} for {len(result.steps)} steps over {result.n_commits} commits; "
               f"{len(result.steps) - tested} steps answered from the ledger ({ledger_path})")
    out.append(f"repository restored: {result.restored.describe()}")
    if result.left_behind:
        out.append("untracked files that appeared during the bisect (left in place): "
                   + ", ".join(line[3:] for line in result.left_behind))
    out.append(f"logs: {result.log_dir}")
    return out


@click.command(name="bisect", epilog="""\b
Examples:
  diffcheck bisect O --repo ../vllm --good v0.31.0 --bad v0.32.0
  diffcheck bisect O --repo ../vllm --good v0.31.0 --bad HEAD --build "pip install -e ."
""")
@click.argument("case_id")
@click.option("--repo", required=True, type=click.Path(exists=True, file_okay=False),
              help="The engine's git repository (vLLM source tree, plugin or package), used through PYTHONPATH.")
@click.option("--good", required=True, metavar="REV", help="A revision where CASE passes.")
@click.option("--bad", required=True, metavar="REV", help="A revision where CASE regresses.")
@click.option("--build", metavar="CMD", default=None,
              help="Shell command run in the repository at each commit; failure skips the commit (125).")
@suite_option
@goldens_option
@click.option("--strict", is_flag=True, help="A precision cost (WITHIN_BUDGET) fails too.")
@click.option("--step-cmd", default=None, hidden=True,
              help="Tests only: a shell command used instead of `diffcheck compare` (same exit codes).")
@click.pass_context
def bisect(ctx, case_id, repo, good, bad, build, suite, goldens, strict, step_cmd):
    """Find the first commit of --repo at which CASE regresses (git bisect run).

    At each commit: look the run up in the ledger (a cached verdict costs no
    engine run), else run --build, then `diffcheck compare CASE --bisect-codes`
    with PYTHONPATH=REPO. Verdicts map to bisect codes: pass 0, regression 1,
    build or engine failure 125 (skip). The repository's branch, HEAD and work
    tree are restored afterwards, also after Ctrl-C or an engine crash.
    """
    from pathlib import Path

    from diffcheck.workflows import bisect as bisecting

    plan = bisecting.prepare(case_id, repo=repo, good=good, bad=bad, suite=suite, goldens=goldens, build=build,
                             strict=strict, verbose=bool((ctx.obj or {}).get("verbose")), step_cmd=step_cmd)
    from diffcheck.core import progress

    with progress.display(verbose=plan.verbose) as shown:
        # Lines above a live display go through it; plain output stays on stdout as before.
        result = bisecting.run_bisect(plan, echo=shown.log if shown.live else click.echo)
    from diffcheck.storage.ledger import FILENAME

    for line in render(result, ledger_path=Path(plan.root) / FILENAME):
        click.echo(line)
    return result.exit_code
