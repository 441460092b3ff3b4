"""Keeping an in-service router's worker list (``router: {type: sglang}``) equal to the service's ready workers.

SGLang's model gateway (``smg``) starts with no workers and learns them through its worker API: ``GET /workers``,
``POST /workers`` with the worker's URL, its ``worker_type`` (``prefill``, ``decode`` or ``regular``, read from the
worker's own ``GET /server_info`` ``disaggregation_mode``) and, for a prefill worker, its ``bootstrap_port``
(``disaggregation_bootstrap_port``), and ``DELETE /workers/<id>``. Older routers answer 404 to those and take
``/list_workers``, ``POST /add_worker?url=…`` and ``POST /remove_worker?url=…`` instead.

``sync_router`` is one long activity per service, on the router's backend queue (as the monitor): every second it
reads each router replica's list and puts it right, and returns only when what the routers know changed, so a
steady service writes no history. ``leave_router`` takes a worker out before its teardown stops it and waits for
its in-flight requests (its engine's running and queued requests, from its Prometheus endpoint).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

import httpx

from activities import interface
from activities.interface import implements
from activities.watch import watch_until_down
from backends.engine_metrics import in_flight
from backends.http import Connect, client_for
from models.router import RouterEntry, RouterLeave, RouterState, RouterSyncInput, RouterTarget, RouterView
from temporalio import activity

log = logging.getLogger("durastack.router")
TIMEOUT = 3.0
LEAVE_SECONDS = 10.0  # longest wait for a router to drop a worker (it removes in the background)
DRAIN_POLL_SECONDS = 0.1
NO_METRICS_GRACE = 2.0  # a worker whose engine says nothing of its requests gets this long to finish them

# Where the worker reaches an instance's app: (address, connect), as its backend's probes do.
Reach = Callable[[object], tuple[str, Optional[Connect]]]


class RouterError(Exception):
    pass


async def _request(address: str, connect: Optional[Connect], method: str, path: str, **kw) -> httpx.Response:
    """One call to an app (a router's API, a worker's engine) as the probes reach it; unreachable: RouterError."""
    client, base = client_for(address, TIMEOUT, connect)
    async with client:
        try:
            return await client.request(method, base + path, **kw)
        except httpx.HTTPError as e:
            raise RouterError(f"{method} {path}: {type(e).__name__} {e}".strip()) from None


class WorkerAPI:
    """One router replica's worker API."""

    def __init__(self, address: str, connect: Optional[Connect] = None):
        self.address, self.connect = address, connect
        self.legacy = False  # answers 404 to /workers: the older /list_workers, /add_worker, /remove_worker

    async def _call(self, method: str, path: str, **kw) -> httpx.Response:
        return await _request(self.address, self.connect, method, path, **kw)

    async def workers(self) -> dict[str, tuple[str, RouterEntry]]:
        """url → (the router's id for it, the entry)."""
        if not self.legacy:
            r = await self._call("GET", "/workers")
            if r.status_code != 404:
                _ok(r, "GET /workers")
                return {w["url"]: (str(w.get("id") or w["url"]), _entry(w)) for w in r.json().get("workers", [])}
            self.legacy = True
        r = await self._call("GET", "/list_workers")
        _ok(r, "GET /list_workers")
        return {u: (u, RouterEntry(url=u, healthy=True)) for u in r.json().get("urls", [])}

    async def add(self, url: str, worker_type: str, bootstrap_port: Optional[int]) -> bool:
        """Whether the router took it now (False: it had it already, its addition still pending when listed)."""
        extra = {"bootstrap_port": bootstrap_port} if worker_type == "prefill" and bootstrap_port else {}
        if not self.legacy:
            r = await self._call("POST", "/workers", json={"url": url, "worker_type": worker_type, **extra})
            if r.status_code != 404:
                if r.status_code == 409 or "ALREADY_EXISTS" in r.text:
                    return False
                _ok(r, f"POST /workers {url}")
                return True
            self.legacy = True
        params = {"url": url, **({"worker_type": worker_type} if worker_type != "regular" else {}), **extra}
        _ok(await self._call("POST", "/add_worker", params=params), f"POST /add_worker {url}")
        return True

    async def remove(self, url: str, worker_id: str) -> None:
        """Gone already (404) is no error: another sync or a leaving worker removed it."""
        if self.legacy:
            r = await self._call("POST", "/remove_worker", params={"url": url})
        else:
            r = await self._call("DELETE", f"/workers/{worker_id}")
        if r.status_code != 404:
            _ok(r, f"remove {url}")


def _ok(r: httpx.Response, what: str) -> None:
    if r.status_code >= 300:
        raise RouterError(f"{what}: HTTP {r.status_code} {r.text[:200]}")


def _entry(w: dict) -> RouterEntry:
    healthy = bool(w.get("is_healthy", True)) and w.get("status", "ready") in ("ready", "healthy")
    return RouterEntry(url=w["url"], worker_type=str(w.get("worker_type") or "regular"), healthy=healthy)


