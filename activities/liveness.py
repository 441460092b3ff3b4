"""Heartbeats that only say "this worker is still alive", for activities that wait on one slow call.

Temporal learns that a worker died (SIGKILL, a lost host) only from a timeout. Without a heartbeat timeout,
an attempt held by a dead worker is retried at start-to-close: 30 minutes for provision, 10 for terminate,
however short the call itself. ReplicaWorkflow gives provision, register, unregister and terminate a
heartbeat timeout, and these activities run under ``keeps_alive``: an attempt lost with its worker is
retried (on any worker) within that timeout, while a slow but live call is never cut short.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from datetime import timedelta
from typing import Any, Awaitable, Callable, Optional, TypeVar

from temporalio import activity

T = TypeVar("T")
# Heartbeats go out every third of the heartbeat timeout: a worker two heartbeats late (a busy loop, a slow
# network) is not yet taken for dead, so a live launch is never timed out and started a second time.
HEARTBEATS_PER_TIMEOUT = 3


def heartbeat_interval(timeout: Optional[timedelta]) -> Optional[float]:
    """Seconds between heartbeats under ``timeout`` (None without one)."""
    return timeout.total_seconds() / HEARTBEATS_PER_TIMEOUT if timeout else None


# What the activity last said of its progress (``progress``), repeated by ``heartbeating``: Temporal keeps the
# details of the last heartbeat only, and the Web UI (and `ps -v`) show them, so a bare heartbeat would erase them.
_said: contextvars.ContextVar[list[str]] = contextvars.ContextVar("durastack_progress")


def progress(text: str) -> None:
    """Heartbeat with ``text`` as the activity's progress (e.g. an image pull's layers), kept until the next."""
    said = _said.get(None)
    if said is not None:
        said[:] = [text]
    activity.heartbeat(text)


async def heartbeating(work: Awaitable[T]) -> T:
    """Await ``work``, heartbeating every third of the heartbeat timeout meanwhile (nothing without a timeout),
    with what ``work`` last said of its progress."""
    every = heartbeat_interval(activity.info().heartbeat_timeout)
    said: list[str] = []
    token = _said.set(said)  # the task below runs in a copy of this context: it shares the list
    try:
        task = asyncio.ensure_future(work)
    finally:
        _said.reset(token)
    if every is None:
        return await task
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every)
            if done:
                return task.result()
            activity.heartbeat(*said)
    finally:
        task.cancel()  # the activity was cancelled (or the wait failed): its work goes too


def keeps_alive(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Decorate an async activity (under ``@activity.defn``) to run it under :func:`heartbeating`."""

    @functools.wraps(fn)
    async def run(*args: Any, **kwargs: Any) -> T:
        return await heartbeating(fn(*args, **kwargs))

    return run
