"""The web view of a lonnymq schema: ``lonnymq web``, or an ASGI app to mount in your own.

Pages: every queue at a glance (ready, delayed, in flight, dead letters, oldest ready age,
rates per second with a live chart), one queue's channels (tenants) by backlog with their
policies, messages of a queue or channel by state (paged), one message (headers, Celery task,
attempts, due time, lock expiry), dead letters with their reason. Each page has a JSON twin
under ``/api/`` (docs/web.md); the overview's is the data of ``lonnymq status --json``.

Read-only unless started with actions on and an access token: then retrying and deleting
messages, purging queues and setting policies are possible, each confirmed, CSRF-protected and
logged on ``lonnymq.web.audit``.

    from lonnymq.web import create_app
    app = create_app("postgresql://...", schema="lonnymq")   # Starlette (ASGI)

Needs the ``web`` extra (``pip install 'lonnymq[web]'``: Starlette, Jinja2, uvicorn).
"""

from __future__ import annotations

from .app import create_app

__all__ = ["create_app"]
