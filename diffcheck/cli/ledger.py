"""`diffcheck ledger`: every recorded run, grouped by identical output.

Reads ``<goldens root>/ledger.sqlite`` (see `diffcheck.storage.ledger`); never runs an
engine. Each group is one output content digest: the cases in a group produced
exactly the same tokens and logprobs (the seed log's "same bad hash as E").
"""

from __future__ import annotations

import click

from diffcheck.cli.common import goldens_option, json_option, write_json_out


def _row(entry) -> dict:
    return {
        "id": entry.id, "created": entry.created, "suite": entry.suite, "case": entry.case_id, "kind": entry.kind,
        "role": entry.role, "verdict": entry.verdict.name if entry.verdict else None, "code": entry.code,
        "engine_version": entry.engine_version, "engine_commit": entry.engine_commit,
        "engine_dirty": entry.engine_dirty, "config_digest": entry.config_digest, "model_digest": entry.model_digest,
        "output_digest": entry.output_digest, "key": entry.key, "seconds": round(entry.seconds, 2),
        "path": entry.path,
    }


def render_groups(groups) -> list[str]:
    lines = []
    for group in groups:
        cases = sorted({e.case_id for e in group})
        runs = f"{len(group)} run{'s' * (len(group) != 1)}"
        lines.append(f"output {group[0].output_digest[:12]}  {runs}  cases: {', '.join(cases)}")
        for e in group:
            verdict = e.verdict.name if e.verdict else "-"
            lines.append(f"  #{e.id:<4} {e.created:<25} {e.suite}/{e.case_id:<12} {e.role:<9} {verdict:<13} "
                         f"{e.seconds:>6.1f}s  {e.code}")
        lines.append("")
    return lines


@click.command(name="ledger", epilog="""\b
Examples:
  diffcheck ledger --case O      # O's runs, grouped by identical output
  diffcheck ledger --json -      # every run as JSON, on stdout
""")
@goldens_option
@click.option("--suite", "-s", default=None, help="Only runs of this suite.")
@click.option("--case", "case_id", default=None, help="Only runs of this case id.")
@json_option
def ledger(goldens, suite, case_id, json_path):
    """List recorded runs, grouped by identical output (content digest).

    Every run an engine executed is in the ledger with its config digest,
    engine version and commit, model digest, output digest, verdict and
    timings. Runs in one group produced exactly the same output.
    """

    from diffcheck.storage import ledger as ledgermod
    from diffcheck import workspace
    from diffcheck.core.errors import DataError

    root = workspace.goldens_root(goldens)
    path = root / ledgermod.FILENAME
    if not path.exists():
        raise DataError(f"{path}: no ledger yet; it is created by the first `diffcheck golden record` or "
                        "`diffcheck compare` (or pass --goldens)")
    led = ledgermod.Ledger.open(root)
    groups = led.groups(case_id=case_id, suite=suite)
    if json_path:
        out = {"ledger": str(path), "groups": [{"output_digest": g[0].output_digest,
                                                "cases": sorted({e.case_id for e in g}),
                                                "runs": [_row(e) for e in g]} for g in groups]}
        write_json_out(json_path, out)
        return 0
    n = sum(len(g) for g in groups)
    click.echo(f"ledger {path}: {n} run{'s' * (n != 1)}, {len(groups)} distinct output{'s' * (len(groups) != 1)}")
    click.echo("")
    for line in render_groups(groups):
        click.echo(line)
    return 0
