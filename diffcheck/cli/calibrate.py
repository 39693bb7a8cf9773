"""`diffcheck calibrate [IDS]`: measure each reference's noise floor (replicas along its golden)."""

from __future__ import annotations

import click

from diffcheck.cli.common import goldens_option, suite_option


@click.command(name="calibrate", epilog="""\b
Examples:
  diffcheck calibrate                 # every reference the default suite's candidates use
  diffcheck calibrate J --add unbatched=goldens/default/F.parquet --description "max_num_seqs=1"
""")
@click.argument("case_ids", nargs=-1)
@suite_option
@goldens_option
@click.option("--add", "add", metavar="NAME=RUN_FILE", default=None,
              help="Add a recorded run (e.g. the same reference under another backend, or from another machine) "
                   "to the floor of the one reference named, instead of running replicas.")
@click.option("--description", default="", help="What the added run's harmless perturbation is (with --add).")
@click.pass_context
def calibrate(ctx, case_ids, suite, goldens, add, description):
    """Record the noise floor of references: replicas of each reference under harmless
    perturbations (a fresh engine, other batch shapes), teacher-forced along its golden.

    Without IDS: every reference that a candidate of the suite judges against (cases
    tagged slow or gpu only when named). Replicas that are up to date are kept.
    """
    from pathlib import Path

    from diffcheck import cases
    from diffcheck.core import progress
    from diffcheck.core.errors import ConfigError
    from diffcheck import workspace
    from diffcheck.workflows import calibrate as cal
    from diffcheck.storage import store

    s = cases.load_suite(suite)
    root = workspace.goldens_root(goldens)
    if add is not None:
        name, sep, file = add.partition("=")
        if not sep or len(case_ids) != 1:
            raise ConfigError("--add NAME=RUN_FILE needs exactly one reference id, e.g. "
                              "`diffcheck calibrate J --add flash=runs/F.parquet`")
        path = cal.add_replica(root, s.name, case_ids[0], name, store.read_run(Path(file)),
                               description=description or f"recorded run {file}")
        click.echo(f"added {path}")
        return 0
    wanted = list(case_ids) or sorted({r for c in s.cases.values() if c.role == "candidate"
                                       and not cases.not_by_default(c) for r in c.references})
    for ref_id in wanted:
        case = cases.get_case(s, ref_id)
        if case.role != "reference":
            raise ConfigError(f"{cases.display_path(s.path)}: case '{ref_id}' is a {case.role}; "
                              "only references have a noise floor")
        golden = workspace.load_golden(root, s.name, ref_id)
        with progress.display(verbose=ctx.obj.get("verbose", False)) as shown:
            floor = cal.calibrate(case, root=root, golden=golden, perturbations=cal.PERTURBATIONS,
                                  verbose=ctx.obj.get("verbose", False), echo=shown.log)
        click.echo(f"{ref_id}: {floor.describe()}")
    return 0
