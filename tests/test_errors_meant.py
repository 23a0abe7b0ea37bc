# mypy: allow-untyped-calls
# (kombu is untyped)
"""Errors that say what was meant: a misspelt URL scheme names the schemes accepted and the one
meant; a misspelt key of a policy in the transport options is named, with the key meant; a
kombu ``Queue(...)`` keyword out of range is reported in the unit it was given in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from amqp.exceptions import PreconditionFailed
from kombu.connection import Connection
from kombu.entity import Queue
from kombu.exceptions import ChannelError
from psycopg import sql

import lonnymq
from lonnymq.transport import url as broker_url
from tests.test_cli import cli


def test_a_misspelt_scheme_in_dsn_says_which_schemes_and_the_one_meant(pg_dsn: str) -> None:
    typo = "lonymq://" + pg_dsn.split("://", 1)[1]
    out = cli("status", "--dsn", typo)
    assert out.returncode == 1
    assert 'missing "="' not in out.stderr  # libpq's words for it
    assert "unknown URL scheme 'lonymq'" in out.stderr
    assert "lonnymq://, postgresql://, postgres://" in out.stderr
    assert "did you mean lonnymq://?" in out.stderr
    out = cli("status", database_url="postgress://u:secret@h/db")
    assert "$DATABASE_URL: unknown URL scheme 'postgress'" in out.stderr
    assert "did you mean postgres://?" in out.stderr and "secret" not in out.stderr
    out = cli("status", "--dsn", "localhost")
    assert out.returncode == 1
    assert "neither a URL" in out.stderr and "key=value" in out.stderr


def test_a_misspelt_scheme_in_a_broker_url() -> None:
    with pytest.raises(lonnymq.ConfigurationError, match="did you mean lonnymq://") as err:
        broker_url.to_conninfo("lonymq://u:secret@h/db")
    assert "secret" not in str(err.value)


@pytest.mark.parametrize(
    ("policies", "named"),
    [
        (
            {"celery": {"default": {"max_concurency": 2}}},
            "celery.default: unknown key(s) 'max_concurency' (did you mean 'max_concurrency'?)",
        ),
        (
            {"celery": {"channels": {"a": {"max_szie": 2}}}},
            "unknown key(s) 'max_szie' (did you mean 'max_size'?)",
        ),
        (
            {"celery": {"setings": {}}},
            "celery: unknown key(s) 'setings' (did you mean 'settings'?)",
        ),
        (
            {"celery": {"settings": {"max_atempts": 3}}},
            "celery.settings: unknown key(s) 'max_atempts' (did you mean 'max_attempts'?)",
        ),
        ({"celery": {"default": 3}}, "celery.default must be a dict"),
    ],
)
def test_a_misspelt_policy_key_is_named(
    make_connection: Callable[..., Connection], policies: dict[str, Any], named: str
) -> None:
    with pytest.raises(lonnymq.ConfigurationError) as err:
        make_connection(policies=policies).connect()
    assert named in str(err.value)


def test_a_misspelt_transport_option_names_the_one_meant(
    make_connection: Callable[..., Connection],
) -> None:
    with pytest.raises(lonnymq.ConfigurationError, match="did you mean 'visibility_timeout'"):
        make_connection(visiblity_timeout=3).connect()


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        (
            {"message_ttl": -1},
            "message_ttl is in seconds (x-message-ttl is its milliseconds) and must be a number "
            "of at least 0",
        ),
        (
            {"expires": 0},
            "expires is in seconds (x-expires is its milliseconds) and must be a number of at "
            "least 0.001",
        ),
        ({"expires": 0.0001}, "expires is in seconds"),
        (
            {"max_length": -1},
            "Queue(max_length=-1): max_length (x-max-length) must be an int from 0",
        ),
        (
            {"max_priority": 256},
            "Queue(max_priority=256): max_priority (x-max-priority) must be an int from 1",
        ),
    ],
)
def test_queue_keywords_are_checked_in_the_callers_unit(
    make_connection: Callable[..., Connection], kwargs: dict[str, Any], said: str
) -> None:
    with make_connection() as connection:
        with pytest.raises(lonnymq.InvalidArgument) as err:
            Queue("kw", **kwargs)(connection.default_channel).declare()
        assert said in str(err.value)
        assert "-1000" not in str(err.value)
    # the amqp spelling is checked in its own unit (milliseconds), as before
    with (
        make_connection() as connection,
        pytest.raises(lonnymq.InvalidArgument, match="x-message-ttl"),
    ):
        Queue("kw", queue_arguments={"x-message-ttl": -1})(connection.default_channel).declare()


def test_an_exchange_declared_again_with_another_type_is_refused_as_on_rabbitmq(
    make_connection: Callable[..., Connection], pg_dsn: str, schema: str
) -> None:
    """RabbitMQ refuses it with 406 PRECONDITION_FAILED (py-amqp's ``PreconditionFailed``, a
    kombu ``ChannelError``) and keeps the exchange; so does lonnymq, saying which type the
    exchange has (it raised an untyped ``DatabaseError`` with the PL/pgSQL context line). The
    same declare again is fine."""
    with make_connection() as kc:
        channel = kc.default_channel
        channel.exchange_declare("orders", type="topic")
        with pytest.raises(ChannelError, match="exists with type 'topic', not 'direct'") as err:
            channel.exchange_declare("orders", type="direct")
        assert isinstance(err.value, PreconditionFailed) and err.value.reply_code == 406
        assert "CONTEXT" not in str(err.value)
        kc.default_channel.exchange_declare("orders", type="topic")
    with psycopg.connect(pg_dsn) as conn:
        found = conn.execute(
            sql.SQL("SELECT name, type FROM {}.exchange WHERE name = 'orders'").format(
                sql.Identifier(schema)
            )
        ).fetchall()
    assert found == [("orders", "topic")]
