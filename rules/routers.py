"""The in-service router's worker list, decided from the service's state (pure).

With ``router: {type: sglang}`` the router (SGLang's model gateway) starts with no workers: durastack keeps its
list equal to the service's ready, not-stopping workers (``sync_input``; ``activities/router.py`` does the calls).
A worker behind such a router serves only once a router lists it healthy (``Replica.synced``), so a rolling
update stops an old worker only when its replacement takes traffic; a worker leaves the routers before it stops
(``leave``), so its in-flight requests finish. The router is never restarted because a worker moved.
"""

from __future__ import annotations

from typing import Optional

from models.router import RouterLeave, RouterSyncInput, RouterTarget, RouterView, RouterWorker
from models.state import Replica, ServiceState
from models.service import ServiceConfiguration
from rules.addresses import peer_ip, peer_port
from rules.lifecycle import Note


def synced(config: ServiceConfiguration) -> Optional[str]:
    """The router group whose worker list durastack keeps, or None (no router, or one that finds its workers)."""
    name = config.router_group
    spec = config.group(name) if name else None
    return name if spec is not None and spec.router is not None and spec.router.type == "sglang" else None


def worker_url(state: ServiceState, replica: Replica) -> str:
    """Where the router reaches a worker: its address on the service network, at the port it listens on."""
    if replica.placement is None or not peer_ip(replica.placement):
        return ""
    return f"http://{peer_ip(replica.placement)}:{peer_port(replica.placement, state.config.port.container_port)}"


def _routers(state: ServiceState) -> list[Replica]:
    """The router replicas to keep: placed and running, not asked to stop (two while the router group rolls: the
    new one learns the workers before it is ready, so it takes traffic with them)."""
    group = synced(state.config)
    return [r for r in state.latest()
            if r.group == group and r.status == "running" and r.active and r.instance is not None]


def targets(state: ServiceState) -> list[RouterTarget]:
    return [RouterTarget(replica_num=r.replica_num, submission_num=r.submission_num, instance=r.instance)
            for r in _routers(state)]


def _workers(state: ServiceState) -> list[RouterWorker]:
    group = synced(state.config)
    out = []
    for r in state.latest():
        url = worker_url(state, r)
        if r.group != group and r.status == "running" and r.ready and r.active and r.instance is not None and url:
            out.append(RouterWorker(replica_num=r.replica_num, submission_num=r.submission_num, group=r.group,
                                    url=url, instance=r.instance))
    return out


def sync_input(state: ServiceState) -> Optional[RouterSyncInput]:
    """What the router sync should hold now; None when there is no router to keep."""
    if synced(state.config) is None or state.stopping:
        return None
    routers = _routers(state)
    if not routers or routers[0].placement is None:
        return None
    return RouterSyncInput(service=state.name, backend=routers[0].placement.backend, routers=targets(state),
                           workers=_workers(state), known=state.router_view or RouterView())


def leave(state: ServiceState, replica: Replica) -> Optional[RouterLeave]:
    """How a worker leaves the routers before it stops; None for a replica no synced router knows."""
    group = synced(state.config)
    url = worker_url(state, replica)
    if group is None or replica.group == group or not url:
        return None
    return RouterLeave(routers=targets(state), url=url)


def await_listing(state: ServiceState, added: list[Replica]) -> None:
    """New workers behind the kept router serve only once a router lists them (patch router-sync)."""
    group = synced(state.config)
    for replica in added:
        if group is not None and replica.group != group:
            replica.synced = False


def on_view(state: ServiceState, view: RouterView) -> list[Note]:
    """What the sync saw: kept for `ps -v`, its changes and a router's reachability noted, and workers a router
    lists healthy now serve."""
    group = synced(state.config)
    before = {(r.replica_num, r.submission_num): r for r in (state.router_view.routers if state.router_view else [])}
    notes = [Note("router", change, group) for change in view.changes]
    for r in view.routers:
        was = before.get((r.replica_num, r.submission_num))
        if not r.reachable and (was is None or was.reachable or was.error != r.error):
            notes.append(Note("router", f"router r{r.replica_num} not reached: {r.error} (trying again)", group))
        elif r.reachable and was is not None and not was.reachable:
            notes.append(Note("router", f"router r{r.replica_num} reached again", group))
    state.router_view = view.without_changes()
    healthy = _healthy_in_serving(state, view)
    for r in state.latest():
        if r.synced is False and worker_url(state, r) in healthy:
            r.synced = True
    return notes


def _healthy_in_serving(state: ServiceState, view: RouterView) -> set[str]:
    """Worker URLs a serving router lists healthy (any router's while none serves yet)."""
    serving = {r.key for r in state.latest() if r.serves and r.group == synced(state.config)}
    chosen = [r for r in view.routers if (r.replica_num, r.submission_num) in serving] or view.routers
    return set().union(*(r.healthy() for r in chosen)) if chosen else set()
