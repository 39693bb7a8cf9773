"""`diffcheck check [--suite S]`: every reference against its golden, every candidate against its references."""

from __future__ import annotations

import click

from diffcheck.cli.common import goldens_option, suite_option


@click.command(name="check")
@suite_option
@goldens_option
@click.option("--case", "case_ids", multiple=True, help="Only these cases (repeatable); tagged and labelled cases too.")
@click.option("--strict", is_flag=True, help="WITHIN_BUDGET (a precision cost inside its budget) fails (exit 1) too.")
@click.option("--force", is_flag=True, help="Run the engines even where the ledger holds identical runs.")
@click.option("--replay", type=click.Choice(["partial", "full"]), default=None,
              help="Forced replay mode, as for `diffcheck compare`.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every verdict and the goldens' moves as JSON.")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False), default=None, help="Write a JUnit XML report.")
@click.pass_context
def check(ctx, suite, goldens, case_ids, strict, force, replay, json_path, junit_path):
    """Check the whole suite the way CI wants it, with one exit code.

    Every reference is re-run with today's code and engine and judged against its own
    golden (and its noise floor); every candidate against its references. Labelled faults
    (expect = a failing verdict) are left to `diffcheck selftest`, cases tagged slow or gpu
    run only when named with --case.

    After an engine upgrade the goldens section says which goldens moved and whether each
    move is benign: the input to `diffcheck golden record IDS --update`.

    Exit 0 when every verdict passes (IDENTICAL, BENIGN_DRIFT, WITHIN_BUDGET; not the last
    with --strict), 1 on a regression, 3 on an engine failure, 2 on bad input.
    """
    from diffcheck import cases
    from diffcheck.core import progress
    from diffcheck.workflows import check as checking, runner
    from diffcheck.report import render_table, write_json, write_junit
    from diffcheck.report.terminal import make_console

    s = cases.load_suite(suite)
    root = runner.goldens_root(goldens)
    verbose = ctx.obj.get("verbose", False)
    with progress.display(verbose=verbose) as shown:
        result = checking.run_check(s, root=root, include=set(case_ids) or None, verbose=verbose, force=force,
                                    replay=replay, echo=shown.log)
    out = make_console()
    for comparison in result.comparisons.values():
        for line in comparison.reused:
            click.echo(line)
    render_table(result.verdicts, out)
    for case_id, why in result.skipped:
        click.echo(f"left out: {case_id}: {why}")
    if result.goldens:
        click.echo(f"goldens of suite {s.name} (each reference re-run with today's engine against its golden):")
        for move in result.goldens:
            click.echo(f"  {move.case_id:<6} {move.verdict.name:<13} {move.describe(suite)}")
        moved = [m for m in result.goldens if m.moved]
        if moved:
            benign = [m.case_id for m in moved if m.benign]
            bad = [m.case_id for m in moved if not m.benign]
            click.echo(f"moved: {', '.join(m.case_id for m in moved)}"
                       + (f"; benign: {', '.join(benign)}" if benign else "")
                       + (f"; NOT benign: {', '.join(bad)}" if bad else ""))
            if benign and not bad:
                click.echo(f"to accept the new engine's goldens: diffcheck golden record {' '.join(benign)} --update "
                           f"--suite {suite}")
        else:
            click.echo("no golden moved")
    code = result.exit_code(strict=strict)
    rows = [(v.candidate_id, v.reference_id, v.verdict.name) for v in result.verdicts]
    click.echo(f"check: {len(rows)} comparisons, worst {result.verdict.name}, exit {code}")
    meta = {"suite": s.name, "command": "diffcheck check", "strict": strict,
            "goldens": [{"case": m.case_id, "verdict": m.verdict.name, "moved": m.moved, "benign": m.benign,
                         "recorded_with": m.recorded_with, "now": m.now, "config_changed": m.config_changed,
                         "spec_change": {k: list(v) for k, v in m.spec_change.items()}} for m in result.goldens],
            "skipped": [{"case": c, "why": w} for c, w in result.skipped], "exit_code": code}
    if json_path:
        write_json(json_path, result.verdicts, meta)
        click.echo(f"wrote {json_path}")
    if junit_path:
        write_junit(junit_path, result.verdicts, strict=strict, name=f"diffcheck check {s.name}")
        click.echo(f"wrote {junit_path}")
    return code
