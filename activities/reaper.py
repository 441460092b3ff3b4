"""``reap_orphans``: terminate durastack-tagged cloud instances that no running replica owns.

A running ReplicaWorkflow owns the instances tagged with its (service, group, replica, submission); once it has a
placement, only that placement's instance (the rest are duplicates of a lost launch). An unowned instance is
spared while it is younger than the grace period, and while its key's last ledger phase is ``intent`` (a launch
whose outcome this host has not seen yet). Instances are listed *before* the workflows: an instance that exists
then was launched by a replica that had started by then, so the workflow list that follows includes it if it
still runs. A replica that cannot be queried owns every instance tagged for it: when unsure, keep.

Each pass lists the regions the worker's backends started with and those ``$DURASTACK_HOME/config.yml`` configures
now (read again when the file changed): an instance launched in a region added since, by a worker started later or
by hand, is reaped without a restart of this one.

Each termination is logged with its service, appended to the ledger, and sent to the service's
workflow (signal ``record_event``) when it still runs, so that ``durastack events`` shows it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Mapping, Optional

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from activities import interface
from activities.cloud import activity_error, list_tagged_all, terminate_cloud
from activities.interface import implements
from backends.catalog import load_catalog
from backends.cloud import CloudBackend
from backends.cloud_errors import CloudError
from models.backends import CLOUDS, CloudInstance, config_path, load_backends_config, owner
from models.reaper import ReapAction, ReapRequest, ReapResult, ReplicaReapResult
from models.messages import StopRequest
from models.state import Placement
from models.views import Event
from store import INTENT, TERMINATED, StoreLedger
from rules import names

log = logging.getLogger("durastack.reaper")
RUNNING_REPLICAS = "WorkflowType='ReplicaWorkflow' AND ExecutionStatus='Running'"
RUNNING_SERVICES = "WorkflowType='ServiceRunWorkflow' AND ExecutionStatus='Running'"
# rules.jobs.replica_workflow_id: service/<service>/<group>/r<N>-s<M> (names cannot hold '/').
_REPLICA_ID = re.compile(r"^service/([^/]+)/([^/]+)/r(\d+)-s(\d+)$")
QUERIES_AT_ONCE = 16

Owned = dict[tuple[str, tuple[str, str, str]], Optional[set[str]]]  # (backend, owner) → instance ids; None: all


def parse_replica_workflow_id(workflow_id: str) -> Optional[tuple[str, str, int, int]]:
    m = _REPLICA_ID.match(workflow_id)
    return (m.group(1), m.group(2), int(m.group(3)), int(m.group(4))) if m else None


class ConfiguredRegions:
    """The regions config.yml configures for each cloud now (with the environment's overrides): read again when the
    file changed, which a stat tells, so each pass costs one. A file that no longer loads keeps the regions read
    last (and the worker's log says why)."""

    def __init__(self, environ: Mapping[str, str] = os.environ):
        self.environ = environ
        self._stamp: Optional[tuple[int, int]] = None
        self._regions: dict[str, Optional[list[str]]] = {}

    def now(self) -> dict[str, Optional[list[str]]]:
        """Cloud → its configured regions; an empty list: every catalog region; a cloud not configured is absent."""
        path = config_path(self.environ)
        try:
            stat = path.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
        except FileNotFoundError:
            stamp = (0, -1)
        if stamp != self._stamp:
            try:
                config = load_backends_config(self.environ, path)
            except Exception as e:  # noqa: BLE001 — mid-edit or broken: the regions read last still hold
                log.warning("reaper: %s does not load (%s); reaping the regions read before", path, e)
            else:
                self._regions = {c: list(getattr(config, c).regions) for c in CLOUDS if getattr(config, c)}
            self._stamp = stamp
        return self._regions


class ReaperActivities:
    def __init__(self, client: Client, backends: dict[str, CloudBackend], ledger: StoreLedger, *,
                 now: Callable[[], datetime] = lambda: datetime.now(timezone.utc), gateway=None,
                 configured: Optional[ConfiguredRegions] = None):
        """``client``: to list running replicas and query their placements (injected; tests pass their own).
        ``gateway``: where the route of a service whose run is gone is removed with its replicas (None: left).
        ``configured``: the regions config.yml configures now (default: this process's home and environment)."""
        self.client, self.backends, self.ledger, self.now, self.gateway = client, backends, ledger, now, gateway
        self.configured = configured or ConfiguredRegions()

    def regions(self, backends: dict[str, CloudBackend]) -> dict[str, list[str]]:
        """Where each backend's instances are looked for: the regions it started with, and those configured now."""
        configured = self.configured.now()
        out = {}
        for name, backend in backends.items():
            current = configured.get(name)
            if current == []:  # every catalog region
                current = [o.region for o in load_catalog() if o.backend == name]
            out[name] = sorted(set(backend.regions) | set(current or []))
        return out

    @implements(interface.reap_orphans)
    async def reap_orphans(self, req: ReapRequest) -> ReapResult:
        backends = {n: b for n, b in self.backends.items() if n in req.backends}
        result = ReapResult(task_queue=activity.info().task_queue)
        try:
            instances = await asyncio.to_thread(  # first: see the module doc
                lambda: list_tagged_all(backends, regions=self.regions(backends)))
        except CloudError as e:
            raise activity_error(e) from e
        instances = [i for i in instances if i.state != "terminated"]
        result.checked = len(instances)
        owned = await self._owned(list(backends))
        phases = await asyncio.to_thread(self.ledger.last_phases, [i.key for i in instances])
        young = self.now() - timedelta(seconds=req.grace_seconds)
        errors = []
        for instance in instances:
            activity.heartbeat(instance.instance_id)
            reason = _orphaned(instance, owned)
            if reason is None:
                continue
            launched = instance.launched_at
            if launched is not None and launched.tzinfo is None:
                launched = launched.replace(tzinfo=timezone.utc)
            if launched is None or launched > young or phases.get(instance.key) == INTENT:
                result.spared += 1
                continue
            try:
                await asyncio.to_thread(terminate_cloud, instance, backends=backends)
            except CloudError as e:  # the next pass tries again
                errors.append(f"{instance.instance_id}: {e.message}")
                continue
            action = ReapAction(service=instance.owner[0], backend=instance.backend, instance_id=instance.instance_id,
                                region=instance.region, owner=instance.owner[2], reason=reason)
            await asyncio.to_thread(self.ledger.record, instance.key, TERMINATED,
                                    {"reaped": reason, **action.model_dump(exclude={"reason"})})
            log.warning("reaped %s %s of service %s (%s, launched %s): %s", instance.backend, instance.instance_id,
                        action.service, action.owner, instance.launched_at, reason)
            result.terminated.append(action)
            await self._tell(action)
        result.error = "; ".join(errors)[:2000]
        return result

    @implements(interface.reap_replicas)
    async def reap_replicas(self, grace_seconds: int) -> ReplicaReapResult:
        """Stop the running replica workflows no service run owns: its service was terminated (its children are
        abandoned, by design, so that they outlive a continue-as-new) or reset to a point before it started them.
        A replica started within ``grace_seconds`` is spared, and so is every replica of a service that cannot be
        asked (when unsure, keep). Stopped through the replica's own `stop`: it leaves the gateway and tears down."""
        result = ReplicaReapResult()
        young = self.now() - timedelta(seconds=grace_seconds)
        by_service = await self._running_replicas(
            lambda service, wf: wf.start_time is not None and wf.start_time <= young, result)
        for service, replicas in sorted(by_service.items()):
            activity.heartbeat(service)
            owned, why = await self._owner_of(service)
            if owned is not None:
                await self._stop_all(service, [r for r in replicas if r not in owned], why, owned == set(), result)
        return result

    @implements(interface.reap_closed)
    async def reap_closed(self) -> ReplicaReapResult:
        """The quick pass: stop at once the running replica workflows of a service whose run has closed without
        stopping them (terminated from the Web UI, timed out), its route with them. No grace and no query: the
        server alone answers (one list of open services, and a describe of each service that seems closed, since
        the list may lag a start). A reset, whose run is open, waits for ``reap_replicas``."""
        result = ReplicaReapResult()
        open_runs = {wf.id async for wf in self.client.list_workflows(RUNNING_SERVICES)}
        by_service = await self._running_replicas(lambda service, wf: f"service/{service}" not in open_runs, result)
        for service, replicas in sorted(by_service.items()):
            activity.heartbeat(service)
            why = await self._closed(service)
            if why:
                await self._stop_all(service, replicas, why, True, result)
        return result

    async def _running_replicas(self, keep: Callable[[str, Any], bool],
                                result: ReplicaReapResult) -> dict[str, list[str]]:
        """Service → ids of its running replica workflows that ``keep(service, listed workflow)``, each counted."""
        by_service: dict[str, list[str]] = {}
        async for wf in self.client.list_workflows(RUNNING_REPLICAS):
            result.checked += 1
            parsed = parse_replica_workflow_id(wf.id)
            if parsed is not None and keep(parsed[0], wf):
                by_service.setdefault(parsed[0], []).append(wf.id)
        return by_service

    async def _stop_all(self, service: str, replicas: list[str], why: str, no_run: bool,
                        result: ReplicaReapResult) -> None:
        """Stop the service's orphan replicas; with ``no_run`` (no open run: nobody else removes it), its route."""
        for workflow_id in replicas:
            await self._stop_replica(workflow_id, why)
            result.stopped.append(f"{workflow_id}: {why}")
        if no_run and self.gateway is not None:
            try:
                await self.gateway.delete_service(service)
            except Exception as e:  # noqa: BLE001 — the next pass tries again while replicas remain
                log.info("reaper: could not remove the route of %s: %s", service, e)

    async def _closed(self, service: str) -> Optional[str]:
        """Why the service has no open run ("its service run is terminated"); '' while one is open; None when it
        cannot be asked."""
        try:
            status = (await self.client.get_workflow_handle(f"service/{service}").describe()).status
        except RPCError as e:
            if e.status == RPCStatusCode.NOT_FOUND:
                return "its service run is gone"
            log.info("reaper: cannot ask service %s (%s); keeping its replicas", service, e)
            return None
        if status == WorkflowExecutionStatus.RUNNING:
            return ""
        return f"its service run is {status.name.lower().replace('_', ' ')}"

    async def _owner_of(self, service: str) -> tuple[Optional[set[str]], str]:
        """The replica workflows the service's open run owns (empty when no run is open), and why the others are
        orphans; None when the service cannot be asked."""
        why = await self._closed(service)
        if why is None:
            return None, ""
        if why:
            return set(), why
        try:
            return set(await self.client.get_workflow_handle(f"service/{service}").query(
                "owned", result_type=list[str], rpc_timeout=timedelta(seconds=10))), \
                "its service run does not own it (reset past its start?)"
        except Exception as e:  # noqa: BLE001 — e.g. a query that met a continue-as-new: next pass
            log.info("reaper: cannot ask service %s (%s); keeping its replicas", service, e)
        return None, ""

    async def _stop_replica(self, workflow_id: str, why: str) -> None:
        log.warning("reaper: stopping orphan replica %s: %s", workflow_id, why)
        try:
            await self.client.get_workflow_handle(workflow_id).signal("stop", StopRequest(reason=f"orphaned: {why}"))
        except Exception as e:  # noqa: BLE001 — it ended meanwhile: nothing to stop
            log.info("reaper: could not stop %s: %s", workflow_id, e)

    async def _tell(self, action: ReapAction) -> None:
        event = Event(at=self.now(), kind="reap", message=f"terminated orphan {action.backend} instance "
                                                          f"{action.instance_id} ({action.owner}): {action.reason}")
        try:
            await self.client.get_workflow_handle(f"service/{action.service}").signal(names.RECORD_EVENT, event)
        except Exception as e:  # noqa: BLE001 — the service is gone: the ledger and the log keep it
            log.info("reaper: could not tell service %s: %s", action.service, e)

    async def _owned(self, backends: list[str]) -> Owned:
        owned: Owned = {}
        limit = asyncio.Semaphore(QUERIES_AT_ONCE)

        async def one(workflow_id: str, run_id: Optional[str]) -> None:
            parsed = parse_replica_workflow_id(workflow_id)
            if parsed is None:
                return
            ids: Optional[set[str]] = None
            try:
                async with limit:
                    placement = await self.client.get_workflow_handle(workflow_id, run_id=run_id).query(
                        "placement", result_type=Optional[Placement], rpc_timeout=timedelta(seconds=10))
                if placement is not None:
                    ids = {placement.instance_id}
            except Exception as e:  # noqa: BLE001 — unsure: it keeps every instance tagged for it
                log.info("reaper: no placement from %s (%s); keeping its instances", workflow_id, e)
            for backend in backends:
                owned[(backend, owner(backend, *parsed))] = ids

        running = [(wf.id, wf.run_id) async for wf in self.client.list_workflows(RUNNING_REPLICAS)]
        await asyncio.gather(*(one(*w) for w in running))
        return owned


def _orphaned(instance: CloudInstance, owned: Owned) -> Optional[str]:
    """Why no running replica owns ``instance``; None if one does."""
    key = (instance.backend, instance.owner)
    if key not in owned:
        return f"no running replica {'/'.join(instance.owner)}"
    ids = owned[key]
    if ids is None or instance.instance_id in ids:
        return None
    return f"replica {'/'.join(instance.owner)} runs on {', '.join(sorted(ids))}, not on this instance"


__all__ = ["RUNNING_REPLICAS", "ConfiguredRegions", "ReaperActivities", "parse_replica_workflow_id"]
