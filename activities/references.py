"""A placed replica's late references (workflows/addresses.py): asked of its service until each one resolves.

The launch calls ``resolve_late`` between placing the replica and running its commands. The replica's own
address goes to the service first (its `running` report): a reference to it, its own included, resolves from
that. Then the service is asked (query ``addresses``, nothing in history) until every value exists; meanwhile the
launch heartbeats, so a stop cancels the wait.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from temporalio import activity
from temporalio.service import RPCError

from activities.report import PROVISIONED, report
from models.interpolation import fill
from models.run import AddressAnswer, AddressQuery, Instance, Placement, ReplicaInput

log = logging.getLogger("durastack.references")
FIRST_POLL_SECONDS = 0.05  # the replicas of a service are placed together: most values exist within a poll or two
MAX_POLL_SECONDS = 2.0


async def resolve_late(inp: ReplicaInput, placement: Placement, instance: Instance) -> tuple[ReplicaInput, dict]:
    """``inp`` with its late references filled in (commands and env), and their values."""
    if not inp.late_refs:
        return inp, {}
    job, poll, said = inp.job, FIRST_POLL_SECONDS, ""
    handle = activity.client().get_workflow_handle(inp.service_workflow_id)
    query = AddressQuery(replica_num=job.replica_num, submission_num=job.submission_num, keys=inp.late_refs)
    placed = False
    while True:
        if not placed:  # told again while the service has not got it: reports are fire-and-forget
            await report(inp.service_workflow_id, job, PROVISIONED, "running", placement=placement, instance=instance)
        answer = await _ask(handle, query)
        placed = answer is not None and answer.placed
        if placed and answer is not None and not answer.missing:
            break
        why = "; ".join(f"{k} {w}" for k, w in sorted(answer.missing.items())) if answer else "no answer"
        if why != said:
            log.info("%s: placed; its commands wait: %s", job.replica_id, why or "its own address")
            said = why
        activity.heartbeat(f"placed; waiting for addresses: {why}")
        await asyncio.sleep(poll)
        poll = min(poll * 2, MAX_POLL_SECONDS)
    values = {k: answer.values[k] for k in inp.late_refs}
    env = {**job.env, **{name: values[key] for name, key in inp.late_env.items()}}
    filled = job.model_copy(update={"commands": fill(job.commands, values), "env": env})
    return inp.model_copy(update={"job": filled}), values


async def _ask(handle, query: AddressQuery) -> Optional[AddressAnswer]:
    try:
        return await handle.query("addresses", query, result_type=AddressAnswer)
    except RPCError as e:  # e.g. the service's worker is away a moment: asked again
        log.info("cannot ask %s for addresses: %s", handle.id, e)
        return None
