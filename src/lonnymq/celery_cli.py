"""``celery lonnymq ...``: the lonnymq command as a Celery CLI plugin.

Celery loads the ``celery.commands`` entry points before it parses its options, so installing
lonnymq also makes ``celery -b lonnymq://... inspect ping`` work without ``-A``: loading this
plugin imports lonnymq, which registers the ``lonnymq://`` transport alias with kombu.
"""

from __future__ import annotations

import click

from . import celery_steps as _celery_steps  # noqa: F401  mingle and gossip on lonnymq workers
from .cli import main


@click.command(
    name="lonnymq",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.pass_context
def command(ctx: click.Context) -> None:
    """lonnymq: migrate, policies, stats (see `celery lonnymq --help`)."""
    raise SystemExit(main(ctx.args))
