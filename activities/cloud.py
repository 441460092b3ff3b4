"""The offer walker: provision one replica on the cheapest cloud offer that works, exactly once.

Order of work in ``provision_cloud`` (blocking; the activity calls it via ``asyncio.to_thread``):
1. adopt: an instance of this replica submission already tagged in the cloud (an earlier attempt whose
   response was lost, on any offer) is returned as is — so a re-walk never launches a second one;
2. keys whose launch went out but whose outcome the ledger never got are retried first, with the same key;
3. the other offers, cheapest first, up to ``max_offers`` tried: one the account's quota cannot launch
   (backends/quota.py) is skipped without a call and without using up an attempt; capacity → next offer;
   quota error → skip the offer's region and quota class; transient or fatal → raise (Temporal retries the former).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from activities.liveness import progress
from activities.metrics import provisioning_failed
from backends.cloud import CloudBackend
from backends.cloud_errors import CloudError, ErrorKind, QuotaScope
from backends.quota import no_quota
from models.backends import CloudInstance, provisioning_key
from models.failures import FailureKind
from models.offers import InstanceOffer, match_offers
from models.replica import JobSpec
from models.resources import ResourcesSpec
from models.state import Placement
from store import CREATED, FAILED, INTENT, TERMINATED, StoreLedger

log = logging.getLogger("durastack.cloud")
MAX_REASONS_CHARS = 3000


class OffersExhausted(Exception):
    """No offer could be provisioned: ``no offers: …`` or ``all offers failed: <reasons>``. Not retryable.
    ``tried`` and ``reasons`` say the same for code (the launch's typed ``models.messages.PlacementRefusal`` details)."""

    def __init__(self, message: str, *, tried: bool = False, reasons: Optional[list[str]] = None):
        super().__init__(message)
        self.tried, self.reasons = tried, list(reasons or [])


def _where(offer: InstanceOffer) -> str:
    spot = " spot" if offer.spot else ""
    reserved = f", reservation {offer.reservation}" if offer.reservation else ""
    return f"{offer.backend} {offer.instance_type}{spot} in {offer.region} (${offer.price:g}/h{reserved})"


def _key(job: JobSpec, offer: InstanceOffer, backend: CloudBackend) -> str:
    return provisioning_key(job.service, job.group, job.replica_num, job.submission_num, offer, backend.installation)


def _adoptable(backends: dict[str, CloudBackend], job: JobSpec, offers: list[InstanceOffer]
               ) -> Optional[tuple[InstanceOffer, CloudInstance]]:
    """An instance of this replica submission that an earlier attempt made. Several (only after a bug or a
    stale concurrent attempt): the earliest, chosen the same way by every attempt; the reaper gets the rest."""
    for name, backend in backends.items():
        regions = sorted({o.region for o in offers if o.backend == name})
        # Only a live one: a stopped VM would never serve; the reaper collects it.
        found = [i for i in backend.find_replica(job, regions) if i.state in ("pending", "running")] if regions else []
        if found:
            instance = found[0]
            by_key = {_key(job, o, backend): o for o in offers if o.backend == name}
            offer = by_key.get(instance.key) or next(
                (o for o in offers if (o.backend, o.instance_type, o.region, o.spot) ==
                 (name, instance.instance_type, instance.region, instance.spot)), None) or InstanceOffer(
                backend=name, instance_type=instance.instance_type, region=instance.region, cpus=0, memory_gb=0,
                spot=instance.spot, price=instance.price)
            return offer, instance.model_copy(update={"price": offer.price})
    return None


def cloud_offers(offers: list[InstanceOffer], resources: ResourcesSpec, backends: dict[str, CloudBackend]
                 ) -> list[InstanceOffer]:
    """The cloud offers ``backends`` can serve, sized and cheapest first. The caller applies the spot
    policy, max price and the service's backends/regions (``match_offers``); this only narrows to clouds."""
    kept = match_offers(offers, resources, spot_policy="auto", backends=sorted(backends) or ["-"])
    return [o for o in kept if o.region in (backends[o.backend].regions or [o.region])]


def provision_cloud(job: JobSpec, resources: ResourcesSpec, offers: list[InstanceOffer], *,
                    backends: dict[str, CloudBackend], ledger: StoreLedger, max_offers: int = 25, nvcc: bool = False,
                    progress: Callable[[str], None] = lambda _: None) -> tuple[InstanceOffer, CloudInstance]:
    """Launch ``job`` on the first offer that works (see the module doc). ``offers`` should already be
    filtered by the replica's spot policy, max price, backends and regions; ``progress`` is called before each
    cloud call (pass a heartbeat). Raises OffersExhausted, or CloudError (TRANSIENT: retry; FATAL: fail)."""
    found = cloud_offers(offers, resources, backends)
    if not found:
        why = (f"none of the {len(offers)} offers is on a configured cloud backend "
               f"({', '.join(sorted(backends)) or 'none configured'})")
        raise OffersExhausted(f"{FailureKind.NO_OFFERS}: {why}", reasons=[why])
    progress("reading the quotas of the offers' regions")
    lacking = _lacking_quota(found, backends, max_offers)
    candidates = found[:len(lacking)]
    progress("looking for an instance of an earlier attempt")
    adopted = _adoptable(backends, job, candidates)
    if adopted:
        ledger.record(adopted[1].key, CREATED, _ledger_data(job, adopted[0], adopted[1], adopted=True))
        return adopted
    keys = {id(o): _key(job, o, backends[o.backend]) for o in candidates}
    unresolved = ledger.unresolved(keys.values())
    ordered = sorted(candidates, key=lambda o: keys[id(o)] not in unresolved)  # stable: cheapest first otherwise
    reasons: list[str] = []
    blocked: list[QuotaScope] = []
    for offer in ordered:
        key = keys[id(offer)]
        # A launch whose outcome never came back is called again (same key), whatever the quota says now.
        if lacking[id(offer)] and key not in unresolved:
            reasons.append(f"{_where(offer)}: skipped, no quota: {lacking[id(offer)]}")
            continue
        scope = next((s for s in blocked if s.covers(offer)), None)
        if scope is not None:
            reasons.append(f"{_where(offer)}: skipped, {scope.cause} for {scope}")
            continue
        progress(f"trying {_where(offer)}")
        ledger.record(key, INTENT, _ledger_data(job, offer))
        try:
            instance = backends[offer.backend].create(job, offer, key, nvcc=nvcc)
        except CloudError as e:
            provisioning_failed(offer.backend, e.kind.value)
            if e.kind is ErrorKind.TRANSIENT:
                raise  # outcome unknown: the intent stays unresolved, so the retry calls this key first
            ledger.record(key, FAILED, {"kind": e.kind.value, "code": e.code})
            if e.kind is ErrorKind.FATAL:
                raise
            if e.kind is ErrorKind.QUOTA:
                blocked.append(e.scope or QuotaScope(backend=offer.backend, region=offer.region))
            if e.kind is ErrorKind.REGION:
                blocked.append(QuotaScope(backend=offer.backend, region=offer.region, cause=e.code))
            log.info("offer failed for %s: %s: %s", job.replica_id, _where(offer), e.message)
            reasons.append(f"{_where(offer)}: {e.message}")
            continue
        ledger.record(key, CREATED, _ledger_data(job, offer, instance))
        return offer, instance
    text = "; ".join(reasons)
    if len(text) > MAX_REASONS_CHARS:
        text = text[:MAX_REASONS_CHARS - 1] + "…"
    raise OffersExhausted(f"{FailureKind.ALL_OFFERS_FAILED}: {text}", tried=True, reasons=reasons)


def _lacking_quota(offers: list[InstanceOffer], backends: dict[str, CloudBackend], max_offers: int
                   ) -> dict[int, Optional[str]]:
    """The cheapest offers, up to ``max_offers`` the quotas allow, each (by id) with why its quota rules it out
    (None: to be tried): an offer that cannot launch does not use up an attempt."""
    lacking: dict[int, Optional[str]] = {}
    tried = 0
    for offer in offers:
        if tried >= max_offers:
            break
        lacking[id(offer)] = why = no_quota(backends[offer.backend], offer)
        tried += why is None
    return lacking


def _ledger_data(job: JobSpec, offer: InstanceOffer, instance: Optional[CloudInstance] = None,
                 adopted: bool = False) -> dict:
    data = {"replica_id": job.replica_id, "backend": offer.backend, "instance_type": offer.instance_type,
            "region": offer.region, "spot": offer.spot, "price": offer.price}
    if instance is not None:
        data.update(instance_id=instance.instance_id, zone=instance.zone, adopted=adopted)
    return data  # never the env or user-data: they may hold secrets


def terminate_cloud(instance: CloudInstance, *, backends: dict[str, CloudBackend],
                    ledger: Optional[StoreLedger] = None) -> None:
    """Terminate ``instance``; already gone is success. Raises CloudError (TRANSIENT: retry)."""
    backend = backends.get(instance.backend)
    if backend is None:
        raise CloudError(ErrorKind.FATAL, f"backend {instance.backend} is not configured; cannot terminate "
                         f"{instance.instance_id}", code="NotConfigured")
    backend.terminate(instance)
    if ledger is not None:
        ledger.record(instance.key, TERMINATED, {"instance_id": instance.instance_id, "backend": instance.backend})


def terminate_replica(job: JobSpec, *, backends: dict[str, CloudBackend], ledger: Optional[StoreLedger] = None) -> int:
    """Terminate every instance of this replica submission in every configured region — for a teardown that
    never got the provision result (the activity died after the launch). Returns how many."""
    found = [i for b in backends.values() for i in b.find_replica(job) if i.state != "terminated"]
    for instance in found:
        terminate_cloud(instance, backends=backends, ledger=ledger)
    return len(found)


def list_tagged_all(backends: dict[str, CloudBackend], *, service: Optional[str] = None,
                    regions: Optional[dict[str, list[str]]] = None) -> list[CloudInstance]:
    """Every durastack-tagged instance (of ``service`` if given) of every backend, in its ``regions`` (default: each
    backend's configured ones)."""
    return [i for name, backend in backends.items()
            for i in backend.list_tagged((regions or {}).get(name), service=service)]


def terminate_service(backends: dict[str, CloudBackend], service: str, *, ledger: Optional[StoreLedger] = None) -> int:
    """Terminate every instance tagged for ``service`` (the stop path's safety net); returns how many."""
    found = [i for i in list_tagged_all(backends, service=service) if i.state != "terminated"]
    for instance in found:
        terminate_cloud(instance, backends=backends, ledger=ledger)
    # Then what the instances were let in by: the service's security groups, the SSH firewall rule.
    for backend in backends.values():
        backend.release(service)
    return len(found)


def placement_of(offer: InstanceOffer, instance: CloudInstance) -> Placement:
    return Placement(backend=instance.backend, region=instance.region, instance_type=instance.instance_type,
                     price=offer.price, spot=instance.spot, address=instance.address, instance_id=instance.instance_id,
                     ip=instance.private_ip, gpu=gpu_label(offer))


def gpu_label(offer: InstanceOffer) -> str:
    """What `ps` shows of an offer's GPUs: ``name×count``, empty without GPU."""
    return f"{offer.gpu_name or 'GPU'}×{offer.gpu_count}" if offer.gpu_count else ""


def activity_error(error: CloudError, *, teardown: bool = False) -> Exception:
    """How an activity should raise a cloud's ``error``. Provision: FATAL is non-retryable (the replica fails with
    the message), TRANSIENT retryable (Temporal backs off); OffersExhausted is not raised through here (a launch
    turns it into interface.refusal_error). Teardown (``teardown=True``): always
    retryable — a leaked instance costs money, so termination keeps trying until, e.g., credentials are fixed."""
    from temporalio.exceptions import ApplicationError

    return ApplicationError(error.message, type=f"Cloud{error.kind.value.title()}",
                            non_retryable=not teardown and error.kind is not ErrorKind.TRANSIENT)


def heartbeat_from_thread() -> Callable[[str], None]:
    """Call inside an async activity; returns a ``progress`` callback that heartbeats from a worker thread.
    (``activity.heartbeat`` of an async activity must run on its event loop, in its context.)"""
    import asyncio
    import contextvars

    loop, context = asyncio.get_running_loop(), contextvars.copy_context()
    return lambda message: loop.call_soon_threadsafe(progress, message, context=context)


__all__ = ["OffersExhausted", "activity_error", "cloud_offers", "heartbeat_from_thread", "list_tagged_all",
           "placement_of", "provision_cloud", "terminate_cloud", "terminate_replica", "terminate_service"]
