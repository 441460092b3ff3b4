"""Offers the account's quotas can never launch: read per region, kept ``QUOTA_TTL`` seconds, so the offer walk
(activities/cloud.py) skips them before any launch call and ``durastack offers`` marks them "no quota".

AWS: Service Quotas' GetServiceQuota, the region's vCPU quota of the offer's class (on-demand and spot apart): P
instances the P quota, G and VT the G and VT quota, A C D H I M R T Z the Standard quota. GCP: regions.get's
``quotas`` list: the GPU model's quota (e.g. NVIDIA_L4_GPUS) and the machine family's CPU quota.

The rule compares the offer's need with the quota's *limit*, not limit minus usage. A mark means "cannot launch
here until the quota is raised", which stays true for the whole cache period; usage does not: the service's own
instances count in it, and a rolling update or scale-in is about to free theirs (and AWS's GetServiceQuota has no
usage at all). An offer tried while usage is high fails with a quota error, which the walk already classifies.

Unknown is never "no": a quota not listed, an instance family without a known quota, or a quota API that cannot be
read (not reachable, or not permitted) leaves the offer to be tried, and the failed read is logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Literal, Mapping, NamedTuple, Optional

from models.offers import InstanceOffer

log = logging.getLogger("durastack.quota")
QUOTA_TTL = 600.0  # seconds a region's quotas are kept (a failed read too): dstack refreshes its offers every 10 min

# Service Quotas codes of EC2's vCPU quotas (service code "ec2"), by market and class.
AWS_VCPU_QUOTAS = {
    ("on-demand", "P"): ("L-417A185B", "Running On-Demand P instances"),
    ("on-demand", "G"): ("L-DB2E81BA", "Running On-Demand G and VT instances"),
    ("on-demand", "standard"): ("L-1216C47A", "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances"),
    ("spot", "P"): ("L-7212CCBC", "All P Spot Instance Requests"),
    ("spot", "G"): ("L-3819A6DF", "All G and VT Spot Instance Requests"),
    ("spot", "standard"): ("L-34B43A08", "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests"),
}
AWS_QUOTA_NAMES = dict(AWS_VCPU_QUOTAS.values())
# Families whose first letter reads as Standard but that have quotas of their own (Inf, DL, HPC, Trn, Mac).
_AWS_OWN_QUOTA = ("inf", "dl", "hpc", "trn", "mac")
# GCP machine families known to draw on the regional CPUS quota when no <FAMILY>_CPUS quota is listed.
_GCP_CPUS_FAMILIES = ("n1", "e2")

Status = Literal["ok", "no quota", "unknown"]


class Verdict(NamedTuple):
    status: Status
    reason: str = ""


@dataclass(frozen=True)
class Need:
    """``amount`` of ``unit`` from any one of ``quotas`` (a spot VM on GCP draws on PREEMPTIBLE_* when the project
    has that quota, else on the standard one)."""

    amount: float
    unit: str
    quotas: tuple[str, ...]


def aws_vcpu_quota(offer: InstanceOffer) -> Optional[str]:
    """The code of the EC2 vCPU quota an offer draws on; None when not known here."""
    family = offer.instance_type.split(".")[0].lower()
    if family.startswith(_AWS_OWN_QUOTA):
        cls = None
    elif family.startswith("p"):
        # One AWS documentation version splits spot P into "P4, P3 and P2" and "P5" quotas: the P spot quota is
        # read as covering only the older families, and a newer one's is not known.
        cls = "P" if not offer.spot or family[1:2] in ("2", "3", "4") else None
    elif family.startswith(("g", "vt")):
        cls = "G"
    else:
        cls = "standard" if family[:1] in tuple("acdhimrtz") else None
    found = AWS_VCPU_QUOTAS.get(("spot" if offer.spot else "on-demand", cls))
    return found[0] if found else None


def gcp_gpu_quota(offer: InstanceOffer) -> Optional[str]:
    """The regional quota metric of the offer's GPU model (on-demand), e.g. NVIDIA_L4_GPUS; None without GPU."""
    if not offer.gpu_count or not offer.gpu_name:
        return None
    if offer.instance_type.startswith("a3-") and not offer.instance_type.startswith("a3-highgpu"):
        return None  # A3 Mega/Edge count H100s in quotas of their own
    name = offer.gpu_name.upper()
    if name == "A100" and offer.gpu_memory_gb >= 80:
        name = "A100_80GB"
    return f"NVIDIA_{name}_GPUS"


def needs(offer: InstanceOffer, listed: Mapping[str, float]) -> list[Need]:
    """What the offer needs from which quotas; ``listed`` (the region's quotas) decides GCP's CPU quota."""
    if offer.backend == "aws":
        code = aws_vcpu_quota(offer)
        return [Need(offer.cpus, "vCPUs", (code,))] if code else []
    if offer.backend != "gcp":
        return []
    found = []
    gpu = gcp_gpu_quota(offer)
    if gpu:
        found.append(Need(offer.gpu_count, "GPUs", (f"PREEMPTIBLE_{gpu}", gpu) if offer.spot else (gpu,)))
    family = offer.instance_type.split("-")[0].upper()
    cpus = f"{family}_CPUS" if f"{family}_CPUS" in listed else "CPUS" if family.lower() in _GCP_CPUS_FAMILIES else None
    if cpus:
        found.append(Need(offer.cpus, "vCPUs", ("PREEMPTIBLE_CPUS", cpus) if offer.spot else (cpus,)))
    return found


