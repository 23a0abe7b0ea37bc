"""``celery lonnymq ...``: the lonnymq command as a Celery CLI plugin.

Celery loads the ``celery.commands`` entry points before it parses its options, so installing
lonnymq also makes ``celery -b lonnymq://... inspect ping`` work without ``-A``: loading this
plugin imports lonnymq, which registers the ``lonnymq://`` transport alias with kombu.

``celery -A proj lonnymq COMMAND`` works on the app's broker: the database of its
``broker_url`` (the first URL, when several are separated by ``;``) and the ``schema`` of its
``broker_transport_options``. ``--dsn`` and ``--schema`` still win; ``$DATABASE_URL`` is read
only when the app's broker is not lonnymq.
"""

from __future__ import annotations

from typing import Any

import click

from . import celery_steps as _celery_steps  # noqa: F401  mingle and gossip on lonnymq workers
from .cli import main
from .dsn import SCHEMES


@click.command(
    name="lonnymq",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.pass_context
def command(ctx: click.Context) -> None:
    """lonnymq: migrate, policies, stats (see `celery lonnymq --help`)."""
    dsn, schema = app_defaults(getattr(ctx.find_root().obj, "app", None))
    raise SystemExit(main(ctx.args, dsn=dsn, schema=schema))


def app_defaults(app: Any) -> tuple[str | None, str | None]:
    """The database URL and schema of a Celery app whose broker is lonnymq, else Nones."""
    if app is None:
        return None, None
    conf = app.conf
    url = conf.broker_write_url or conf.broker_url
    if isinstance(url, (list, tuple)):
        url = url[0] if url else None
    if isinstance(url, str):
        url = url.split(";", 1)[0].strip()
    if not isinstance(url, str) or url.split("://", 1)[0].lower() not in SCHEMES:
        return None, None
    options = conf.broker_transport_options or {}
    schema = options.get("schema")
    return url, schema if isinstance(schema, str) else None
