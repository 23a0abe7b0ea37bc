"""Mingle and gossip for Celery workers on lonnymq.

Celery runs its ``Mingle`` (sync revoked task ids and the logical clock with the other workers
at startup) and ``Gossip`` (watch the other workers' events) consumer steps only for the
transports it lists by ``driver_type`` (``compatible_transports``: ``amqp``, ``redis``). Both
need nothing but broadcast, reply queues and topic events, which lonnymq has, so a lonnymq
worker would otherwise run without them, silently.

Claiming ``driver_type = "amqp"`` or ``"redis"`` would switch on other code paths Celery keys on
those names (quorum-queue detection, the amqp-only loop tweaks, fanout events for Redis). So
the transport keeps its own ``driver_type``, and these two subclasses of Celery's steps, which
differ from them only in the broker check, are added to the consumer blueprint of a worker
whose broker is lonnymq, at ``celeryd_init`` (sent by every ``celery worker`` and
``app.Worker``). Workers of any other broker are left as they are. Each step stands down when
Celery's own step is enabled (a later Celery that knows lonnymq), so they never run twice, and
``--without-mingle`` / ``--without-gossip`` still turn them off. The gossip step's event
queue is ``auto_delete``, which the transport honours as RabbitMQ does: it goes when the
worker stops, so a stopped worker's queue does not collect the others' heartbeats.

At the same ``celeryd_init``, before the prefork pool forks its children, the worker's main
process checks the broker's schema (installing it when the transport may): the schema is
checked once per process, and a child forked after that inherits it, so that its first task
does not pay for the check (a new session's read of the catalog, about 9 ms) before its
result's publish. A broker not reachable then is left to the worker's own connection retries.

The ``celery`` command imports this module through lonnymq's ``celery.commands`` plugin;
``import lonnymq.celery`` does too, for workers started from Python.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals
from celery.worker.consumer.gossip import Gossip as CeleryGossip
from celery.worker.consumer.mingle import Mingle as CeleryMingle

from .transport import registry

logger = logging.getLogger(__name__)

#: The ``driver_type`` of lonnymq's Kombu transport.
DRIVER_TYPE = "lonnymq"


def is_lonnymq(app: Any) -> bool:
    """Whether ``app``'s workers consume from lonnymq (the connection Celery's steps check)."""
    with app.connection_for_read() as conn:
        return getattr(conn.get_transport_cls(), "driver_type", None) == DRIVER_TYPE


class Mingle(CeleryMingle):  # type: ignore[misc]
    """Celery's ``Mingle``, enabled on lonnymq."""

    requires = (CeleryMingle,)

    def compatible_transport(self, app: Any) -> bool:
        return is_lonnymq(app) and not super().compatible_transport(app)


class Gossip(CeleryGossip):  # type: ignore[misc]
    """Celery's ``Gossip``, enabled on lonnymq. Its event queue is ``auto_delete``: the
    transport deletes it when the step's consumer goes (the worker stops), as RabbitMQ does,
    so a stopped worker's queue does not collect the others' heartbeats."""

    requires = (Mingle, CeleryGossip)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        celery_gossip = getattr(c, "gossip", None)
        super().__init__(c, **kwargs)
        if not self.enabled and celery_gossip is not None:
            # ``c.gossip`` stays Celery's step when this one does not run
            c.gossip = celery_gossip

    def compatible_transport(self, app: Any) -> bool:
        return is_lonnymq(app) and not super().compatible_transport(app)


STEPS = (Mingle, Gossip)


def add_steps(app: Any) -> bool:
    """Add the steps to ``app``'s worker consumer if its broker is lonnymq; whether it is."""
    if not is_lonnymq(app):
        return False
    app.steps["consumer"].update(STEPS)
    return True


def check_schema(app: Any) -> None:
    """Check (or install) the schema of ``app``'s lonnymq broker in this process, once: the
    processes it forks afterwards start with it checked. Failures are left to whoever
    connects next (the worker's consumer, which retries and says why)."""
    connection = app.connection_for_write()
    try:  # (one try, not kombu's connect(), which retries: the consumer does that)
        transport = connection.transport
        transport.close_connection(transport.establish_connection())
    except Exception:
        logger.debug("lonnymq: the schema check before the pool starts failed", exc_info=True)
    finally:
        connection.release()


def _on_worker_init(sender: Any = None, instance: Any = None, **_: Any) -> None:
    if sender:  # the worker's node name, shown with its consumers (lonnymq web)
        registry.set_node(str(sender))
    app = getattr(instance, "app", None)
    if app is None:
        return
    try:
        lonnymq = add_steps(app)
    except Exception:  # another broker whose transport fails to load: the worker says why
        return
    if lonnymq:
        check_schema(app)


signals.celeryd_init.connect(_on_worker_init, weak=False, dispatch_uid="lonnymq.celery_steps")
