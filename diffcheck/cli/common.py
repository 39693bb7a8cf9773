"""Options shared by several commands."""

from __future__ import annotations

import click


def default_suite() -> str:
    """--suite's default: $DIFFCHECK_SUITE, else [tool.diffcheck] suite, else "default" (diffcheck.config)."""
    from diffcheck import config

    return config.default_suite()


SUITE_DEFAULT_TEXT = "$DIFFCHECK_SUITE, [tool.diffcheck] suite, else default"
suite_option = click.option("--suite", "-s", default=default_suite, show_default=SUITE_DEFAULT_TEXT,
                            help="Case suite: a name under the cases folder (or shipped with diffcheck) "
                                 "or a path to a .toml file.")
goldens_option = click.option("--goldens", type=click.Path(file_okay=False), default=None,
                              help="Goldens root (default $DIFFCHECK_GOLDENS, [tool.diffcheck] goldens, "
                                   "else ./goldens).")
