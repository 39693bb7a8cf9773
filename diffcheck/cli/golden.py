"""`diffcheck golden record | verify | show | export`: the golden life cycle."""

from __future__ import annotations

import click

from diffcheck.cli.common import goldens_option, suite_option


@click.group(name="golden", epilog="""\b
Examples:
  diffcheck golden record      # every reference golden of the default suite
  diffcheck golden verify      # check every golden's digest and schema
""")
def golden():
    """Record, verify, show and export reference goldens."""


@golden.command(name="record", epilog="""\b
Examples:
  diffcheck golden record                # every reference of the default suite
  diffcheck golden record J --update     # re-record J after an engine upgrade
""")
@click.argument("case_ids", nargs=-1)
@suite_option
@goldens_option
@click.option("--update", is_flag=True, help="Overwrite a golden whose content would change (prints what changed).")
@click.option("--force", is_flag=True, help="Re-record even when the golden is up to date (same config, engine, model).")
@click.option("--check-determinism", is_flag=True, help="Generate twice and refuse a reference that is not reproducible.")
@click.pass_context
def record(ctx, case_ids, suite, goldens, update, force, check_determinism):
    """Record goldens for CASE_IDS (default: every reference case of the suite)."""
    import time

    from diffcheck import api, cases
    from diffcheck.core import progress
    from diffcheck.core.errors import ConfigError
    from diffcheck import workspace

    s = cases.load_suite(suite)
    references = [c for c in s.cases.values() if c.role == "reference"]
    ids = list(case_ids) or [c.id for c in references if not cases.not_by_default(c)]
    if not ids:
        raise ConfigError(f"{cases.display_path(s.path)}: no reference runs by default (every reference is tagged "
                          f"{' or '.join(cases.NOT_BY_DEFAULT)}); name the ones to record, e.g. "
                          f"`diffcheck golden record {references[0].id if references else 'ID'} --suite {suite}`")
    todo = [cases.get_case(s, i) for i in ids]
    root = workspace.goldens_root(goldens)
    rows = []
    for n, case in enumerate(todo, 1):
        t0 = time.perf_counter()
        with progress.display(verbose=ctx.obj.get("verbose", False)) as shown:
            shown.stage(f"golden record: case {n} of {len(todo)}: {case.id}")
            res = api.record_golden(case, goldens=root, update=update, force=force,
                                    check_determinism=check_determinism,
                                    verbose=ctx.obj.get("verbose", False), echo=shown.log)
        rows.append(res)
        extra = f" ({res.message})" if res.message else ""
        click.echo(f"{res.status:10s} {case.id:6s} {res.digest[:16]}  {res.path}  {time.perf_counter() - t0:.1f}s{extra}")
    return 0


@golden.command(name="verify", epilog="""\b
Examples:
  diffcheck golden verify                   # the default suite's goldens
  diffcheck golden verify --suite gpu-h200  # the committed H200 recordings
""")
@suite_option
@goldens_option
def verify(suite, goldens):
    """Check every golden's blake3 digest and schema."""
    from pathlib import Path

    from diffcheck import workspace
    from diffcheck.storage import store
    from diffcheck.core.errors import DataError

    from diffcheck import cases

    root = workspace.goldens_root(goldens)
    folder = Path(root) / cases.load_suite(suite).name
    if not folder.is_dir():
        raise DataError(f"{folder}: no goldens for suite '{suite}'; record them with `diffcheck golden record --suite {suite}`")
    results = store.verify_folder(folder)
    bad = [r for r in results if not r.ok]
    for r in results:
        click.echo(f"ok  {r.path}" if r.ok else f"BAD {r.message}")
    if not results:
        raise DataError(f"{folder}: no goldens found; record them with `diffcheck golden record --suite {suite}`")
    if bad:
        raise DataError(f"{len(bad)} of {len(results)} files failed verification (first: {bad[0].message})")
    click.echo(f"{len(results)} files verified")
    return 0


@golden.command(name="show", epilog="""\b
Examples:
  diffcheck golden show J               # the reference golden of J
  diffcheck golden show O --kind run    # the candidate run of O recorded beside it
""")
@click.argument("case_id")
@suite_option
@goldens_option
@click.option("--kind", type=click.Choice(["generate", "run"]), default="generate",
              help="generate: the golden; run: the candidate run recorded beside it.")
