"""`diffcheck compare ID`: judge a candidate against each of its reference goldens."""

from __future__ import annotations

import click

from diffcheck.cli.common import goldens_option, output_option, suite_option


@click.command(name="compare", epilog="""\b
Examples:
  diffcheck compare O                          # run O, judge it against J's golden
  diffcheck compare E --html reports/E.html    # a labelled fault, as an HTML report
""")
@click.argument("case_id")
@suite_option
@goldens_option
@click.option("--run", "run_file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Judge a recorded run instead of running the engine (offline; forced/scored files beside it are used).")
@output_option("--json", help="Write a JSON report.")
@output_option("--junit", help="Write a JUnit XML report.")
@output_option("--html", help="Write a self-contained HTML report.")
@click.option("--strict", is_flag=True, help="A precision cost (WITHIN_BUDGET) fails too.")
@click.option("--allow-inconclusive", is_flag=True, help="Accept an INCONCLUSIVE verdict (too little evidence to decide) as a pass.")
@click.option("--force", is_flag=True, help="Run the engine even if the ledger holds an identical run.")
@click.option("--bisect-codes", is_flag=True, help="Exit 125 instead of 3 on engine failure or 4 on INCONCLUSIVE (for `git bisect run`: skip).")
@click.option("--replay", type=click.Choice(["partial", "full"]), default=None,
              help="Forced replay: only diverged sequences from their t* (partial), or every sequence from step 0 "
                   "(full; when the decode path at t* matters). Default: partial, full for a case tagged "
                   "replay-full or a fault that counts decode steps.")
@click.option("--own-golden", is_flag=True,
              help="A reference case: also judge a fresh run against its own golden (automatic for a reference "
                   "without references).")
@click.option("--until-decided", is_flag=True,
              help="Extend INCONCLUSIVE sequences look after look (the reference's continuation, the candidate "
                   "forced along it, steps doubling) until decided or --max-tokens; alpha is split over the planned "
                   "looks (Bonferroni). Needs the engines: not with --run.")
@click.option("--max-tokens", "max_tokens", default=None, metavar="N",
              help="With --until-decided: the longest path (decode steps per sequence) a sequence is extended to "
                   "(default 1024).")
@click.pass_context
def compare(ctx, case_id, suite, goldens, run_file, json_path, junit_path, html_path, strict, allow_inconclusive,
            force, bisect_codes, replay, own_golden, until_decided, max_tokens):
    """Run candidate CASE_ID (or read --run FILE) and judge it against its reference goldens.

    A reference case (J) is re-run with today's code and engine and judged against its own
    stored golden and noise floor, as any candidate is; the fresh run is stored as
    J.run.parquet, never over the golden.

    The case's verdict is its worst sequence's, and the exit code is that verdict's under
    the one pass/fail policy: which verdicts pass, with and without --strict, is the table
    in docs/verdicts.md; the exit codes are listed in `diffcheck --help`.
    """
    from pathlib import Path

    from diffcheck import api, cases
    from diffcheck.cli.common import echo_for, outputs, write_reports
    from diffcheck.core import progress
    from diffcheck.storage import ledger, store
    from diffcheck.engines import models
    from diffcheck import workspace
    from diffcheck.core.errors import EXIT_BISECT_SKIP, EXIT_ENGINE, DiffcheckError
    from diffcheck.report import report_input, speed_summary
    from diffcheck.report.results import ComparisonReport

    from diffcheck.core.errors import ConfigError
    from diffcheck.workflows import sequential

    if max_tokens is not None and not until_decided:
        raise ConfigError("--max-tokens is valid only with --until-decided (the budget of a sequential extension)")
    if until_decided and run_file:
        raise ConfigError("--until-decided needs the engines to extend a sequence; it is not valid with --run FILE")
    if until_decided:
        max_tokens = sequential.check_max_tokens(sequential.DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)
    requested = outputs("comparison", json=json_path, junit=junit_path, html=html_path)
    echo = echo_for(requested)
    try:
        s = cases.load_suite(suite)
        root = workspace.goldens_root(goldens)
        with progress.display(verbose=ctx.obj.get("verbose", False)) as shown:
            shown.stage(f"compare {case_id}" + (" --until-decided" if until_decided else ""))
            if until_decided:
                comparison = sequential.until_decided(s, case_id, root=root, max_tokens=max_tokens,
                                                      verbose=ctx.obj.get("verbose", False), force=force,
                                                      echo=shown.log, replay=replay, own_golden=own_golden or None)
            else:
                comparison = api.compare_case(case_id, suite=s, goldens=root,
                                              run_file=Path(run_file) if run_file else None,
                                              verbose=ctx.obj.get("verbose", False), force=force, echo=shown.log,
                                              replay=replay, own_golden=own_golden or None)
    except DiffcheckError as exc:
        if bisect_codes and exc.exit_code == EXIT_ENGINE:
            exc.exit_code = EXIT_BISECT_SKIP
        raise
    for line in comparison.reused:
        echo(line)
    meta = {"suite": s.name, "candidate": case_id, "references": [v.reference_id for v in comparison.verdicts],
            "command": "diffcheck compare " + case_id + (f" --run {run_file}" if run_file else "")
            + (f" --until-decided --max-tokens {max_tokens}" if until_decided else "")}
    if comparison.candidate is not None:
        meta["engine"] = {k: comparison.candidate.meta.engine.get(k) for k in ("name", "version", "commit", "forcing_mechanism")}
        meta["hardware"] = comparison.candidate.meta.hardware
    speed = speed_summary(comparison.candidate, comparison.goldens, comparison.forced)
    tokenizer = models.load_tokenizer(cases.get_case(s, case_id).model) if comparison.candidate is not None else None
    notes = ()
    if comparison.candidate is not None:
        digest = store.output_digest(comparison.candidate)
        same = ledger.Ledger.open(root).same_output(digest, exclude_case=case_id)
        if same:
            notes = (f"same output as {', '.join(sorted(same))} (output digest {digest[:12]})",)
    write_reports(requested, ComparisonReport(report_input(comparison, meta, speed, tokenizer=tokenizer),
                                              strict=strict, notes=notes))
    from diffcheck.core.types import exit_code

    return exit_code(comparison.verdict, strict=strict, bisect_codes=bisect_codes,
                     allow_inconclusive=allow_inconclusive)
