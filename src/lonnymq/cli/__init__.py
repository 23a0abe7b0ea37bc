"""The ``lonnymq`` command (also ``python -m lonnymq``).

    lonnymq migrate [--print-sql]                 install or upgrade the schema
    lonnymq status [QUEUE...]                     per queue: ready, delayed, in flight, dead...
    lonnymq top [--interval S]                    the same, live, with rates per second
    lonnymq channels QUEUE [--limit N]            the largest channels, policies and counters
    lonnymq policy set|clear|show QUEUE [CHANNEL] channel and queue-default policies
    lonnymq queue show|set QUEUE                  dead letters, max attempts, retention
    lonnymq messages list [--queue Q] [--channel C] [--state S] [--after ID] [--limit N]
    lonnymq messages show ID                      one message, headers and body
    lonnymq messages delete ID... | --queue Q [--state S] --all
    lonnymq messages retry ID... | --queue Q --all (dead letters back; delayed due now)
    lonnymq messages update ID [--now | --in D | --at T] [--priority N] [--content C]
                                                  reschedule or edit a waiting message
    lonnymq purge QUEUE [--dead] [--yes]          delete waiting messages (or dead letters)
    lonnymq metrics --port N                      serve Prometheus metrics for the database
    lonnymq web [--port N] [--allow-actions]      the web view (docs/web.md)
    lonnymq housekeep                             expire, prune dead letters (clients do it too)
    lonnymq grant producer|worker|admin ROLE / revoke ROLE

Every command reads the database from ``--dsn`` or ``$DATABASE_URL`` (a ``postgresql://`` or
``lonnymq://`` URL, or a libpq ``key=value`` string) and the schema from ``--schema``
(default ``lonnymq``). Listings take ``--json``. Tables are coloured on a terminal
(``--color auto|always|never``, ``NO_COLOR``), plain when piped.
"""

from __future__ import annotations

from .arguments import main, parser

__all__ = ["main", "parser"]
