"""Options shared by several commands."""

from __future__ import annotations

import click

suite_option = click.option("--suite", "-s", default="default", show_default=True,
                            help="Case suite: a name under cases/ or a path to a .toml file.")
goldens_option = click.option("--goldens", type=click.Path(file_okay=False), default=None,
                              help="Goldens root (default $DIFFCHECK_GOLDENS or ./goldens).")