def _label(quota: str) -> str:
    return f"{AWS_QUOTA_NAMES[quota]} ({quota})" if quota in AWS_QUOTA_NAMES else quota


def verdict(offer: InstanceOffer, limits: Optional[Mapping[str, float]]) -> Verdict:
    """Whether the region's quota ``limits`` (None: not read) let the offer launch. "no quota" only when every
    quota that could serve one of its needs is listed and below it; a quota not listed makes that need unknown."""
    if limits is None:
        return Verdict("unknown", f"quotas of {offer.region} could not be read")
    found = needs(offer, limits)
    if not found:
        return Verdict("unknown", f"no known quota for {offer.instance_type}")
    unknown = []
    for need in found:
        if any(q not in limits for q in need.quotas):
            unknown.append(" or ".join(q for q in need.quotas if q not in limits))
        elif all(limits[q] < need.amount for q in need.quotas):
            have = " and ".join(f"{_label(q)} is {limits[q]:g}" for q in need.quotas)
            return Verdict("no quota", f"{have} {need.unit} in {offer.region}; {offer.instance_type} needs "
                                       f"{need.amount:g}")
    if unknown:
        return Verdict("unknown", f"{', '.join(unknown)} not listed in {offer.region}")
    return Verdict("ok")


class RegionQuotas:
    """One backend's quota limits per region: read on first need with ``read(region)`` (a CloudError or any other
    failure means unknown), kept ``ttl`` seconds. Thread-safe: concurrent walks read a region once."""

    def __init__(self, backend: str, read: Callable[[str], dict[str, float]], *, ttl: float = QUOTA_TTL,
                 clock: Callable[[], float] = time.monotonic):
        self.backend, self._read, self.ttl, self._clock = backend, read, ttl, clock
        self._lock = threading.Lock()
        self._kept: dict[str, tuple[float, Optional[dict[str, float]], str]] = {}  # region → (until, limits, why)
        self._said: set[str] = set()  # failures already logged

    def limits(self, region: str) -> Optional[dict[str, float]]:
        """The region's limits, or None when they could not be read (``failure`` says why)."""
        with self._lock:
            kept = self._kept.get(region)
            if kept is None or kept[0] <= self._clock():
                kept = self._fetch(region)
            return kept[1]

    def failure(self, region: str) -> str:
        """Why the region's quotas are unknown; empty when they were read."""
        with self._lock:
            kept = self._kept.get(region)
            return kept[2] if kept else ""

    def verdict(self, offer: InstanceOffer) -> Verdict:
        limits = self.limits(offer.region)
        return verdict(offer, limits) if limits is not None else Verdict("unknown", self.failure(offer.region))

    def _fetch(self, region: str) -> tuple[float, Optional[dict[str, float]], str]:
        try:
            kept = (self._clock() + self.ttl, self._read(region), "")
        except Exception as e:  # noqa: BLE001 — a quota that cannot be read must never block a launch
            why = f"{self.backend} quotas could not be read: {getattr(e, 'message', None) or e}"
            kind = getattr(e, "code", "") or type(e).__name__
            if kind not in self._said:
                self._said.add(kind)
                log.warning("%s; offers there are tried as if the quota allowed them (said once)", why)
            kept = (self._clock() + self.ttl, None, why)
        self._kept[region] = kept
        return kept


def quotas_of(backend: object) -> Optional[RegionQuotas]:
    """A backend's quota cache; None for one without (this machine, a test's stand-in)."""
    found = getattr(backend, "quotas", None)
    return found if isinstance(found, RegionQuotas) else None


def no_quota(backend: object, offer: InstanceOffer) -> Optional[str]:
    """Why the backend's quotas rule ``offer`` out; None when it may launch (or nobody knows)."""
    quotas = quotas_of(backend)
    if quotas is None:
        return None
    found = quotas.verdict(offer)
    return found.reason if found.status == "no quota" else None


def mark_offers(backends: Mapping[str, object], offers: list[InstanceOffer]
                ) -> tuple[list[Optional[Verdict]], list[str]]:
    """Each offer's verdict (None: not checked, its backend is not configured or has no quota), and one note per
    backend whose quotas could not be read."""
    marks: list[Optional[Verdict]] = []
    notes: dict[str, str] = {}
    for offer in offers:
        quotas = quotas_of(backends.get(offer.backend))
        marks.append(quotas.verdict(offer) if quotas else None)
        if quotas and quotas.failure(offer.region):
            notes.setdefault(offer.backend, f"{quotas.failure(offer.region)}; its offers are not marked, and are "
                                            "tried")
    return marks, list(notes.values())


def launchable(backends: Mapping[str, object], offers: list[InstanceOffer]) -> tuple[list[InstanceOffer], list[str]]:
    """The offers a launch would try (all but those marked "no quota", as the walk skips them), and why each other
    one is not."""
    marks, _ = mark_offers(backends, offers)
    short = [(o, m) for o, m in zip(offers, marks) if m is not None and m.status == "no quota"]
    kept = [o for o, m in zip(offers, marks) if m is None or m.status != "no quota"]
    return kept, [f"{o.backend} {o.instance_type} in {o.region}: {m.reason}" for o, m in short]


__all__ = ["AWS_VCPU_QUOTAS", "QUOTA_TTL", "Need", "RegionQuotas", "Verdict", "aws_vcpu_quota", "gcp_gpu_quota",
           "launchable", "mark_offers", "needs", "no_quota", "quotas_of", "verdict"]
