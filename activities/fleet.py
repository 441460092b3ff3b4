"""The fleet monitor's activity (workflows/fleet.py): every service's serving replicas on one backend, one loop.

Each pass does what a service's own monitor does for its replicas (activities/replica.py ``monitor``): the
backend says which instances are down; those are unrouted at once and their service is told (signal
``replicas_down``). Replica workflows that closed without tearing down (terminated from the Web UI) are found by
one visibility query for the whole backend, not one describe per replica every 5 s, and confirmed by a describe
of each found. What is watched comes from the workflow (query ``changes``), asked every ``query_seconds``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timedelta, timezone
from typing import Optional

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from activities.liveness import heartbeating, progress
from backends.base import Backend
from models.messages import Down, FleetChanges, FleetDowns, FleetInput, MonitorInput, Watched

log = logging.getLogger("durastack.fleet")

# A down that was told is told again after this while its service still lists the replica: the signal may have
# reached a run that was closing.
TELL_AGAIN_SECONDS = 60.0
# Visibility is written after the close: closes are listed from this far back of the last listing.
CLOSED_MARGIN = timedelta(seconds=60)
REPLICA_WORKFLOW = "ReplicaWorkflow"
RPC_SECONDS = 10.0  # a query or listing not answered within this is asked again at the next turn
# A replica workflow that ended like this tore nothing down: its instance and route are left to the service. One
# that completed or was cancelled tore itself down (a lingering monitor must not unroute it again).
ORPHANED_BY = (WorkflowExecutionStatus.TERMINATED, WorkflowExecutionStatus.TIMED_OUT, WorkflowExecutionStatus.FAILED)


def down_of(w: Watched, reason: str, workflow_closed: bool = False) -> Down:
    return Down(replica_num=w.replica_num, submission_num=w.submission_num, reason=reason,
                workflow_closed=workflow_closed)


def closed_down(w: Watched, status: Optional[WorkflowExecutionStatus]) -> Optional[Down]:
    """Down when its workflow ended without tearing down, or is not found (``status`` None)."""
    if status is not None and status not in ORPHANED_BY:
        return None
    why = "not found" if status is None else status.name.lower().replace("_", " ")
    return down_of(w, f"replica workflow {why}", workflow_closed=True)


def merged(downs: list[Down], more: list[Down]) -> list[Down]:
    """``downs``, then those of ``more`` about other replicas."""
    seen = {(d.replica_num, d.submission_num) for d in downs}
    return downs + [d for d in more if (d.replica_num, d.submission_num) not in seen]


async def closed_workflows(client: Client, watched: list[Watched]) -> list[Down]:
    """The watched replicas whose workflow ended without tearing down (e.g. terminated from the Web UI), by a
    describe of each: its latest run decides (a reset's old run closed, its new one runs)."""

    async def closed(w: Watched) -> Optional[Down]:
        try:
            status = (await client.get_workflow_handle(w.workflow_id).describe()).status
        except RPCError as e:
            if e.status != RPCStatusCode.NOT_FOUND:
                log.warning("could not describe %s: %s (keeps watching)", w.workflow_id, e)
                return None
            status = None
        return closed_down(w, status)

    return [d for d in await asyncio.gather(*(closed(w) for w in watched)) if d is not None]


class FleetWatch:
    """The watched set as the workflow last told it, and what was told to each service."""

    def __init__(self, inp: FleetInput, backend: Backend, gateway, client: Client, workflow_id: str) -> None:
        self.inp, self.backend, self.gateway, self.client = inp, backend, gateway, client
        self.fleet = client.get_workflow_handle(workflow_id)
        self.watched: dict[str, MonitorInput] = {}
        self.version = 0
        self.told: dict[tuple[str, int, int], float] = {}  # (service, replica, submission) → when told (monotonic)
        self.listed_to = datetime.now(timezone.utc) - CLOSED_MARGIN

    async def run(self) -> None:
        """Heartbeats go out on their own (``heartbeating``): a slow call here (a busy workflow's query, a cloud's
        API) must not make the watch look dead."""
        await heartbeating(self._watch())

    async def _watch(self) -> None:
        asked = polled = listed = float("-inf")
        while True:
            now = time.monotonic()
            if now - asked >= self.inp.query_seconds:
                await self.ask()
                asked = now
            downs: dict[str, list[Down]] = {}
            if now - polled >= self.poll_seconds():
                downs = await self.instances_down()
                polled = now
            if now - listed >= self.inp.closed_check_seconds:
                for service, more in (await self.workflows_closed()).items():
                    downs[service] = merged(downs.get(service, []), more)
                listed = now
            await asyncio.gather(*(self.tell(s, d) for s, d in downs.items() if d))
            progress(f"watching {sum(len(w.replicas) for w in self.watched.values())} replicas of "
                     f"{len(self.watched)} services")
            await asyncio.sleep(min(self.poll_seconds(), self.inp.query_seconds))

    def poll_seconds(self) -> float:
        asked = min((w.poll_seconds for w in self.watched.values()), default=self.inp.query_seconds)
        return max(asked, self.backend.min_poll_seconds)

    async def ask(self) -> None:
        """Take what changed in the watched set since the last answer (nothing while the workflow does not answer,
        e.g. its worker restarting: what is known is still watched)."""
        try:
            changes = await self.fleet.query("changes", self.version, result_type=FleetChanges,
                                             rpc_timeout=timedelta(seconds=RPC_SECONDS))
        except RPCError as e:  # a busy workflow answers a query after its workflow task: that may take long
            log.warning("the fleet monitor did not say what changed: %s (asks again)", e)
            return
        if changes.full:
            self.watched = {}
        for w in changes.watched:
            if w.replicas:
                self.watched[w.service] = w
                await self.backend.adopt(w.service, w.replicas)  # e.g. cloud replicas' tunnels, after a restart
            else:
                self.watched.pop(w.service, None)
        self.version = changes.version
        keys = {(s, r.replica_num, r.submission_num) for s, w in self.watched.items() for r in w.replicas}
        self.told = {k: t for k, t in self.told.items() if k in keys}

    def untold(self) -> list[tuple[str, Watched]]:
        now = time.monotonic()
        return [(s, r) for s, w in self.watched.items() for r in w.replicas
                if now - self.told.get((s, r.replica_num, r.submission_num), float("-inf")) >= TELL_AGAIN_SECONDS]

    async def instances_down(self) -> dict[str, list[Down]]:
        watched = self.untold()
        if not watched:
            return {}
        reasons = await self.backend.down([r.instance for _, r in watched])
        out: dict[str, list[Down]] = {}
        for (service, r), why in zip(watched, reasons):
            if why is not None:
                out.setdefault(service, []).append(down_of(r, why))
        return out

    async def workflows_closed(self) -> dict[str, list[Down]]:
        """Watched replicas whose workflow closed without tearing down, listed once for the whole backend."""
        by_id = {r.workflow_id: (s, r) for s, r in self.untold()}
        since, self.listed_to = self.listed_to, datetime.now(timezone.utc) - CLOSED_MARGIN
        if not by_id:
            return {}
        query = (f"WorkflowType = '{REPLICA_WORKFLOW}' AND ExecutionStatus != 'Running' "
                 f"AND CloseTime >= '{since.strftime('%Y-%m-%dT%H:%M:%S.%fZ')}'")
        try:
            found = {e.id async for e in self.client.list_workflows(query, rpc_timeout=timedelta(seconds=RPC_SECONDS))
                     if e.id in by_id}
        except RPCError as e:
            log.warning("could not list closed replica workflows: %s (looks again)", e)
            self.listed_to = since
            return {}
        mine: dict[str, list[Watched]] = {}
        for wid in sorted(found):
            service, r = by_id[wid]
            mine.setdefault(service, []).append(r)
        return dict(zip(mine, await asyncio.gather(*(closed_workflows(self.client, rs) for rs in mine.values()))))

    async def tell(self, service: str, downs: list[Down]) -> None:
        """Unroute, then tell the service; a service that is gone is watched no more."""
        by_num = {(r.replica_num, r.submission_num): r for r in self.watched[service].replicas}
        await asyncio.gather(*(self.gateway.unregister(service, by_num[d.replica_num, d.submission_num].replica_id)
                               for d in downs))
        log.info("%s on %s: %s", service, self.inp.backend,
                 "; ".join(f"r{d.replica_num}-s{d.submission_num} {d.reason}" for d in downs))
        try:
            await self.client.get_workflow_handle(f"service/{service}").signal(
                "replicas_down", FleetDowns(backend=self.inp.backend, downs=downs),
                rpc_timeout=timedelta(seconds=RPC_SECONDS))
        except RPCError as e:
            if e.status != RPCStatusCode.NOT_FOUND:  # told at the next turn
                log.warning("could not tell %s: %s", service, e)
                return
            log.info("%s is not running: no longer watched", service)
            self.watched.pop(service, None)
            return
        now = time.monotonic()
        for d in downs:
            self.told[service, d.replica_num, d.submission_num] = now

