"""Channel rates (``policy.set(rate=, burst=)``): parsing, storage, and enforcement inside the
dequeue, against a real Postgres: exact under concurrent consumers, other channels served at
full speed, ``retry_ms`` at the next token, live changes, and the interplay with
max_concurrency, priority, delays, defers and lock expiry."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

import lonnymq
from lonnymq import InvalidArgument, Rate
from lonnymq.metrics import DatabaseCollector
from tests.invariants import assert_consistent
from tests.test_cli import cli

Conn = psycopg.Connection[Any]


def fill(queue: lonnymq.Queue, conn: Conn, channel: str, n: int, **kw: Any) -> None:
    batch = queue.batch()
    for i in range(n):
        batch.channel(channel).message(f"{channel}-{i}", **kw)
    batch.execute(conn)


def drain(
    broker: lonnymq.Broker,
    conn: Conn,
    queues: list[str],
    seconds: float,
    *,
    limit: int = 10,
    stop: Callable[[], bool] = lambda: False,
    spans: list[tuple[float, float]] | None = None,
    calls: list[tuple[float, float, int]] | None = None,
) -> list[tuple[float, lonnymq.Message]]:
    """Dequeue (and ack) as fast as possible for ``seconds``: (monotonic time, message).
    With ``spans``, each message's (call, return) times are added to it: the server granted
    it somewhere between the two. With ``calls``, every call's (call, return, messages)."""
    got: list[tuple[float, lonnymq.Message]] = []
    held: list[lonnymq.Message] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end and not stop():
        called = time.monotonic()
        result = broker.dequeue(conn, queues, limit=limit, ack=held, listen=False)
        now = time.monotonic()
        held = list(result.messages)
        got.extend((now, m) for m in held)
        if spans is not None:
            spans.extend((called, now) for _ in held)
        if calls is not None:
            calls.append((called, now, len(held)))
        if not held:
            time.sleep(0.001)
    if held:
        broker.delete_many(conn, held)
    return got


def max_in_window(times: list[float], window: float) -> int:
    """The most deliveries in any ``window`` seconds."""
    times = sorted(times)
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] < t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


def most_surely_in_window(spans: list[tuple[float, float]], window: float) -> int:
    """The most deliveries whose whole (call, return) span lies in one ``window`` seconds:
    each of those was granted in it, however late the caller saw it (a loaded machine delays
    the return, which shifts a return-time count into the next window)."""
    best = 0
    for start, _ in spans:
        best = max(best, sum(1 for a, b in spans if a >= start and b <= start + window))
    return best


# --- parsing and storage ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "count", "per_ms"),
    [
        ("10/s", 10, 1000),
        ("600/m", 600, 60_000),
        ("1/h", 1, 3_600_000),
        ("5/10s", 5, 10_000),
        (" 3 / min ", 3, 60_000),
        ("250/ms", 250, 1),
    ],
)
def test_rates_parse(text: str, count: int, per_ms: int) -> None:
    rate = Rate.parse(text)
    assert (rate.count, rate.per_ms) == (count, per_ms)
    assert Rate.parse(str(rate)) == rate


@pytest.mark.parametrize(
    "bad", ["10", "10/", "/s", "0/s", "-1/s", "1.5/s", "10/y", "10/0s", 10, 1.5, None, b"1/s"]
)
def test_bad_rates_are_refused(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        Rate.parse(bad)


def test_policies_keep_their_rate(broker: lonnymq.Broker, conn: Conn) -> None:
    queue = broker.queue("q")
    queue.channel("a").policy.set(conn, max_concurrency=3, rate="10/s", burst=5)
    queue.policy.set(conn, rate=Rate(600, 60_000))
    info = queue.channel("a").info(conn)
    assert info.own == lonnymq.Policy(3, None, Rate(10, 1000), 5)
    assert info.default == lonnymq.Policy(None, None, Rate(600, 60_000), 1)
    assert info.tokens == 5 and info.next_token_at is None
    assert queue.policy.get(conn).rate == Rate(600, 60_000)
    b = queue.channel("b").info(conn)
    assert b.own is None and b.effective.rate == Rate(600, 60_000) and b.tokens == 1
    # a policy set without a rate has none; clear goes back to the queue default
    queue.channel("a").policy.set(conn, max_concurrency=3)
    assert queue.channel("a").policy.get(conn) == lonnymq.Policy(3, None, None, None)
    queue.channel("a").policy.clear(conn)
    assert queue.channel("a").info(conn).effective.rate == Rate(600, 60_000)
    # a batch sets rates too
    batch = broker.batch()
    batch.queue("q").channel("c").policy.set(rate="2/s", burst=2)
    batch.queue("q").policy.set(max_size=100)
    batch.execute(conn)
    assert queue.channel("c").policy.get(conn) == lonnymq.Policy(None, None, Rate(2, 1000), 2)
    assert queue.policy.get(conn) == lonnymq.Policy(None, 100, None, None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"burst": 5}, "burst needs a rate"),
        ({"rate": "10/s", "burst": 0}, "burst must be between"),
        ({"rate": "10/s", "burst": True}, "burst must be an int"),
        ({"rate": "ten/s"}, "is not of the form"),
        ({"rate": 10}, "rate must be a str"),
    ],
)
def test_bad_policies_are_refused_and_change_nothing(
    broker: lonnymq.Broker, conn: Conn, kwargs: dict[str, Any], message: str
) -> None:
    channel = broker.queue("q").channel("a")
    channel.policy.set(conn, max_concurrency=2)
    with pytest.raises(InvalidArgument, match=message):
        channel.policy.set(conn, **kwargs)
    assert channel.policy.get(conn) == lonnymq.Policy(2, None, None, None)


