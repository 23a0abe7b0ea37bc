"""Celery helpers for lonnymq.

Tenant channels without touching call sites::

    import lonnymq.celery

    app = Celery("proj", broker="lonnymq://user:pw@db/app")
    lonnymq.celery.setup(app)

    @app.task(lonnymq_channel="tenant_id")       # the argument that names the tenant
    def rebuild_report(tenant_id, report_id): ...

    rebuild_report.delay(42, 7)                  # goes to channel "42" of its queue

``lonnymq_channel`` may also be a callable ``(args, kwargs) -> str``. A call can still choose
its channel with ``headers={"x-channel": ...}``, which wins. An option naming no argument of
the task is logged as an error by Celery at publish, and the message keeps the default channel
(its routing key). For transactional enqueue see
:func:`lonnymq.transaction`.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from celery import Celery, signals

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
    if not sender or headers is None or headers.get("x-channel"):
        return
    task = _task(sender)
    if task is None or not isinstance(body, (tuple, list)) or len(body) < 2:
        return
    args, kwargs = body[0], body[1]
    channel = channel_for(task, list(args or ()), dict(kwargs or {}))
    if channel:
        headers["x-channel"] = channel
