"""`diffcheck run ID`: record one case's run (and its forced replays) beside the goldens."""

from __future__ import annotations

import click

from diffcheck.cli.common import goldens_option, suite_option


@click.command(name="run", epilog="""\b
Examples:
  diffcheck run O                  # then: diffcheck compare O --run goldens/default/O.run.parquet
  diffcheck run E --replay full    # every sequence forced from step 0
""")
@click.argument("case_id")
@suite_option
@goldens_option
@click.option("--force", is_flag=True, help="Run the engine even if the ledger holds an identical run.")
@click.option("--replay", type=click.Choice(["partial", "full"]), default=None,
              help="Forced replay: only diverged sequences from their t* (partial), or every sequence from step 0 (full).")
@click.pass_context
def run(ctx, case_id, suite, goldens, force, replay):
    """Generate CASE_ID and teacher-force it along each recorded reference golden.

    Writes <case>.run.parquet and <case>.forced-<ref>.parquet beside the goldens, so
    `diffcheck compare CASE_ID --run FILE` can judge it later without an engine.
    """
    from diffcheck import cases
    from diffcheck.core import progress
    from diffcheck.workflows import compare as comparemod
    from diffcheck import workspace
    from diffcheck.storage import store

    s = cases.load_suite(suite)
    case = cases.get_case(s, case_id)
    root = workspace.goldens_root(goldens)
    goldens_ = {}
    for ref in case.references:
        path = store.run_path(root, s.name, ref)
        if path.exists():
            goldens_[ref] = store.read_run(path)
        else:
            click.echo(f"no golden for {ref} yet: recording without forced replay along it")
    with progress.display(verbose=ctx.obj.get("verbose", False)) as shown:
        echo = shown.log
        cand, forced, reused = comparemod.run_candidate(case, list(goldens_), goldens_, root=root,
                                                    verbose=ctx.obj.get("verbose", False), force=force, echo=echo,
                                                    replay=replay)
    for line in reused:
        click.echo(line)
    click.echo(f"{case_id}: {cand.n_tokens} tokens -> {store.run_path(root, s.name, case_id, role='candidate')}")
    for ref in forced:
        click.echo(f"{case_id}: forced along {ref} -> {store.run_path(root, s.name, case_id, kind='forced', reference=ref)}")
    return 0
