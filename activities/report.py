"""Reports from a replica's activities to its service: fire-and-forget signals, one per lifecycle milestone.

The launch and teardown activities tell the service run (``ServiceRunWorkflow.replica_changed``) as they go,
so the replica's own workflow spends no events relaying them. Each milestone has a fixed ``seq``: a retried
attempt sends the same seq again and the service drops any report not newer than the last it applied, so
retries and late signals never move a replica backwards. A report that cannot be sent (the service run is
gone, Temporal is briefly away) is logged and dropped: it must never fail the work it reports on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Awaitable, Callable

from temporalio import activity

from models.replica import JobSpec
from models.run import Instance, Placement, ReplicaStatus, ReplicaUpdate, Step

log = logging.getLogger("durastack.report")
PROVISIONING, PROVISIONED, SERVING, TERMINATING, FINISHED = (Step.PROVISIONING, Step.PROVISIONED, Step.SERVING,
                                                              Step.TERMINATING, Step.FINISHED)


async def report(service_workflow_id: str, job: JobSpec, seq: int, status: ReplicaStatus, *, ready: bool = False,
                 registered: bool = False, placement: Placement | None = None, instance: Instance | None = None,
                 reason: str = "", refs: dict[str, str] | None = None) -> None:
    """Signal ``status`` to the service run ``service_workflow_id``, from inside an activity."""
    # Imported here, not at the top: the workflow modules import the activity interface, so a top-level import
    # would make activity and workflow modules import each other.
    from workflows.service import ServiceRunWorkflow

    update = ReplicaUpdate(replica_num=job.replica_num, submission_num=job.submission_num, status=status,
                           ready=ready, registered=registered, placement=placement, instance=instance,
                           reason=reason, seq=seq, refs=refs or {})
    try:
        await activity.client().get_workflow_handle(service_workflow_id).signal(
            ServiceRunWorkflow.replica_changed, update)
    except Exception as e:  # noqa: BLE001 — see the module doc: a report never fails its activity
        log.warning("%s: could not report %s (seq %d) to %s: %s", job.replica_id, status, seq,
                    service_workflow_id, e)


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
        if not sending:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return settle
