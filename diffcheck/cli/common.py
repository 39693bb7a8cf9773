"""Options shared by several commands."""

from __future__ import annotations

from typing import Callable

import click


def default_suite() -> str:
    """--suite's default: $DIFFCHECK_SUITE, else [tool.diffcheck] suite, else "default" (diffcheck.core.config)."""
    from diffcheck.core import config

    return config.default_suite()


SUITE_DEFAULT_TEXT = "$DIFFCHECK_SUITE, [tool.diffcheck] suite, else default"
suite_option = click.option("--suite", "-s", default=default_suite, show_default=SUITE_DEFAULT_TEXT,
                            help="Case suite: a name under the cases folder (or shipped with diffcheck) "
                                 "or a path to a .toml file.")


def output_option(option: str, help: str):
    """An output option (--json, --junit, --html, --md): FILE, or '-' for stdout; the value is ``<name>_path``.

    One behaviour everywhere (docs/cli.md, `diffcheck.report.registry`).
    """
    return click.option(option, option.lstrip("-") + "_path", type=click.Path(dir_okay=False, allow_dash=True),
                        default=None, metavar="FILE", help=help)


json_option = output_option("--json", help="Write JSON to FILE ('-' for stdout).")


def outputs(kind: str, **paths) -> dict[str, str]:
    """What a command was asked to write, checked against its result kind before any work is done.

    The terminal report first, then each requested file in the order given
    (``json=``, ``junit=``, ``html=``, ``markdown=``; None = not asked). A format
    the kind has no report in, two outputs on stdout or two to one file: a usage
    error (exit 2).
    """
    from diffcheck.report.registry import check_outputs

    return check_outputs({"terminal": "-", **paths}, kind)


def echo_for(requested) -> Callable[[str], None]:
    """click.echo for a command's own lines: on stderr when a document goes to stdout (``--json -``)."""
    from diffcheck.report.registry import stdout_taken

    err = stdout_taken(requested)
    return lambda line: click.echo(line, err=err)


def write_reports(requested, result, *, only=None) -> None:
    """Render `result` in every requested format (`diffcheck.report.registry.write_outputs`, `only` those formats
    when given); say each file written."""
    from diffcheck.report.registry import write_outputs

    echo = echo_for(requested)
    for path in write_outputs(requested, result, only=only):
        echo(f"wrote {path}")


def write_json_out(path: str, data) -> None:
    """--json of plain data (``cases show``, ``ledger``): '-' prints, anything else is written atomically."""
    from diffcheck.report.registry import write_outputs
    from diffcheck.report.results import DataReport

    write_outputs({"json": path}, DataReport(data))


goldens_option = click.option("--goldens", type=click.Path(file_okay=False), default=None,
                              help="Goldens root (default $DIFFCHECK_GOLDENS, [tool.diffcheck] goldens, "
                                   "else ./goldens).")
