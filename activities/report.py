"""Reports from a replica's activities to its service: fire-and-forget signals, one per lifecycle milestone.

The launch and teardown activities tell the service run (``ServiceRunWorkflow.replica_changed``) as they go,
so the replica's own workflow spends no events relaying them. Each milestone has a fixed ``seq``: a retried
attempt sends the same seq again and the service drops any report not newer than the last it applied, so
retries and late signals never move a replica backwards. A report that cannot be sent (the service run is
gone, Temporal is briefly away) is logged and dropped: it must never fail the work it reports on. Those the
service must not miss are made good: `placed` is sent again until the service's ``addresses`` query says it has
it (``report_placed``), and the replica's workflow repeats `serving` and the end durably (workflows/replica.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Awaitable, Callable, Optional

from temporalio import activity
from temporalio.service import RPCError

from activities.liveness import progress
from models.replica import JobSpec
from models.messages import ReplicaUpdate, Step
from models.router import Instance
from models.state import Placement, ReplicaStatus
from models.views import Event
from rules.names import RECORD_EVENT, REPLICA_CHANGED

if TYPE_CHECKING:
    from models.messages import AddressAnswer

log = logging.getLogger("durastack.report")
FIRST_POLL_SECONDS = 0.05  # the replicas of a service are placed together: most answers come within a poll or two
MAX_POLL_SECONDS = 2.0
SETTLE_SECONDS = 5.0
PROVISIONING, PROVISIONED, SERVING, TERMINATING, FINISHED = (Step.PROVISIONING, Step.PROVISIONED, Step.SERVING,
                                                              Step.TERMINATING, Step.FINISHED)


async def report(service_workflow_id: str, job: JobSpec, seq: int, status: ReplicaStatus, **fields) -> None:
    """Signal ``status`` to the service run ``service_workflow_id``, from inside an activity; ``fields``: those of
    ``ReplicaUpdate`` (ready, registered, placement, instance, reason, refs, idle)."""
    try:
        await send_report(activity.client(), service_workflow_id, replica_update(job, seq, status, **fields))
    except Exception as e:  # noqa: BLE001 — see the module doc: a report never fails its activity
        log.warning("%s: could not report %s (seq %d) to %s: %s", job.replica_id, status, seq,
                    service_workflow_id, e)


def replica_update(job: JobSpec, seq: int, status: ReplicaStatus, *, ready: bool = False, registered: bool = False,
                   placement: Placement | None = None, instance: Instance | None = None, reason: str = "",
                   refs: dict[str, str] | None = None, idle: bool = False) -> ReplicaUpdate:
    return ReplicaUpdate(replica_num=job.replica_num, submission_num=job.submission_num, status=status,
                         ready=ready, registered=registered, placement=placement, instance=instance,
                         reason=reason, seq=seq, refs=refs or {}, idle=idle)


async def send_report(client, service_workflow_id: str, update: ReplicaUpdate) -> None:
    # By name, not by the workflow's method: activities sit below the workflows and never import them.
    await client.get_workflow_handle(service_workflow_id).signal(REPLICA_CHANGED, update)


async def record_event(service_workflow_id: str, job: JobSpec, kind: str, message: str) -> None:
    """Put ``message`` in the service's log (`durastack events`, the replica's group), from inside an activity; as a
    report, never failing the work it tells of."""
    event = Event(at=datetime.now(timezone.utc), kind=kind, group=job.group, message=message)
    try:
        await activity.client().get_workflow_handle(service_workflow_id).signal(RECORD_EVENT, event)
    except Exception as e:  # noqa: BLE001 — see the module doc
        log.warning("%s: could not tell %s %r: %s", job.replica_id, service_workflow_id, message, e)


async def report_placed(service_workflow_id: str, job: JobSpec, placement: Placement, instance: Instance, *,
                        ask_first: bool = False) -> None:
    """The `placed` report, sent until the service has it (its ``addresses`` query says so; nothing in history).
    A lost one left the service without the replica's address for as long as it loaded: a reference to it could
    not resolve, and `ps` showed no instance. ``ask_first``: it may have it already (a later attempt of the
    readiness step), and each report is an event in its history. The caller ends this when the next report
    supersedes it."""
    from models.messages import AddressQuery

    handle = activity.client().get_workflow_handle(service_workflow_id)
    query = AddressQuery(replica_num=job.replica_num, submission_num=job.submission_num, keys=[])
    poll, send = FIRST_POLL_SECONDS, not ask_first
    while True:
        if send:
            await report(service_workflow_id, job, PROVISIONED, "running", placement=placement, instance=instance)
        answer = await ask_addresses(handle, query)
        if answer is not None and answer.placed:
            return
        send = True
        progress("placed; telling the service")
        await asyncio.sleep(poll)
        poll = min(poll * 2, MAX_POLL_SECONDS)


async def ask_addresses(handle, query) -> Optional["AddressAnswer"]:
    """The service's answer to ``addresses``, or None when it cannot answer now (its worker is away a moment)."""
    from models.messages import AddressAnswer

    try:
        return await handle.query("addresses", query, result_type=AddressAnswer)
    except RPCError as e:
        log.info("cannot ask %s for addresses: %s", handle.id, e)
        return None


def unless_quick(delay: float, send: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    """Send a report only if the step it announces is still going after ``delay`` seconds; returns what to await
    when the step ends. A step that ends sooner is told by the next report alone (its seq is higher): a local
    replica's processes start in milliseconds, and each report costs the service a workflow task."""
    sending = delay <= 0

    async def later() -> None:
        nonlocal sending
        if not sending:
            await asyncio.sleep(delay)
            sending = True
        await send()

    task = asyncio.ensure_future(later())

    async def settle() -> None:
        # A send under way gets a moment to finish (reports then arrive in order); one that goes on (a service
        # that does not answer) is dropped: the next report, of a higher seq, says it all.
        if sending:
            await asyncio.wait({task}, timeout=SETTLE_SECONDS)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return settle
