"""`diffcheck matrix [IDS...]`: goldens, every comparison, the seed's table and a narrowing of the verdicts."""

from __future__ import annotations

import click

from diffcheck.cli.common import goldens_option, output_option, suite_option


@click.command(name="matrix", epilog="""\b
Examples:
  diffcheck matrix                                # the default suite (slow, gpu left out)
  diffcheck matrix J O E --md reports/matrix.md   # three cases, a Markdown table
""")
@click.argument("case_ids", nargs=-1)
@suite_option
@goldens_option
@output_option("--md", help="Write the table, the narrowing and the next cases as Markdown.")
@output_option("--json", help="Write the table, the narrowing and each compared case's report as one JSON document.")
@output_option("--junit", help="Write every comparison's verdicts as one JUnit XML file.")
@output_option("--html", help="Write every comparison as one self-contained HTML report.")
@click.option("--from-outcomes", "outcomes_path", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Narrow recorded outcomes (one line per case id) instead of running anything.")
@click.option("--baseline", default=None, metavar="ID",
              help="Factors are taken relative to this case (default: the suite's first reference).")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
              help="Run the engine work as Ray tasks: --ray alone starts a local cluster bound to 127.0.0.1; "
                   "--ray=HOST:PORT (or auto) joins one (install diffcheck[ray]).")
@click.option("--cpus-per-rank", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="With --ray: CPUs a CPU case reserves per tensor/pipeline-parallel rank.")
@click.option("--strict", is_flag=True, help="A precision cost (WITHIN_BUDGET) fails too.")
@click.option("--allow-inconclusive", is_flag=True, help="Accept an INCONCLUSIVE verdict (too little evidence to decide) as a pass.")
@click.option("--force", is_flag=True, help="Run every candidate again even when the ledger holds an identical run.")
@click.pass_context
def matrix(ctx, case_ids, suite, goldens, md_path, json_path, junit_path, html_path, outcomes_path, baseline,
           ray_address, cpus_per_rank, strict, allow_inconclusive, force):
    """Run a suite's matrix: goldens first, then every candidate against its references.

    Without CASE_IDS, every case of the suite except those tagged slow or gpu. Each run
    goes through the ledger, so nothing runs twice and an interrupted matrix resumes.
    Prints the seed's table (config delta, verdict, onset, tokens/s, text metrics,
    same-output groups), then narrows the cause: the smallest conjunctions of config
    factors true in every bad case and in no clean one, and the next cases worth running.

    The exit code is the worst verdict's, as for `diffcheck compare` (docs/verdicts.md);
    --from-outcomes runs nothing and exits 0.
    """
    import time

    from rich.console import Console

    from diffcheck import cases
    from diffcheck.cli.common import echo_for, outputs, write_reports
    from diffcheck.core.errors import ConfigError
    from diffcheck.workflows import matrix as mx
    from diffcheck.engines import models
    from diffcheck import workspace
    from diffcheck.report.results import MatrixReport

    requested = outputs("outcomes" if outcomes_path else "matrix", markdown=md_path, json=json_path,
                        junit=junit_path, html=html_path)
    say = echo_for(requested)
    s = cases.load_suite(suite)
    if baseline is not None:
        cases.get_case(s, baseline)
    if outcomes_path:
        if case_ids or ray_address:
            raise ConfigError("--from-outcomes runs nothing: give no case ids and no --ray")
        result = mx.from_outcomes(s, outcomes_path)
    else:
        address = mx.check_ray_address(ray_address)
        root = workspace.goldens_root(goldens)
        console = Console(stderr=True)
        t0 = time.perf_counter()
        with console.status(f"matrix: suite {s.name}") as status:
            def echo(msg):
                status.update(msg)
                console.log(msg, markup=False, highlight=False)

            result = mx.run_matrix(s, case_ids, root=root, echo=echo, force=force,
                                   verbose=ctx.obj.get("verbose", False), strict=strict, baseline=baseline,
                                   ray=address, cpus_per_rank=cpus_per_rank)
        say(f"matrix: {len(result.comparisons)} comparisons, {result.engine_runs} engine runs recorded in the "
            f"ledger, {time.perf_counter() - t0:.0f}s"
            + (f"; left out (slow/gpu, name them to run): {', '.join(result.left_out)}" if result.left_out else ""))
    write_reports(requested, MatrixReport(result, strict=strict, from_outcomes=bool(outcomes_path),
                                          tokenizer_for=lambda cid: models.load_tokenizer(cases.get_case(s, cid).model)))
    if outcomes_path:
        return 0
    from diffcheck.core.types import exit_code

    return exit_code(result.verdict, strict=strict, allow_inconclusive=allow_inconclusive)
