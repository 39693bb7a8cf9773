"""``diffcheck kernels``: kernel-level decode-attention checks, graph replay included.

Runs the `kernels` suite (or reads a ``python -m kernels --json`` result from
a machine that lacks this CLI's dependencies), prints the summary table,
and treats ``<out>/<device>.parquet`` as the stored results: compared against
when present, rewritten only with ``--update``. On a regression the new
results are written beside it as ``<device>.obtained.parquet``.

Exit 0: every case within tolerance, both broken builders caught for every
kernel that ran, no regression. Exit 1 otherwise. Exit 2 on a usage error or
an unreadable/tampered stored file. torch is imported only when the command
runs.
"""

from __future__ import annotations

from pathlib import Path

import click

from diffcheck.core.errors import EXIT_PASS, EXIT_REGRESSION, ConfigError


@click.command("kernels")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Where to run (default cpu; with --from-json, the file's device).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("goldens/kernels"),
              show_default=True, help="Folder of stored results, one <device>.parquet each.")
@click.option("--update", is_flag=True, help="Rewrite the stored results with this run's.")
@click.option("--suite", "suite_name", type=click.Choice(["full", "quick"]), default="full", show_default=True,
              help="Case grid; quick is the CI-sized one.")
@click.option("--kernels", "kernel_names", default="", metavar="NAMES",
              help="Comma-separated subset: torch-sdpa, vllm-cpu-attn, triton-paged, vllm-triton-unified, vllm-fa3.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write this run's results as JSON.")
@click.option("--from-json", "from_json", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Judge and store results from `python -m kernels --json` instead of running.")
@click.option("--all-rows", is_flag=True, help="Print every case, not the per-group summary.")
def kernels(device, out_dir, update, suite_name, kernel_names, json_path, from_json, all_rows) -> int:
    """Check decode attention kernels against a float64 reference, eager and
    under graph replay, and prove the replay harness catches stale metadata.

    \b
    Re-record the stored results:  diffcheck kernels --device DEVICE --update
    """
    from rich.console import Console

    from diffcheck_kernels import results as res

    console = Console(width=None if Console().is_terminal else 160)
    if from_json is not None:
        result = res.read_json(from_json)
        if device is not None and device != result.device:
            raise ConfigError(f"--device {device} contradicts {from_json}: field 'device' is {result.device!r}")
    else:
        result = _run(device or "cpu", suite_name, kernel_names, console)
    if json_path is not None:
        res.write_json(result, json_path)

    stored_path = out_dir / f"{result.device}.parquet"
    comparison = None
    messages = []
    if update:
        res.write_parquet(result, stored_path)
        messages.append(f"recorded {len(result.rows)} cases at {stored_path}")
    elif stored_path.exists():
        stored = res.read_parquet(stored_path)
        comparison = res.compare(stored, result)
        if stored.suite != result.suite:
            messages.append(f"stored results are of suite '{stored.suite}', this run is '{result.suite}'")
        if comparison.not_run:
            messages.append(f"{len(comparison.not_run)} stored cases not run this time (e.g. {comparison.not_run[0]})")
        if comparison.new:
            messages.append(f"{len(comparison.new)} cases not in the stored results (e.g. {comparison.new[0]})")
        if comparison.regressions:
            obtained = res.write_parquet(result, out_dir / f"{result.device}.obtained.parquet")
            messages.append(f"this run written to {obtained}")
    else:
        messages.append(f"no stored results at {stored_path}; record them with "
                        f"`diffcheck kernels --device {result.device} --update`")  # fmt: skip

    _print(console, result, comparison, all_rows=all_rows)
    for line in messages:
        console.print(line, highlight=False, markup=False)
    ok = res.overall_ok(result, comparison)
    if comparison is not None and comparison.regressions:
        console.print(f"to accept these numbers: diffcheck kernels --device {result.device} --update", markup=False)
    return EXIT_PASS if ok else EXIT_REGRESSION


def _run(device: str, suite_name: str, kernel_names: str, console):
    from diffcheck_kernels.suite import CONFIGS, run_suite

    names = tuple(k.strip() for k in kernel_names.split(",") if k.strip()) or None
    try:
        with console.status("running kernel checks") as status:
            return run_suite(device, CONFIGS[suite_name], kernels=names, progress=lambda line: status.update(line))
    except ValueError as exc:
        option = "--kernels" if "kernel" in str(exc) else "--device"
        raise ConfigError(f"{option}: {exc}") from None


def _print(console, result, comparison, *, all_rows: bool) -> None:
    from rich.markup import escape
    from rich.table import Table

    from diffcheck_kernels.table import COLUMNS, summarize, verdict_line

    styles = {"PASS": "green", "CAUGHT": "green", "MISSED": "bold red"}
    env = result.env
    title = f"decode attention on {result.device} ({env.get('device_name', '?')}, torch {env.get('torch', '?')})"
    table = Table(title=title, title_justify="left")
    if all_rows:
        for col in ("case", "max err", "mean err", "invariant", "result"):
            table.add_column(col, overflow="fold")
        for row in result.rows:
            style = styles.get(row.verdict, "bold red")
            table.add_row(escape(row.case_id), f"{row.max_err:.2e}", f"{row.mean_err:.2e}", row.invariant,
                          f"[{style}]{row.verdict}[/]")  # fmt: skip
    else:
        for col in COLUMNS:
            table.add_column(col, justify="right" if "err" in col or col == "cases" else "left")
        for row in summarize(result):
            cells = [escape(cell) for cell in row.cells()]
            style = styles.get(row.result, "bold red")
            cells[-1] = f"[{style}]{cells[-1]}[/]"
            table.add_row(*cells)
    console.print(table)
    for row in summarize(result):
        if row.detail and (not row.ok or row.mode.startswith("graph[")):
            console.print(f"  {row.kernel} {row.mode}: {row.detail}", highlight=False, markup=False)
    for skipped in result.skipped:
        console.print(f"  skipped {skipped.kernel}: {skipped.reason}", highlight=False, markup=False)
    for note in result.notes:
        console.print(f"  note: {note}", highlight=False, markup=False)
    if comparison is not None:
        for regression in comparison.regressions:
            console.print(f"  REGRESSION {regression}", style="bold red", highlight=False, markup=False)
    line = verdict_line(result, comparison)
    console.print(line, style="green" if line.startswith("OK") else "bold red", highlight=False, markup=False)
