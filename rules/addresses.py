"""Replica addresses in commands, resolved from the service's own state (pure).

``groups[g].replicas[j]`` is the j-th active replica of group g, in replica-number order: validation
keeps j below the group's minimum, so it normally exists. Its ``IP_ADDRESS`` is the address its placement
gives other replicas of the service (``Placement.ip``, else the host part of the gateway address); a
replica without a placement yet has none.

A reference is resolved at one of two moments. One to a group that does not name the referrer back is
resolved before the referrer is launched: the planner holds the replica until the value exists (``resolve``),
so no instance is billed while it could not run. One to a group that names the referrer back, directly or
through others, or to its own group (every node joining node 0), cannot wait so: none would ever start.
Those are ``late``: the replica is placed first, and its launch asks the service for the values once it has
an address itself, before its commands run (activities/references.py); every address exists at placement.

A replica records the values it started with (``Replica.refs``). When one of them moves (the
referenced replica was replaced) the replica is ``readdressed``: the planner rolls it like an
out-of-date one, surge rules and all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from models.interpolation import expression, find, group_name, substitute, target_group
from models.state import Placement, Replica, ServiceState
from models.service import ServiceConfiguration


# Why a reference cannot resolve until the backend changes: the replica runs, but nobody else can reach it.
NO_NETWORK = "isolated with no service network"


@dataclass
class Resolution:
    values: dict[str, str] = field(default_factory=dict)  # key → value, for the references that resolve
    missing: dict[str, str] = field(default_factory=dict)  # key → why it does not resolve yet

    def before_launch(self, late: list[str]) -> "Resolution":
        """What a replica waits for before its launch: its references but the ``late`` ones."""
        return Resolution({k: v for k, v in self.values.items() if k not in late},
                          {k: v for k, v in self.missing.items() if k not in late})

    def why_waiting(self) -> str:
        # IP_ADDRESS and PORT of one replica wait for the same thing: said once, of the replica.
        by_replica = {key.rsplit(".", 1)[0]: why for key, why in self.missing.items()}
        return "; ".join(f"{replica} {why}" for replica, why in sorted(by_replica.items()))


def one_place(config: ServiceConfiguration) -> bool:
    """Whether the service's replicas reach each other (a router group, or commands naming replicas): then they must
    all be placed where private addresses reach, one backend and region."""
    return config.router_group is not None or any(keys(config, g.name) for g in config.replica_groups)


def router_key(config: ServiceConfiguration, group: str) -> Optional[str]:
    """A worker behind a Dynamo router finds it at $DSTACK_ROUTER_INTERNAL_IP: the router replica's address, which
    it needs as if its commands named it. None for the router itself and for other services."""
    router = config.router_group
    spec = config.group(router) if router else None
    if spec is None or spec.router is None or spec.router.type != "dynamo" or group == router:
        return None
    return f"groups[{router}].replicas[0].IP_ADDRESS"


def late(config: ServiceConfiguration, group: str) -> list[str]:
    """The references of ``group`` resolved only once it is placed: those to a group that reaches ``group`` back
    through references (its own included)."""
    return [k for k in keys(config, group) if _reaches(config, target_group(k), group)]


def _reaches(config: ServiceConfiguration, start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name == goal:
            return True
        if name not in seen:
            seen.add(name)
            todo += [target_group(k) for k in keys(config, name)]
    return False


def keys(config: ServiceConfiguration, group: str) -> list[str]:
    """The references the commands of ``group`` make, by group name, in order, without repeats (and the router's
    address, for a worker behind a Dynamo router)."""
    spec = config.group(group)
    if spec is None:
        return []
    names = [g.name or "" for g in config.replica_groups]
    out: dict[str, None] = {}
    implicit = router_key(config, group)
    if implicit is not None:
        out[implicit] = None
    for command in spec.commands:
        for f in find(command):
            name = group_name(names, f.ref.group) if f.ref is not None else None
            if f.ref is not None and name is not None:
                out[f.ref.key(name)] = None
    return list(out)


def peer_ip(placement: Placement) -> str:
    """Where other replicas of the service reach this one: its ``ip``, else the host of an ``ip:port`` address."""
    if placement.ip:
        return placement.ip
    host, sep, port = placement.address.rpartition(":")
    return host if sep and port.isdigit() and host and "/" not in host else ""


def peer_port(placement: Placement, service_port: int) -> str:
    host, sep, port = placement.address.rpartition(":")
    if sep and port.isdigit() and host and "/" not in host:
        return port  # reached at host:port (e.g. its own port on a shared host: a local replica without isolation)
    return str(service_port)  # reached through a socket: the app listens on the service's port


def resolve(state: ServiceState, group: str) -> Resolution:
    """The values of the references ``group``'s commands make, now."""
    return resolve_keys(state, keys(state.config, group))


