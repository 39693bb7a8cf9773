"""Options shared by several commands."""

from __future__ import annotations

import click


def default_suite() -> str:
    """--suite's default: $DIFFCHECK_SUITE, else [tool.diffcheck] suite, else "default" (diffcheck.core.config)."""
    from diffcheck.core import config

    return config.default_suite()


SUITE_DEFAULT_TEXT = "$DIFFCHECK_SUITE, [tool.diffcheck] suite, else default"
suite_option = click.option("--suite", "-s", default=default_suite, show_default=SUITE_DEFAULT_TEXT,
                            help="Case suite: a name under the cases folder (or shipped with diffcheck) "
                                 "or a path to a .toml file.")
json_option = click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True), default=None,
                           metavar="FILE", help="Write JSON to FILE ('-' for stdout).")


def write_json_out(path: str, data) -> None:
    """--json's one behaviour: '-' prints, anything else is written atomically."""
    import json

    text = json.dumps(data, indent=2, default=str) + "\n"
    if path == "-":
        click.echo(text, nl=False)
        return
    from diffcheck.report import atomic_write_text

    atomic_write_text(path, text)


goldens_option = click.option("--goldens", type=click.Path(file_okay=False), default=None,
                              help="Goldens root (default $DIFFCHECK_GOLDENS, [tool.diffcheck] goldens, "
                                   "else ./goldens).")
