"""What ``bench_hot_path.py`` and the probes of issue 26 share: the floor tables (bare Postgres
doing the same work as lonnymq, see ``bench_hot_path.py``'s docstring) and the ``--dsn``
option."""

from __future__ import annotations

import argparse
import os
from typing import Any

import psycopg
from psycopg import sql

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"


def dsn_argument(parser: argparse.ArgumentParser) -> None:
    """``--dsn``: the Postgres to measure ($LONNYMQ_BENCH_DSN, else the machine's)."""
    parser.add_argument(
        "--dsn",
        default=os.environ.get("LONNYMQ_BENCH_DSN", DEFAULT_DSN),
        help="Postgres DSN (default: $LONNYMQ_BENCH_DSN, else %(default)s)",
    )


def install_floors(conn: psycopg.Connection[Any], schema: str) -> None:
    """``floor_t`` (the publish floor's table) and ``floor_m`` (the consume floor's, the same
    columns, identity and index) in ``schema``, which exists."""
    t = sql.Identifier(schema, "floor_t")
    conn.execute(
        sql.SQL(
            "CREATE TABLE {} (id bigint generated always as identity primary key, "
            "ch text not null, at timestamptz not null default clock_timestamp(), "
            "locked_until timestamptz, payload bytea not null)"
        ).format(t)
    )
    conn.execute(sql.SQL("CREATE INDEX ON {} (ch, at, id) WHERE locked_until IS NULL").format(t))
    conn.execute(
        sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)").format(
            sql.Identifier(schema, "floor_m"), t
        )
    )
