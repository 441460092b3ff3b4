"""A placed replica's late references (rules/addresses.py): asked of its service until each one resolves.

The launch calls ``resolve_late`` between placing the replica and running its commands. The replica's own
address goes to the service first (its `running` report): a reference to it, its own included, resolves from
that. Then the service is asked (query ``addresses``, nothing in history) until every value exists; meanwhile the
launch heartbeats, so a stop cancels the wait.
"""

from __future__ import annotations

import asyncio
import logging

from temporalio import activity

from activities.liveness import progress
from activities.report import FIRST_POLL_SECONDS, MAX_POLL_SECONDS, ask_addresses, report_placed
from models.interpolation import fill
from models.messages import AddressQuery, ReplicaInput
from models.router import Instance
from models.state import Placement

log = logging.getLogger("durastack.references")


async def resolve_late(inp: ReplicaInput, placement: Placement, instance: Instance) -> tuple[ReplicaInput, dict]:
    """``inp`` with its late references filled in (commands and env), and their values."""
    if not inp.late_refs:
        return inp, {}
    job, poll, said = inp.job, FIRST_POLL_SECONDS, ""
    await report_placed(inp.service_workflow_id, job, placement, instance)  # its own address first
    handle = activity.client().get_workflow_handle(inp.service_workflow_id)
    query = AddressQuery(replica_num=job.replica_num, submission_num=job.submission_num, keys=inp.late_refs)
    while True:
        answer = await ask_addresses(handle, query)
        if answer is not None and not answer.missing:
            break
        why = "; ".join(f"{k} {w}" for k, w in sorted(answer.missing.items())) if answer else "no answer"
        if why != said:
            log.info("%s: placed; its commands wait: %s", job.replica_id, why or "its own address")
            said = why
        progress(f"placed; waiting for addresses: {why}")
        await asyncio.sleep(poll)
        poll = min(poll * 2, MAX_POLL_SECONDS)
    values = {k: answer.values[k] for k in inp.late_refs}
    env = {**job.env, **{name: values[key] for name, key in inp.late_env.items()}}
    filled = job.model_copy(update={"commands": fill(job.commands, values), "env": env})
    return inp.model_copy(update={"job": filled}), values