def resolve_keys(state: ServiceState, wanted: list[str]) -> Resolution:
    out = Resolution()
    if not wanted:
        return out
    active: dict[str, list[Replica]] = {}
    for r in state.latest():
        if r.active:
            active.setdefault(r.group, []).append(r)
    for key in wanted:
        name, rest = key[len("groups["):].split("].replicas[", 1)
        index, attr = rest.split("].", 1)
        replicas = active.get(name, [])
        if int(index) >= len(replicas):
            out.missing[key] = f"has no replica yet (group '{name}' has {len(replicas)} active)"
            continue
        target = replicas[int(index)]
        ip = peer_ip(target.placement) if target.placement is not None else ""
        if not ip:
            out.missing[key] = (f"waits for replica {target.replica_num} to have an address "
                                f"({target.status}{', ' + NO_NETWORK if target.placement else ''})")
            continue
        assert target.placement is not None
        out.values[key] = ip if attr == "IP_ADDRESS" else peer_port(target.placement, state.config.port.container_port)
    return out


def readdressed(replica: Replica, now: Resolution, state: ServiceState) -> Optional[str]:
    """Why ``replica`` must roll because a replica it named was replaced, or None. A reference is bound to the
    replica it resolved to, not to its index: while that replica still runs at the address it was started with
    (addresses are not handed out again for a while), a scale step that moved another replica to index j rolls
    nobody."""
    alive = _running_addresses(state)
    moved = [f"{key} {old} → {now.values[key]}" for key, old in sorted(replica.refs.items())
             if key in now.values and now.values[key] != old and not _still_there(key, replica.refs, alive)]
    return "; ".join(moved) or None


def _running_addresses(state: ServiceState) -> dict[str, set[tuple[str, str]]]:
    """Group → the (ip, port) of its active replicas."""
    out: dict[str, set[tuple[str, str]]] = {}
    for r in state.latest():
        if r.active and r.placement is not None and peer_ip(r.placement):
            port = peer_port(r.placement, state.config.port.container_port)
            out.setdefault(r.group, set()).add((peer_ip(r.placement), port))
    return out


def _still_there(key: str, refs: dict[str, str], alive: dict[str, set[tuple[str, str]]]) -> bool:
    """Whether the replica ``key`` named when ``refs`` were taken still runs at that address."""
    group = target_group(key)
    base = key.rsplit(".", 1)[0]
    ip, port = refs.get(f"{base}.IP_ADDRESS"), refs.get(f"{base}.PORT")
    return any((ip is None or ip == i) and (port is None or port == p) for i, p in alive.get(group, set()))


def commands(config: ServiceConfiguration, group: str, values: dict[str, str]) -> list[str]:
    """The group's commands with the references replaced by ``values`` (all but the late ones resolved, which stay
    as expressions by group name)."""
    spec = config.group(group)
    assert spec is not None, group
    names = [g.name or "" for g in config.replica_groups]
    later = any(k not in values for k in keys(config, group))  # `fill` substitutes again, and unescapes then
    return [substitute(c, names, lambda key: values.get(key) or expression(key), unescape=not later)
            for c in spec.commands]



def roll_after(state: ServiceState) -> dict[str, int]:
    """Group → how many of its up-to-date replicas will roll too, once a replica their commands name is replaced
    (``readdressed``), directly or down a chain: what an apply's plan adds to the replicas it replaces."""
    config = state.config
    active: dict[str, list[Replica]] = {}
    for r in state.latest():
        if r.active:
            active.setdefault(r.group, []).append(r)
    rolling = {r.key for rs in active.values() for r in rs if r.deployment_num < state.deployment_num}
    follow: dict[str, int] = {}
    grew = True
    while grew:
        grew = False
        for r in (r for rs in active.values() for r in rs if r.key not in rolling):
            for key in keys(config, r.group):
                index = int(key.split("].replicas[", 1)[1].split("]", 1)[0])
                named = active.get(target_group(key), [])
                if index < len(named) and named[index].key in rolling and named[index] is not r:
                    rolling.add(r.key)
                    follow[r.group] = follow.get(r.group, 0) + 1
                    grew = True
                    break
    return follow
