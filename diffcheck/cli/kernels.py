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

from diffcheck.cli.common import output_option
from diffcheck.core.errors import EXIT_PASS, EXIT_REGRESSION, ConfigError


@click.command("kernels", epilog="""\b
Examples:
  diffcheck kernels --suite quick              # the CI-sized grid, on the CPU
  diffcheck kernels --device cuda --update     # re-record the stored CUDA results
""")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Where to run (default cpu; with --from-json, the file's device).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("goldens/kernels"),
              show_default=True, help="Folder of stored results, one <device>.parquet each.")
@click.option("--update", is_flag=True, help="Rewrite the stored results with this run's.")
@click.option("--suite", "suite_name", type=click.Choice(["full", "quick"]), default="full", show_default=True,
              help="Case grid; quick is the CI-sized one.")
@click.option("--kernels", "kernel_names", default="", metavar="NAMES",
              help="Comma-separated subset: torch-sdpa, vllm-cpu-attn, triton-paged, vllm-triton-unified, vllm-fa3.")
@output_option("--json", help="Also write this run's results as JSON.")
@click.option("--from-json", "from_json", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Judge and store results from `python -m kernels --json` instead of running.")
@click.option("--all-rows", is_flag=True, help="Print every case, not the per-group summary.")
def kernels(device, out_dir, update, suite_name, kernel_names, json_path, from_json, all_rows) -> int:
    """Check decode attention kernels against a float64 reference, eager and
    under graph replay, and prove the replay harness catches stale metadata.
    """
    from diffcheck_kernels import results as res

    from diffcheck.cli.common import outputs, write_reports
    from diffcheck.report.registry import stdout_taken
    from diffcheck.report.results import KernelsReport
    from diffcheck.report.terminal import make_console

    requested = outputs("kernels", json=json_path)
    if from_json is not None:
        result = res.read_json(from_json)
        if device is not None and device != result.device:
            raise ConfigError(f"--device {device} contradicts {from_json}: field 'device' is {result.device!r}")
    else:
        result = _run(device or "cpu", suite_name, kernel_names, make_console(stderr=stdout_taken(requested)))
    # This run's results first: a bad stored file (read below) must not lose them.
    write_reports(requested, KernelsReport(result), only=[name for name in requested if name != "terminal"])

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

    write_reports(requested, KernelsReport(result, comparison=comparison, messages=tuple(messages), all_rows=all_rows),
                  only=["terminal"])
    return EXIT_PASS if res.overall_ok(result, comparison) else EXIT_REGRESSION


def _run(device: str, suite_name: str, kernel_names: str, console):
    from diffcheck_kernels.suite import CONFIGS, run_suite

    names = tuple(k.strip() for k in kernel_names.split(",") if k.strip()) or None
    try:
        with console.status("running kernel checks") as status:
            return run_suite(device, CONFIGS[suite_name], kernels=names, progress=lambda line: status.update(line))
    except ValueError as exc:
        option = "--kernels" if "kernel" in str(exc) else "--device"
        raise ConfigError(f"{option}: {exc}") from None
