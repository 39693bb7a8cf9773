"""`diffcheck check [--suite S]`: every reference against its golden, every candidate against its references."""

from __future__ import annotations

import click

from diffcheck.cli.common import goldens_option, output_option, suite_option


@click.command(name="check", epilog="""\b
Examples:
  diffcheck check                                         # the default suite, for CI
  diffcheck check --case O --case D --junit reports/check.xml
""")
@suite_option
@goldens_option
@click.option("--case", "case_ids", multiple=True, help="Only these cases (repeatable); tagged and labelled cases too.")
@click.option("--strict", is_flag=True, help="A precision cost (WITHIN_BUDGET) fails too.")
@click.option("--allow-inconclusive", is_flag=True, help="Accept an INCONCLUSIVE verdict (too little evidence to decide) as a pass.")
@click.option("--force", is_flag=True, help="Run the engines even where the ledger holds identical runs.")
@click.option("--replay", type=click.Choice(["partial", "full"]), default=None,
              help="Forced replay mode, as for `diffcheck compare`.")
@output_option("--json", help="Write every verdict and the goldens' moves as JSON.")
@output_option("--junit", help="Write a JUnit XML report.")
@click.pass_context
def check(ctx, suite, goldens, case_ids, strict, allow_inconclusive, force, replay, json_path, junit_path):
    """Check the whole suite the way CI wants it, with one exit code.

    Every reference is re-run with today's code and engine and judged against its own
    golden (and its noise floor); every candidate against its references. Labelled faults
    (expect = a failing verdict) are left to `diffcheck selftest`, cases tagged slow or gpu
    run only when named with --case.

    After an engine upgrade the goldens section says which goldens moved and whether each
    move is benign: the input to `diffcheck golden record IDS --update`.

    The exit code is the worst verdict's under the one pass/fail policy: which verdicts
    pass, with and without --strict, is the table in docs/verdicts.md; the exit codes are
    listed in `diffcheck --help`.
    """
    from diffcheck import cases
    from diffcheck.cli.common import echo_for, outputs, write_reports
    from diffcheck.core import progress
    from diffcheck import workspace
    from diffcheck.workflows import check as checking
    from diffcheck.report.results import CheckReport

    requested = outputs("check", json=json_path, junit=junit_path)
    echo = echo_for(requested)
    s = cases.load_suite(suite)
    root = workspace.goldens_root(goldens)
    verbose = ctx.obj.get("verbose", False)
    with progress.display(verbose=verbose) as shown:
        result = checking.run_check(s, root=root, include=set(case_ids) or None, verbose=verbose, force=force,
                                    replay=replay, strict=strict, echo=shown.log)
    for comparison in result.comparisons.values():
        for line in comparison.reused:
            echo(line)
    from diffcheck.core.types import exit_code

    code = exit_code(result.verdict, strict=strict, allow_inconclusive=allow_inconclusive)
    meta = {"suite": s.name, "command": "diffcheck check", "strict": strict,
            "goldens": [{"case": m.case_id, "verdict": m.verdict.name, "moved": m.moved, "benign": m.benign,
                         "recorded_with": m.recorded_with, "now": m.now, "config_changed": m.config_changed,
                         "spec_change": {k: list(v) for k, v in m.spec_change.items()}} for m in result.goldens],
            "skipped": [{"case": c, "why": w} for c, w in result.skipped], "exit_code": code}
    write_reports(requested, CheckReport(verdicts=result.verdicts, meta=meta, suite=s.name, suite_option=suite,
                                         goldens=tuple(result.goldens), skipped=tuple(result.skipped),
                                         exit_code=code, strict=strict))
    return code