# --- enforcement ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_rate_holds_with_its_burst(broker: lonnymq.Broker, conn: Conn) -> None:
    queue = broker.queue("q")
    queue.channel("a").policy.set(conn, rate="20/s", burst=5)
    fill(queue, conn, "a", 200)
    spans: list[tuple[float, float]] = []
    got = drain(broker, conn, ["q"], 2.5, spans=spans)
    # the burst at once (the first call, 10 asked for), then one every 50 ms: the 6th granted
    # at least 50 ms after the call that granted the burst began (its tokens are reckoned
    # then). Timed from the calls' spans (each message granted between its call and its
    # return), not from when the first message arrived: a first call that takes 15-40 ms (it
    # compiles the dequeue, or the suite loads the machine) made the 6th come "early" from
    # that arrival (CI: 35 ms after it; once 6 within 30 ms)
    assert len(got) > 6
    assert spans[:6].count(spans[0]) == 5, spans[:6]
    assert spans[5][1] - spans[0][0] >= 0.045, [(round(a, 4), round(b, 4)) for a, b in spans[:6]]
    assert most_surely_in_window(spans, 1.0) <= 20 + 5
    assert 5 + 20 * 2.5 - 3 <= len(got) <= 5 + 20 * 2.5 + 1
    assert_consistent(conn, broker.schema)


