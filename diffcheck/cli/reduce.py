"""`diffcheck reduce CASE`: shrink a failing comparison to a smallest case, a script and a report."""

from __future__ import annotations

import click

from diffcheck.cli.common import goldens_option, output_option, suite_option


@click.command(name="reduce", epilog="""\b
Examples:
  diffcheck reduce E                           # E's smallest failing case, reduce-E/reduce.py, report.md
  diffcheck reduce E --out /tmp/E --write-case /tmp/reduced.toml   # and the reduced case, for CI
""")
@click.argument("case_id")
@click.option("--reference", default=None, help="The reference to fail against (default: the case's first).")
@suite_option
@goldens_option
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Folder for reduce.py, report.md and the probes' prompt files (default ./reduce-CASE).")
@click.option("--write-case", "write_case", type=click.Path(dir_okay=False), default=None,
              help="Append the reduced case (and a reference on its prompts) to this suite file.")
@output_option("--json", help="Write a JSON summary.")
@click.pass_context
def reduce(ctx, case_id, reference, suite, goldens, out_dir, write_case, json_path):
    """Find a smallest case that still fails like CASE_ID against its reference.

    Delta debugging in order: the config delta (drop what the failure does not need), the
    prompts, the decode steps (bisection from the onset), the batch (max_num_seqs = 1).
    Every probe is an ordinary comparison through the ledger, judged by the same policy and
    floor as `diffcheck compare`: a repeated probe is free and an interrupted reduce resumes.
    Writes a standalone script (vLLM only) and a Markdown bug report; exits with the reduced
    case's verdict (docs/reduce.md).
    """
    import sys
    from pathlib import Path

    from diffcheck import cases, workspace
    from diffcheck.cli.common import echo_for, outputs, write_reports
    from diffcheck.core import progress
    from diffcheck.core.types import exit_code
    from diffcheck.report import atomic_write_text
    from diffcheck.report.reduce import render_script
    from diffcheck.workflows import reduce as reducemod

    out = Path(out_dir) if out_dir else Path(f"reduce-{case_id}")
    report_path = out / "report.md"
    requested = outputs("reduce", json=json_path, markdown=str(report_path))
    echo = echo_for(requested)
    s = cases.load_suite(suite)
    root = workspace.goldens_root(goldens)
    command = "diffcheck " + " ".join(sys.argv[1:]) if sys.argv[1:] else f"diffcheck reduce {case_id}"
    with progress.display(verbose=ctx.obj.get("verbose", False)) as shown:
        shown.stage(f"reduce {case_id}")
        result = reducemod.reduce(s, case_id, root=root, out=out, reference=reference, echo=shown.log,
                                  verbose=ctx.obj.get("verbose", False), command=command)
    script = out / "reduce.py"
    files = {"script": str(script), "report": str(report_path)}
    if write_case:
        cand_id, ref_id = reducemod.write_case(result, Path(write_case))
        files["suite"] = f"{write_case} (cases {ref_id}, {cand_id})"
    import dataclasses

    result = dataclasses.replace(result, files=files)
    atomic_write_text(script, render_script(result))
    script.chmod(0o755)
    write_reports(requested, result)
    echo(f"wrote {script}")
    return exit_code(result.final.verdict)
