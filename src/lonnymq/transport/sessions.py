"""A process's Postgres sessions (the transport's command and LISTEN connections): opened
with the transport's settings, closed at exit, and never touched by a forked child, which
opens its own on first use."""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..dsn import mask_password
from ..exceptions import ConnectionLost
from . import pooler, sweep

# Connections inherited across fork: kept referenced forever in the child so that their
# finalizers never send a Terminate message down the parent's socket.
_INHERITED: list[Any] = []
LIVE: weakref.WeakSet[Forkable] = weakref.WeakSet()


class Forkable:
    """A holder of one session of this process (``LIVE.add`` it): a forked child forgets the
    parent's session (keeping it referenced, unclosed) and gets a new lock."""

    _conn: psycopg.Connection[Any] | None
    _lock: threading.RLock

    def close(self) -> None:
        raise NotImplementedError

    def _after_fork(self) -> None:
        if self._conn is not None:
            _INHERITED.append(self._conn)
            self._conn = None
        self._lock = threading.RLock()


def _after_fork_in_child() -> None:
    for item in list(LIVE):
        item._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_at_exit() -> None:
    """Close this process's own connections at exit (a producer's kombu connection is often
    never released), rather than leaving them to finalizers that warn; a sweep a publish
    started is waited for first (see :mod:`.sweep`)."""
    sweep.join_running(timeout=5.0)
    for item in list(LIVE):
        with contextlib.suppress(Exception):
            item.close()


atexit.register(_close_at_exit)


def open_connection(
    conninfo: str, connect_timeout: float | None, role: str
) -> psycopg.Connection[Any]:
    """A new autocommit session named ``lonnymq-<role>`` (unless the URL names it), adapted
    to a pooler in between; ConnectionLost when it cannot be opened."""
    kwargs: dict[str, Any] = {"autocommit": True}
    if "application_name" not in conninfo_to_dict(conninfo):  # the URL's own wins
        kwargs["application_name"] = f"lonnymq-{role}"
    if connect_timeout:
        kwargs["connect_timeout"] = max(1, int(connect_timeout))
    try:
        conn = psycopg.connect(conninfo, **kwargs)
        try:
            pooler.adapt(conn)  # no prepared statements through a pooler
        except BaseException:
            conn.close()
            raise
        return conn
    except psycopg.Error as exc:
        raise ConnectionLost(
            f"cannot connect to Postgres: {mask_password(str(exc)).strip()}"
        ) from None