@pytest.mark.slow
def test_concurrent_consumers_never_exceed_the_rate(
    broker: lonnymq.Broker, connect: Callable[..., Conn]
) -> None:
    """Four consumers, each on its own connection and thread, prefetch 10: together they get
    no more than the rate allows (burst + rate x elapsed) in every window."""
    conn = connect()
    queue = broker.queue("q")
    queue.channel("a").policy.set(conn, rate="50/s", burst=10)
    fill(queue, conn, "a", 1000)
    results: list[list[tuple[float, lonnymq.Message]]] = [[] for _ in range(4)]
    spans: list[list[tuple[float, float]]] = [[] for _ in range(4)]
    conns = [connect() for _ in range(4)]
    start = time.monotonic()

    def run(i: int) -> None:
        results[i] = drain(broker, conns[i], ["q"], 3.0, spans=spans[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    times = [t - start for r in results for t, _ in r]
    ids = [m.id for r in results for _, m in r]
    assert len(ids) == len(set(ids))
    every = [span for r in spans for span in r]
    assert most_surely_in_window(every, 1.0) <= 50 + 10
    assert most_surely_in_window(every, 0.5) <= 25 + 10
    assert 10 + 50 * 3.0 - 10 <= len(times) <= 10 + 50 * 3.0 + 1
    assert sum(1 for r in results if r) >= 2, "one consumer got everything"


def test_other_channels_are_served_at_full_speed(broker: lonnymq.Broker, conn: Conn) -> None:
    queue = broker.queue("q")
    queue.channel("slow").policy.set(conn, rate="5/s", burst=1)
    fill(queue, conn, "slow", 100)
    fill(queue, conn, "fast", 1000)
    remaining = [1000]

    def done() -> bool:
        return remaining[0] == 0

    start = time.monotonic()
    got: list[tuple[float, lonnymq.Message]] = []
    held: list[lonnymq.Message] = []
    while remaining[0] and time.monotonic() - start < 30:
        result = broker.dequeue(conn, ["q"], limit=10, ack=held, listen=False)
        held = list(result.messages)
        got.extend((time.monotonic() - start, m) for m in held)
        remaining[0] -= sum(1 for m in held if m.channel == "fast")
    broker.delete_many(conn, held)
    elapsed = time.monotonic() - start
    slow = [t for t, m in got if m.channel == "slow"]
    assert remaining == [0]
    # the slow channel got at most its rate meanwhile, the fast one did not wait for it
    assert len(slow) <= 1 + 5 * elapsed + 1
    assert elapsed < 10


def test_retry_ms_is_the_time_to_the_next_token(broker: lonnymq.Broker, conn: Conn) -> None:
    queue = broker.queue("q")
    queue.channel("a").policy.set(conn, rate="2/s", burst=1)
    fill(queue, conn, "a", 5)
    start = time.monotonic()
    first = broker.dequeue(conn, ["q"], limit=10, listen=False)
    assert len(first.messages) == 1
    empty = broker.dequeue(conn, ["q"], limit=10, ack=first.messages, listen=False)
    elapsed_ms = (time.monotonic() - start) * 1000
    assert not empty.messages
    # the next token comes 500 ms after the first was taken, which was at most elapsed_ms
    # before the second call answered (a loaded machine may take more than 100 ms for both)
    assert empty.retry_ms is not None and 490 - elapsed_ms <= empty.retry_ms <= 510, (
        empty.retry_ms,
        elapsed_ms,
    )
    info = queue.channel("a").info(conn)
    assert info.tokens == 0 and info.next_token_at is not None
    time.sleep(empty.retry_ms / 1000)
    again = broker.dequeue(conn, ["q"], limit=10, listen=False)
    assert len(again.messages) == 1
    broker.delete_many(conn, again.messages)


def test_a_rate_change_applies_within_one_interval(broker: lonnymq.Broker, conn: Conn) -> None:
    """A channel waiting an hour for its next token under 1/h gets 20/s at once; a sleeping
    consumer is told (NOTIFY) that the channel has a turn again."""
    queue = broker.queue("q")
    channel = queue.channel("a")
    channel.policy.set(conn, rate="1/h", burst=1)
    fill(queue, conn, "a", 100)
    first = broker.dequeue(conn, ["q"], limit=10)
    assert len(first.messages) == 1
    empty = broker.dequeue(conn, ["q"], limit=10, ack=first.messages)
    assert not empty.messages and empty.retry_ms is not None and empty.retry_ms > 3_500_000
    conn.execute(f'LISTEN "{broker.wake_channel}"')
    with psycopg.connect(conn.info.dsn, autocommit=True) as other:
        channel.policy.set(other, rate="20/s", burst=1)
    assert next(conn.notifies(timeout=2, stop_after=1), None) is not None
    start = time.monotonic()
    calls: list[tuple[float, float, int]] = []
    got = drain(broker, conn, ["q"], 1.0, calls=calls)
    # within one interval (50 ms): no call that began after it (and 5 ms for the clocks)
    # came back empty before the first delivery. (Not timed from the delivering call's
    # return: under the loaded suite one call took 77 ms, with the token granted in it.)
    assert got
    delivering = next(i for i, c in enumerate(calls) if c[2] > 0)
    late = [c[0] - start for c in calls[:delivering] if c[0] - start > 0.05 + 0.005]
    assert not late, late
    # 20 or 21 (burst 1, then 20/s) when the caller keeps up; at least 15 (of 1/h's 0) when
    # other tests load the machine (17 and 18 seen with the suite in 4 processes)
    assert 15 <= len(got) <= 22, len(got)


@pytest.mark.slow
def test_rate_and_max_concurrency_together(broker: lonnymq.Broker, conn: Conn) -> None:
    queue = broker.queue("q")
    queue.channel("a").policy.set(conn, max_concurrency=2, rate="40/s", burst=4)
    fill(queue, conn, "a", 100)
    # nothing acked: the concurrency holds it to 2 whatever the tokens
    got = broker.dequeue(conn, ["q"], limit=10, listen=False)
    assert len(got.messages) == 2
    assert not broker.dequeue(conn, ["q"], limit=10, listen=False).messages
    broker.delete_many(conn, got.messages)
    # acked as they come: the rate holds it (burst 4 was 2 spent, then 40/s)
    start = time.monotonic()
    held: list[lonnymq.Message] = []
    times: list[float] = []
    most_in_flight = 0
    while time.monotonic() - start < 1.5:
        result = broker.dequeue(conn, ["q"], limit=10, ack=held, listen=False)
        held = list(result.messages)
        most_in_flight = max(most_in_flight, len(held))
        times.extend(time.monotonic() - start for _ in held)
    broker.delete_many(conn, held)
    assert most_in_flight <= 2
    assert max_in_window(times, 1.0) <= 40 + 4
    assert len(times) >= 40
    assert_consistent(conn, broker.schema)


def test_priority_within_a_rated_channel(broker: lonnymq.Broker, conn: Conn) -> None:
    queue = broker.queue("q")
    queue.channel("a").policy.set(conn, rate="20/s", burst=1)
    fill(queue, conn, "a", 10)
    fill(queue, conn, "a", 3, priority=9)
    got = drain(broker, conn, ["q"], 0.5)
    assert [m.priority for _, m in got[:3]] == [9, 9, 9]
    assert len(got) <= 1 + 20 * 0.5 + 1


@pytest.mark.slow
def test_delayed_messages_wait_for_their_time_then_the_rate(
    broker: lonnymq.Broker, conn: Conn
) -> None:
    queue = broker.queue("q")
    queue.channel("a").policy.set(conn, rate="10/s", burst=3)
    fill(queue, conn, "a", 10, delay_ms=600)
    start = time.monotonic()
    got = drain(broker, conn, ["q"], 1.5)
    times = [t - start for t, _ in got]
    assert times and min(times) >= 0.55
    # due together at 0.6 s: the burst, then 10/s
    assert len([t for t in times if t < 0.65]) <= 3
    assert max_in_window(times, 0.5) <= 3 + 5


def test_a_requeue_spends_a_token_and_a_lock_takeover_does_not(
    broker: lonnymq.Broker, conn: Conn
) -> None:
    """A deferred or requeued message is handed out again through its channel, and spends a
    token; a message taken over after its holder's lock expired is the same delivery, and does
    not (docs/design.md, "Rate")."""
    queue = broker.queue("q")
    queue.channel("a").policy.set(conn, rate="4/s", burst=1)
    fill(queue, conn, "a", 3)
    first = broker.dequeue(conn, ["q"], limit=10, lock_ms=300, listen=False)
    assert len(first.messages) == 1
    # its lock expires: taken over at once, though no token is due yet
    time.sleep(0.32)
    taken = broker.dequeue(conn, ["q"], limit=1, listen=False)
    assert [m.id for m in taken.messages] == [first.messages[0].id]
    assert taken.messages[0].lock_expired
    # deferred: it waits for a token like the others (one is due 250 ms after the first)
    broker.defer(conn, taken.messages[0].id, taken.messages[0].lock_token)
    got = drain(broker, conn, ["q"], 0.9, limit=1)
    assert first.messages[0].id in [m.id for _, m in got]
    assert len(got) <= 1 + int(0.9 * 4) + 1
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(got)]
    assert all(g >= 0.2 for g in gaps), gaps


def test_the_queue_default_rate_applies_to_each_channel(broker: lonnymq.Broker, conn: Conn) -> None:
    queue = broker.queue("q")
    queue.policy.set(conn, rate="10/s", burst=2)
    queue.channel("own").policy.set(conn, rate="40/s", burst=2)
    for name in ("a", "b", "own"):
        fill(queue, conn, name, 60)
    got = drain(broker, conn, ["q"], 1.0)
    per = {name: [t for t, m in got if m.channel == name] for name in ("a", "b", "own")}
    assert 8 <= len(per["a"]) <= 2 + 10 + 1
    assert 8 <= len(per["b"]) <= 2 + 10 + 1
    assert 30 <= len(per["own"]) <= 2 + 40 + 1


def test_an_idle_rated_channel_gets_its_burst_back(broker: lonnymq.Broker, conn: Conn) -> None:
    queue = broker.queue("q")
    queue.channel("a").policy.set(conn, rate="10/s", burst=4)
    fill(queue, conn, "a", 4)
    assert len(drain(broker, conn, ["q"], 0.1)) == 4
    time.sleep(0.45)
    fill(queue, conn, "a", 10)
    got = drain(broker, conn, ["q"], 0.05)
    assert len(got) == 4
    assert queue.channel("a").info(conn).tokens == 0


def test_rate_state_is_shown(broker: lonnymq.Broker, conn: Conn) -> None:
    queue = broker.queue("q")
    queue.channel("a").policy.set(conn, rate="1/m", burst=2)
    fill(queue, conn, "a", 5)
    drain(broker, conn, ["q"], 0.2)
    [status] = [c for c in queue.channels(conn) if c.channel == "a"]
    assert status.rate == Rate(1, 60_000) and status.burst == 2
    assert status.tokens == 0
    now = conn.execute("SELECT clock_timestamp()").fetchone()
    assert now is not None and status.next_token_at is not None
    assert timedelta(seconds=55) < status.next_token_at - now[0] <= timedelta(seconds=60)
    query = sql.SQL("SELECT * FROM {}.rate_held_v1()").format(sql.Identifier(broker.schema))
    held = conn.execute(query).fetchall()
    assert held == [("q", 1, 3)]
    assert broker.rate_held(conn) == [lonnymq.queue.RateHeld("q", 1, 3)]
    # and the database's metrics
    collector = DatabaseCollector(conn.info.dsn, broker.schema)
    try:
        metrics = {m.name: m for m in collector.collect()}
    finally:
        collector.close()
    [messages] = metrics["lonnymq_queue_rate_held_messages"].samples
    [channels] = metrics["lonnymq_queue_rate_held_channels"].samples
    assert (messages.labels, messages.value) == ({"queue": "q"}, 3)
    assert channels.value == 1


# --- the command line and the transport options ---------------------------------------------


@pytest.mark.slow
def test_cli_sets_and_shows_rates(broker: lonnymq.Broker, conn: Conn, pg_dsn: str) -> None:
    # (10 an hour: no token comes back between the commands that read them, slow under load;
    # at 10 a minute one did, 6 s after the burst)
    base = ("--dsn", pg_dsn, "--schema", broker.schema)
    out = cli("policy", "set", "q", "a", "--rate", "10/h", "--burst", "3", *base, "--json")
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["own_policy"]["rate"] == "10/h" and shown["own_policy"]["burst"] == 3
    assert shown["tokens"] == 3
    fill(broker.queue("q"), conn, "a", 10)
    drain(broker, conn, ["q"], 0.05)
    listed = json.loads(cli("channels", "q", *base, "--json").stdout)
    assert [(c["channel"], c["rate"], c["burst"], c["tokens"]) for c in listed] == [
        ("a", "10/h", 3, 0)
    ]
    assert listed[0]["next_token_at"] is not None
    table = cli("channels", "q", *base)
    assert "10/h x3" in table.stdout and "next in" in table.stdout
    status = json.loads(cli("status", *base, "--json").stdout)
    assert status[0]["rate_held"] == {"channels": 1, "messages": 7}
    assert "wait for the rate of 1 channel(s)" in cli("status", *base).stdout
    # the queue default; bad values are usage errors that change nothing
    assert cli("policy", "set", "q", "--rate", "600/m", *base).returncode == 0
    assert broker.queue("q").policy.get(conn).rate == Rate(600, 60_000)
    for bad in (["--rate", "fast"], ["--burst", "2"], ["--rate", "1/s", "--burst", "0"]):
        refused = cli("policy", "set", "q", "a", *bad, *base)
        assert refused.returncode == 2, (bad, refused.stdout, refused.stderr)
        assert "rate" in refused.stderr or "burst" in refused.stderr
    assert broker.queue("q").channel("a").policy.get(conn) == lonnymq.Policy(
        None, None, Rate(10, 3_600_000), 3
    )


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"rate": "often"}, "is not of the form"),
        ({"burst": 3}, "burst needs a rate"),
        ({"rate": "5/s", "burst": -1}, "burst must be between"),
        ({"rate": "5/s", "speed": 1}, "keys among"),
    ],
)
def test_bad_rates_in_the_policies_option_are_refused(
    make_connection: Callable[..., Any], limits: dict[str, Any], message: str
) -> None:
    with pytest.raises(lonnymq.ConfigurationError, match=message):
        make_connection(policies={"q": {"channels": {"a": limits}}}).connect()


def test_the_policies_option_sets_rates(
    make_connection: Callable[..., Any], broker: lonnymq.Broker, conn: Conn
) -> None:
    policies = {"q": {"default": {"rate": "2/s"}, "channels": {"a": {"rate": "5/s", "burst": 2}}}}
    with make_connection(policies=policies) as connection:
        connection.default_channel.queue_declare("q")
    queue = broker.queue("q")
    assert queue.policy.get(conn) == lonnymq.Policy(None, None, Rate(2, 1000), 1)
    assert queue.channel("a").policy.get(conn) == lonnymq.Policy(None, None, Rate(5, 1000), 2)