def show(case_id, suite, goldens, kind):
    """Summarise a golden: sequences, tokens, the seed's quality metrics, config, hardware."""
    import json

    from rich.console import Console
    from rich.table import Table

    from diffcheck import cases
    from diffcheck.judging import quality
    from diffcheck import workspace
    from diffcheck.storage import store

    root = workspace.goldens_root(goldens)
    path = store.run_path(root, cases.load_suite(suite).name, case_id, kind="generate", role="candidate" if kind == "run" else "reference")
    run = store.read_run(path)
    entry = store.manifest_entry(path) or {}
    console = Console()
    m = run.meta
    console.print(f"[bold]{path}[/]  content {entry.get('content_blake3', '?')[:16]}  "
                  f"{entry.get('bytes', 0) / max(run.n_tokens, 1):.1f} bytes/token")
    console.print(f"case {m.case_id} ({m.role}, {m.kind}) suite {m.suite}; created {m.created}; diffcheck {m.diffcheck_version}")
    console.print(f"engine {m.engine.get('name')} {m.engine.get('version')}"
                  + (f" commit {m.engine.get('commit', '')[:12]}{' (dirty)' if m.engine.get('dirty') else ''}"
                     if m.engine.get("commit") else ""))
    console.print(f"model {m.model.get('id')} digest {str(m.model.get('digest'))[:16]}")
    table = Table("seq", "prompt", "tokens", "finish", "digit_ratio", "weird_runs", "rep_num_runs", "max_digit_run",
                  "hash", title=f"{len(run.sequences)} sequences, {run.n_tokens} tokens")
    for s in run.sequences:
        q = quality.text_metrics(s.text, s.n_tokens)
        table.add_row(str(run.sequences.index(s)), s.prompt_id, str(s.n_tokens), s.finish_reason,
                      f"{q['digit_ratio']:.4f}", str(q["weird_runs"]), str(q["repeated_num_runs"]),
                      str(q["max_digit_run"]), q["output_hash"][:12])
    console.print(table)
    console.print("effective engine config: " + json.dumps(m.engine.get("effective", {}), sort_keys=True))
    console.print("sampling: " + json.dumps(m.sampling, sort_keys=True))
    console.print("hardware: " + json.dumps(m.hardware, sort_keys=True))
    if m.timings:
        console.print("timings: " + json.dumps({k: round(v, 3) for k, v in m.timings.items()}, sort_keys=True))
    return 0


@golden.command(name="export", epilog="""\b
Examples:
  diffcheck golden export J --out J.csv
  diffcheck golden export goldens/default/O.run.parquet --out O.parquet
""")
@click.argument("target", metavar="FILE|ID")
@suite_option
@goldens_option
@click.option("--format", "fmt", type=click.Choice(["parquet", "csv"]), default=None,
              help="Output format (default: csv when --out ends in .csv, else parquet).")
@click.option("--out", "out", type=click.Path(dir_okay=False), required=True, help="File to write (atomically).")
def export(target, suite, goldens, fmt, out):
    """Write a golden (or any run file) as plain float logprobs for other tools.

    FILE|ID: a run file, or a case id whose golden is read from the goldens root of
    --suite. One row per step: seq, prompt_id, step, token_id, logprob, then the top-k
    (parquet: topk_ids and topk_logprobs lists; csv: top1_id, top1_logprob, ... columns).
    """
    from pathlib import Path

    from diffcheck import api, cases
    from diffcheck import workspace
    from diffcheck.storage import store

    if target.endswith(".parquet") or "/" in target or Path(target).is_file():
        source = Path(target)
    else:
        source = store.run_path(workspace.goldens_root(goldens), cases.load_suite(suite).name, target)
        if not source.exists():
            workspace.load_golden(source.parent.parent, source.parent.name, target)  # the one-line "no golden" error
    fmt = fmt or ("csv" if out.lower().endswith(".csv") else "parquet")
    run = api.read_run(source)
    api.export_run(source, out, format=fmt)
    click.echo(f"wrote {out} ({fmt}: {run.n_tokens} rows, {len(run.sequences)} sequences, top-{run.steps.k}) "
               f"from {source}")
    return 0