async def worker_role(address: str, connect: Optional[Connect]) -> tuple[str, Optional[int]]:
    """The worker's role and bootstrap port, from its engine's ``/server_info`` (``regular`` when it has none)."""
    r = await _request(address, connect, "GET", "/server_info")
    if r.status_code == 404:  # older engines
        r = await _request(address, connect, "GET", "/get_server_info")
    if r.status_code >= 300:
        return "regular", None
    info = r.json()
    mode = str(info.get("disaggregation_mode") or "null")
    port = info.get("disaggregation_bootstrap_port")
    return (mode if mode in ("prefill", "decode") else "regular"), (int(port) if port else None)


class RouterActivities:
    def __init__(self, reach: Callable[[str], Optional[Reach]]):
        """``reach(backend)``: how this worker reaches an instance's app on that backend (None: not served here):
        the backend's own ``reach``, as its probes connect."""
        self.reach = reach
        # A worker's role and bootstrap port, read once per replica submission (an address may be handed to another
        # replica later, with another role or port).
        self.roles: dict[tuple[int, int, str], tuple[str, Optional[int]]] = {}
        self.newest: dict[str, float] = {}  # service → the newest sync started here: an older one stops acting

    @implements(interface.sync_router)
    async def sync(self, inp: RouterSyncInput) -> RouterView:
        reach = self._reach(inp.backend)
        mine = activity.info().scheduled_time.timestamp()
        self.newest[inp.service] = max(self.newest.get(inp.service, 0.0), mine)
        apis = {(t.replica_num, t.submission_num): WorkerAPI(*reach(t.instance)) for t in inp.routers}
        changes: list[str] = []

        async def check() -> Optional[RouterView]:
            if self.newest[inp.service] > mine:  # the service started a newer sync (and cancels this one): it acts now
                return inp.known
            view = RouterView(routers=[await self._put_right(inp, t, apis[t.replica_num, t.submission_num], reach,
                                                             changes) for t in inp.routers], changes=changes)
            return view if changes or view.without_changes() != inp.known.without_changes() else None

        return await watch_until_down(check, inp.poll_seconds)

    async def _put_right(self, inp: RouterSyncInput, target: RouterTarget, api: WorkerAPI, reach: Reach,
                         changes: list[str]) -> RouterState:
        state = RouterState(replica_num=target.replica_num, submission_num=target.submission_num)
        name = f"router r{target.replica_num}"
        try:
            known = await api.workers()
            wanted = {w.url: w for w in inp.workers}
            for url, (worker_id, _) in known.items():
                if url not in wanted:
                    await api.remove(url, worker_id)
                    changes.append(f"{name}: removed {url}")
            for url, w in wanted.items():
                if url in known:
                    continue
                key = (w.replica_num, w.submission_num, url)
                role = self.roles.get(key)
                if role is None:
                    role = self.roles[key] = await worker_role(*reach(w.instance))
                if await api.add(url, *role):
                    changes.append(f"{name}: added {w.group} replica {w.replica_num} ({url}, {role[0]})")
            if changes:
                known = await api.workers()
            state.workers = sorted((e for _, e in known.values()), key=lambda e: e.url)
        except RouterError as e:
            state.reachable, state.error = False, str(e)
        return state

    async def leave(self, backend: str, leave: RouterLeave, drain_seconds: float, worker: object) -> None:
        """Take the worker at ``leave.url`` out of every router, then wait for its in-flight requests (within
        ``drain_seconds``). A router that cannot be reached holds nothing to take it out of: a dead router's
        replacement learns only the workers that serve."""
        reach = self._reach(backend)
        deadline = time.monotonic() + LEAVE_SECONDS
        for target in leave.routers:
            api = WorkerAPI(*reach(target.instance))
            while time.monotonic() < deadline:
                try:
                    entry = (await api.workers()).get(leave.url)
                    if entry is None:
                        break
                    await api.remove(leave.url, entry[0])
                except RouterError as e:
                    log.info("%s: router r%d not reached while leaving it: %s", leave.url, target.replica_num, e)
                    break
                await asyncio.sleep(DRAIN_POLL_SECONDS)
        await self._drain(reach(worker), drain_seconds if leave.grace_seconds is None else leave.grace_seconds)

    async def _drain(self, where: tuple[str, Optional[Connect]], seconds: float) -> None:
        """Until the engine has no running or queued request (or ``seconds``); without such metrics, a short grace."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            busy = await in_flight(*where)
            if busy == 0:
                return
            if busy is None:
                await asyncio.sleep(min(NO_METRICS_GRACE, max(0.0, deadline - time.monotonic())))
                return
            await asyncio.sleep(DRAIN_POLL_SECONDS)

    def _reach(self, backend: str) -> Reach:
        reach = self.reach(backend)
        if reach is None:
            raise RouterError(f"backend {backend} is not served by this worker")
        return reach
