"""Celery helpers for lonnymq.

Tenant channels without touching call sites::

    import lonnymq.celery

    app = Celery("proj", broker="lonnymq://user:pw@db/app")
    lonnymq.celery.setup(app)

    @app.task(lonnymq_channel="tenant_id")       # the argument that names the tenant
    def rebuild_report(tenant_id, report_id): ...

    rebuild_report.delay(42, 7)                  # goes to channel "42" of its queue

Async code publishes a task in its own ``psycopg.AsyncConnection`` transaction with
:func:`apublish`.

``lonnymq_channel`` may also be a callable ``(args, kwargs) -> str``. A call can still choose
its channel with ``headers={"x-channel": ...}``, which wins. An option naming no argument of
the task is logged as an error by Celery at publish, and the message keeps the default channel
(its routing key). For transactional enqueue see
:func:`lonnymq.transaction`.
"""

from __future__ import annotations

import base64
import inspect
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from celery import Celery, signals
from kombu.serialization import dumps as serialize
from kombu.utils.json import dumps as to_json

from . import celery_steps as _celery_steps  # noqa: F401  mingle and gossip on lonnymq workers
from .migrator import DEFAULT_SCHEMA
from .queue._ops import arun
from .queue.routing import publish_op
from .transport.headers import delay_ms, make_eta_aware

_APPS: weakref.WeakSet[Celery] = weakref.WeakSet()
_SIGNATURES: dict[Any, inspect.Signature] = {}


def setup(app: Celery) -> None:
    """Enable lonnymq's task options (``lonnymq_channel``) for ``app``. Idempotent."""
    _APPS.add(app)
    signals.before_task_publish.connect(_before_publish, weak=False, dispatch_uid="lonnymq")


def _task(name: str) -> Any:
    for app in list(_APPS):
        task = app.tasks.get(name)
        if task is not None:
            return task
    return None


def channel_for(task: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """The tenant channel a call of ``task`` goes to, from its ``lonnymq_channel`` option."""
    spec: str | Callable[..., Any] | None = getattr(task, "lonnymq_channel", None)
    # a function given as a task option becomes a class attribute: unbind it
    spec = getattr(spec, "__func__", spec)
    if spec is None:
        return None
    if callable(spec):
        value = spec(args, kwargs)
    elif spec in kwargs:
        value = kwargs[spec]
    else:
        signature = _SIGNATURES.get(task.run)
        if signature is None:
            signature = _SIGNATURES[task.run] = inspect.signature(task.run)
        names = [
            p.name
            for p in signature.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if spec not in names:
            raise ValueError(f"task {task.name}: lonnymq_channel names no argument {spec!r}")
        index = names.index(spec)
        if index >= len(args):
            default = signature.parameters[spec].default
            if default is inspect.Parameter.empty:
                return None
            value = default
        else:
            value = args[index]
    return None if value is None else str(value)


def _before_publish(
    sender: str | None = None,
    body: Any = None,
    headers: dict[str, Any] | None = None,
    **_: Any,
) -> None:
    if not sender or headers is None:
        return
    task = _task(sender)
    if task is not None:
        # a naive eta is in the app's timezone (not the current app's)
        make_eta_aware(headers, task.app.timezone)
    if headers.get("x-channel"):
        return
    if task is None or not isinstance(body, (tuple, list)) or len(body) < 2:
        return
    args, kwargs = body[0], body[1]
    channel = channel_for(task, list(args or ()), dict(kwargs or {}))
    if channel:
        headers["x-channel"] = channel


def _routed_queue(app: Any, task: Any, args: list[Any], kwargs: dict[str, Any]) -> str:
    """The queue ``task.apply_async(args, kwargs)`` sends to: the task's ``queue``, else the
    one its ``task_routes`` name, else ``task_default_queue`` (Celery's router decides)."""
    own = getattr(task, "queue", None)
    routed = app.amqp.router.route(
        {"queue": own} if own else {}, task.name, args, kwargs, task_type=task
    )
    destination = routed.get("queue")
    name = getattr(destination, "name", destination)
    return str(name or app.conf.task_default_queue)


async def apublish(
    aconn: Any,
    task: Any,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    queue: str | None = None,
    countdown: float | None = None,
    eta: Any = None,
    headers: dict[str, Any] | None = None,
    priority: int | None = None,
) -> str:
    """Publish a Celery task on an asyncio ``psycopg.AsyncConnection``, in its transaction.

    For async code: ``async with aconn.transaction(): ...; await apublish(aconn, task, args)``
    writes the task with the caller's rows, rolled back or committed with them. The message is
    the one ``task.apply_async`` would publish (Celery message protocol 2), sent to ``queue``
    (default: where ``apply_async`` sends it: the task's ``queue``, else the queue its
    ``task_routes`` name, else ``task_default_queue``; a route that names an exchange and a
    routing key but no queue is not followed). Returns the task id. The schema
    must be installed already (any worker or producer of the app installs it on first use, or
    ``lonnymq migrate``).
    """
    if not isinstance(aconn, psycopg.AsyncConnection):
        raise TypeError("apublish needs a psycopg.AsyncConnection")
    if not hasattr(task, "app") or not isinstance(getattr(task, "name", None), str):
        raise TypeError(f"apublish needs a Celery task (an @app.task), not {task!r}")
    app = task.app
    task_id = str(uuid.uuid4())
    kwargs = dict(kwargs or {})
    message = app.amqp.create_task_message(
        task_id, task.name, list(args), kwargs, countdown=countdown, eta=eta
    )
    content_type, encoding, data = serialize(message.body, serializer=app.conf.task_serializer)
    raw = data.encode(encoding or "utf-8") if isinstance(data, str) else data
    all_headers = {**message.headers, **(headers or {})}
    make_eta_aware(all_headers, app.timezone)
    target = queue or _routed_queue(app, task, list(args), kwargs)
    if "x-channel" not in all_headers:
        channel = channel_for(task, list(args), kwargs)
        if channel:
            all_headers["x-channel"] = channel
    envelope = {
        "body": base64.b64encode(raw).decode(),
        "content-encoding": encoding,
        "content-type": content_type,
        "headers": all_headers,
        "properties": {
            **message.properties,
            "delivery_mode": 2,
            "priority": priority or 0,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
            "delivery_info": {"exchange": "", "routing_key": target},
        },
    }
    options = dict(app.conf.broker_transport_options or {})
    op = publish_op(
        str(options.get("schema", DEFAULT_SCHEMA)),
        "",
        target,
        to_json(envelope).encode(),
        channel=all_headers.get("x-channel"),
        name=all_headers.get("x-dedup-name"),
        delay_ms=delay_ms(all_headers),
        priority=priority or 0,
    )
    await arun(aconn, op)
    return task_id
