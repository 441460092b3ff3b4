"""The offers a service's groups are planned from: one list for ``durastack offers -f`` and ``durastack apply``.

Candidates are the shipped catalog plus this machine. A cloud configured in ``config.yml`` with ``regions``
contributes only those regions; a cloud that is not configured is still listed by ``offers`` (to compare prices)
but cannot be used, so ``apply`` plans on the configured backends only and says so when the only fits are
elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from backends.catalog import load_catalog, local_offer
from models.backends import CLOUDS, BackendsConfig
from models.offers import InstanceOffer, describe_mismatch, match_offers, sort_key
from models.reservations import ReservationLookup
from models.resources import ResourcesSpec


def candidate_offers(config: BackendsConfig, catalog: Optional[list[InstanceOffer]] = None,
                     local: Optional[InstanceOffer] = None) -> list[InstanceOffer]:
    """The catalog (configured clouds only in their configured regions) and this machine."""
    offers = catalog if catalog is not None else load_catalog()
    kept = [o for o in offers if getattr(config, o.backend, None) is None or config.allows(o)]
    return kept + [local or local_offer()]


@dataclass
class GroupQuery:
    """One group's requirement and the filters that apply to it (the CLI's flags win over the file's)."""

    name: str
    resources: ResourcesSpec
    spot_policy: str
    max_price: Optional[float]
    backends: Optional[list[str]]
    regions: Optional[list[str]]
    instance_types: Optional[list[str]] = None
    zones: Optional[list[str]] = None
    reservation: Optional[ReservationLookup] = None  # what the clouds said of it (``look_up_reservations``)


def group_queries(service, spot_policy: Optional[str] = None, max_price: Optional[float] = None,
                  backends: Optional[list[str]] = None, regions: Optional[list[str]] = None,
                  reservation: Optional[str] = None) -> list[GroupQuery]:
    """One query per replica group of a ``ServiceConfiguration``; a group's spot_policy and reservation win over
    the service's, as in the replica's input (rules/jobs.py). Reservations are not looked up yet."""
    return [GroupQuery(name=g.name or "", resources=g.resources,
                       spot_policy=spot_policy or g.spot_policy or service.spot_policy or "on-demand",
                       max_price=max_price if max_price is not None else service.max_price,
                       backends=backends or service.backends, regions=regions or service.regions,
                       instance_types=service.instance_types, zones=service.availability_zones,
                       reservation=_unresolved(reservation or g.reservation or service.reservation))
            for g in service.replica_groups]


def _unresolved(name: Optional[str]) -> Optional[ReservationLookup]:
    return ReservationLookup(name=name) if name else None


def look_up_reservations(queries: list[GroupQuery], config: BackendsConfig, clouds=None) -> list[GroupQuery]:
    """The queries with what each configured cloud says of their reservation (in the regions the query allows): one
    lookup per name and cloud. A cloud that is not configured, or cannot answer, is named in the lookup's notes.
    ``clouds``: the backends to ask (default: made from ``config``)."""
    if not any(q.reservation for q in queries):
        return queries
    if clouds is None:
        from backends.cloud import make_backends
        clouds = make_backends(config)
    answers: dict[tuple, ReservationLookup] = {}

    def answer(q: GroupQuery) -> ReservationLookup:
        key = (q.reservation.name, tuple(q.backends or ()), tuple(q.regions or ()))
        if key not in answers:
            answers[key] = _look_up(q, clouds)
        return answers[key]

    return [replace(q, reservation=answer(q)) if q.reservation else q for q in queries]


def _look_up(q: GroupQuery, clouds: dict) -> ReservationLookup:
    from backends.cloud import reservation_in
    from backends.cloud_errors import CloudError

    found = ReservationLookup(name=q.reservation.name)
    for name in CLOUDS:
        if q.backends and name not in q.backends:
            continue
        try:
            answer = reservation_in(clouds[name], found.name, q.regions) if name in clouds else ReservationLookup(
                name=found.name, notes=[f"{name}: not configured in config.yml"])
        except CloudError as e:
            answer = ReservationLookup(name=found.name, notes=[f"{name}: could not look it up ({e.message})"])
        found = found.merged(answer)
    return found


def match_query(candidates: list[InstanceOffer], q: GroupQuery) -> tuple[list[InstanceOffer], Optional[str]]:
    """The offers that fit ``q``, cheapest first, and why none does. This machine has no spot market: the
    spot policy does not apply to it (as when a replica is placed there)."""
    clouds = [o for o in candidates if o.backend != "local"]
    local = [o for o in candidates if o.backend == "local"]
    filters = dict(max_price=q.max_price, backends=q.backends, regions=q.regions, instance_types=q.instance_types,
                   zones=q.zones, reservation=q.reservation)
    found = match_offers(clouds, q.resources, spot_policy=q.spot_policy, **filters) + \
        match_offers(local, q.resources, spot_policy="auto", **filters)
    found.sort(key=sort_key)
    if found:
        return found, None
    return [], describe_mismatch(candidates, q.resources, spot_policy=q.spot_policy, **filters)


def plan_query(candidates: list[InstanceOffer], q: GroupQuery, config: BackendsConfig
               ) -> tuple[list[InstanceOffer], Optional[str]]:
    """What ``apply`` may submit on: the fitting offers on configured backends (all of them when the service
    names none). When only unconfigured clouds fit, the reason says which, so the user knows what to set up."""
    usable = set(config.configured())
    allowed = [b for b in (q.backends or usable) if b in usable]
    if not allowed:
        return [], (f"the service's backends ({', '.join(q.backends or [])}) are not configured in config.yml "
                    f"(configured: {', '.join(sorted(usable))})")
    found, reason = match_query(candidates, GroupQuery(**{**q.__dict__, "backends": allowed}))
    if found:
        return found, None
    elsewhere, _ = match_query(candidates, GroupQuery(**{**q.__dict__, "backends": q.backends}))
    if elsewhere:
        names = sorted({o.backend for o in elsewhere} - usable)
        return [], (f"only {', '.join(names)} offers fit, and config.yml does not configure "
                    f"{'it' if len(names) == 1 else 'them'}")
    return [], reason


def one_place(found: dict[str, list[InstanceOffer]], counts: dict[str, int]) -> tuple[list[str], Optional[str]]:
    """Where a service whose replicas reach each other can run whole: the ``backend/region`` places that have an
    offer for every group (``found``: each group's offers), cheapest for the service first (each group's cheapest
    offer there, times its minimum count); else none, and why, naming the groups and where each could go."""
    where = {g: {f"{o.backend}/{o.region}" for o in offers} for g, offers in found.items()}
    common = set.intersection(*where.values()) if where else set()
    if not common:
        def some(places: set[str]) -> str:
            listed = sorted(places)
            return ", ".join(listed[:3]) + (f" (+{len(listed) - 3} more)" if len(listed) > 3 else "")
        return [], ("no single backend and region holds every group, and their replicas must reach each other "
                    "(a router, or commands naming replicas): " + "; ".join(f"group {g} only in {some(p)}"
                                                                           for g, p in where.items()))

    def cost(place: str) -> float:
        return sum(min(o.price for o in offers if f"{o.backend}/{o.region}" == place) * max(counts.get(g, 1), 1)
                   for g, offers in found.items())
    return sorted(common, key=lambda place: (cost(place), place)), None


__all__ = ["GroupQuery", "candidate_offers", "group_queries", "look_up_reservations", "match_query", "one_place",
           "plan_query"]
