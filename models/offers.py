"""Instance offers, and matching them against a ``resources`` requirement.

Pure: ``backends.catalog`` reads the catalog and this machine, and this module filters and sorts.
Each requirement is one named check, so ``match_offers`` and ``describe_mismatch`` cannot disagree.
"""

from __future__ import annotations

from typing import Callable, Iterable, Literal, Optional

from pydantic import Field

from models.common import Model, Range
from models.reservations import ReservationLookup
from models.resources import GPUSpec, ResourcesSpec

BackendName = Literal["aws", "gcp", "local"]
SPOT_POLICIES = ("spot", "on-demand", "auto")
DEFAULT_DISK_GB = 100.0

# The catalog has no compute capability column; these are NVIDIA's published values.
COMPUTE_CAPABILITY = {"k80": "3.7", "p100": "6.0", "v100": "7.0", "t4": "7.5", "a100": "8.0", "a10": "8.6",
                      "a10g": "8.6", "a6000": "8.6", "rtx3090": "8.6", "l4": "8.9", "l40": "8.9", "l40s": "8.9",
                      "rtx4090": "8.9", "h100": "9.0", "h200": "9.0", "b200": "10.0"}


class InstanceOffer(Model):
    """One way to get a machine: an instance type in a region at a price (spot or on-demand)."""

    backend: BackendName = Field(description="Where the machine comes from: aws, gcp, or local (this machine).")
    instance_type: str = Field(description="Instance or machine type, e.g. g5.xlarge or n1-standard-8; 'local'.")
    region: str = Field(description="Cloud region, e.g. us-east-1; 'local' for this machine.")
    zones: list[str] = Field(default_factory=list, description="Zones of the region that offer this type.")
    cpu_arch: Literal["x86", "arm"] = Field("x86", description="CPU architecture.")
    cpus: int = Field(ge=0, description="Number of vCPUs.")
    memory_gb: float = Field(ge=0, description="RAM in GB.")
    disk_gb: float = Field(DEFAULT_DISK_GB, ge=0, description=(
        "Disk in GB. Cloud disks are sized from the requirement when matched (its min, else 100 GB); "
        "for the local offer, the free disk of the durastack home."))
    gpu_vendor: Optional[str] = Field(None, description="GPU vendor, e.g. nvidia; None without GPU.")
    gpu_name: Optional[str] = Field(None, description="GPU model, e.g. A100, A10G, L4; None without GPU.")
    gpu_memory_gb: float = Field(0.0, ge=0, description="Memory of one GPU in GB; 0 without GPU.")
    gpu_count: int = Field(0, ge=0, description="Number of GPUs.")
    spot: bool = Field(False, description="True for a spot (preemptible) price.")
    price: float = Field(ge=0, description="Price in USD per hour.")
    reservation: Optional[str] = Field(None, description=(
        "The capacity reservation (`reservation`) it is launched into, in its zones only; None for the catalog's."))

    def resources_summary(self) -> str:
        """``4xCPU, 16GB, 1xA10G (24GB), 100GB (disk)``."""
        parts = [f"{self.cpus}xCPU" + (" (arm)" if self.cpu_arch == "arm" else ""), f"{_fmt(self.memory_gb)}GB"]
        if self.gpu_count:
            parts.append(f"{self.gpu_count}x{self.gpu_name} ({_fmt(self.gpu_memory_gb)}GB)")
        parts.append(f"{_fmt(self.disk_gb)}GB (disk)")
        return ", ".join(parts)


Check = tuple[str, Callable[[InstanceOffer], bool]]  # (what an offer must have, test)


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def _size(r: Range[float]) -> str:
    lo = "" if r.min is None else f"{_fmt(r.min)}GB"
    hi = "" if r.max is None else f"{_fmt(r.max)}GB"
    return lo if r.min == r.max else f"{lo}..{hi}"


def _cc_at_least(gpu_name: Optional[str], wanted: str) -> bool:
    have = COMPUTE_CAPABILITY.get((gpu_name or "").lower())
    if have is None:
        return False  # unknown GPU: cannot promise the capability
    as_tuple = lambda v: tuple(int(p) for p in v.split("."))  # noqa: E731
    return as_tuple(have) >= as_tuple(wanted)


def _gpu_checks(gpu: Optional[GPUSpec]) -> list[Check]:
    if gpu is None:
        return []  # unset gpu means 0..: offers with and without GPUs both qualify
    checks: list[Check] = [(f"{gpu.count} GPUs", lambda o: gpu.count.contains(o.gpu_count))]
    # With a count like 0..2, offers without any GPU pass the checks on the GPU's properties.
    zero_ok = not gpu.count.min

    def each(what: str, test: Callable[[InstanceOffer], bool]) -> None:
        checks.append((what, lambda o: (zero_ok and o.gpu_count == 0) or (o.gpu_count > 0 and test(o))))

    vendor = gpu.effective_vendor()
    if vendor:
        each(f"{vendor} GPUs", lambda o: (o.gpu_vendor or "").lower() == vendor)
    if gpu.name:
        names = {n.lower() for n in gpu.name}
        each(f"a GPU named {' or '.join(gpu.name)}", lambda o: (o.gpu_name or "").lower() in names)
    if gpu.memory:
        each(f"{_size(gpu.memory)} per GPU", lambda o: gpu.memory.contains(o.gpu_memory_gb))
    if gpu.total_memory:
        each(f"{_size(gpu.total_memory)} of GPU memory in total",
             lambda o: gpu.total_memory.contains(o.gpu_memory_gb * o.gpu_count))
    if gpu.compute_capability:
        cc = gpu.compute_capability
        each(f"GPU compute capability {cc} or higher", lambda o: _cc_at_least(o.gpu_name, cc))
    return checks


def _checks(resources: ResourcesSpec, spot_policy: str, max_price: Optional[float],
            backends: Optional[list[str]], regions: Optional[list[str]],
            instance_types: Optional[list[str]] = None, zones: Optional[list[str]] = None,
            reservation: Optional[ReservationLookup] = None) -> list[Check]:
    if spot_policy not in SPOT_POLICIES:
        raise ValueError(f"spot_policy must be one of {', '.join(SPOT_POLICIES)}, got {spot_policy!r}")
    checks: list[Check] = []
    if backends:
        checks.append((f"backend {' or '.join(backends)}", lambda o: o.backend in backends))
    if regions:
        checks.append((f"region {' or '.join(regions)}", lambda o: o.region in regions))
    if zones:
        checks.append((f"zone {' or '.join(zones)}", lambda o: bool(_zones_of(o, zones))))
    if instance_types:
        checks.append((f"instance type {' or '.join(instance_types)}", lambda o: o.instance_type in instance_types))
    if reservation is not None:
        checks += _reservation_checks(reservation)
    if spot_policy == "spot":
        checks.append(("a spot price", lambda o: o.spot))
    elif spot_policy == "on-demand":
        checks.append(("an on-demand price", lambda o: not o.spot))
    cpu, memory = resources.cpu, resources.memory
    if cpu.arch:
        checks.append((f"{cpu.arch} CPUs", lambda o: o.cpu_arch == cpu.arch))
    # A cloud offer is a whole instance and must fit the range; this machine is shared by its
    # replicas, so it only needs at least the minimum.
    checks.append((f"{cpu.count} vCPUs", lambda o: _fits(cpu.count, o.cpus, o)))
    checks.append((f"{_size(memory)} of memory", lambda o: _fits(memory, o.memory_gb, o)))
    # Cloud disks are created at the size asked for; only this machine's free disk can be too small —
    # and only a disk the user asked for: the cloud default (100GB..) would rule out most laptops.
    disk = resources.disk
    if disk is not None:
        checks.append((f"{_size(disk)} of disk", lambda o: o.backend != "local" or o.disk_gb >= (disk.min or 0)))
    checks += _gpu_checks(resources.gpu)
    if max_price is not None:  # last, so that describe_mismatch can name the cheapest offer that fits otherwise
        checks.append((f"a price of at most ${max_price:g}/h", lambda o: o.price <= max_price))
    return checks


def _reservation_checks(reservation: ReservationLookup) -> list[Check]:
    """Offers ``_reserved`` marked: those a reservation found takes, on demand, in one that can launch now."""
    name = reservation.name
    what = f"the instance type of reservation {name}" if reservation.found else f"reservation {name}"
    problems = "; ".join(f"{r.zone}: {r.problem()}" for r in reservation.found if r.problem())
    return [(f"{what} ({reservation.describe()})", lambda o: o.reservation == name),
            ("an on-demand price", lambda o: not o.spot),  # a reservation takes no spot instance
            (f"reservation {name} open to launches ({problems})",
             lambda o: any(r.problem() is None for r in reservation.taking(o)))]


def _reserved(offers: Iterable[InstanceOffer], reservation: Optional[ReservationLookup]) -> list[InstanceOffer]:
    """Each offer a reservation found takes, marked with its name and placed in its zones (those of the
    reservations that can launch now, if any), whatever zones the catalog lists; the other offers as they are."""
    if reservation is None:
        return list(offers)
    marked = []
    for o in offers:
        taking = reservation.taking(o)
        usable = [r for r in taking if r.problem() is None] or taking
        marked.append(o.model_copy(update={"reservation": reservation.name, "zones": sorted({r.zone for r in usable})})
                      if taking else o)
    return marked


def _zones_of(offer: InstanceOffer, zones: list[str]) -> list[str]:
    """The zones of ``zones`` where ``offer`` can be placed: those it lists, or, where the catalog lists none for
    it, those of its region (a zone's name starts with its region's)."""
    if offer.zones:
        return [z for z in offer.zones if z in zones]
    return [z for z in zones if z.startswith(offer.region)]


def _fits(rng: Range, value: float, offer: InstanceOffer) -> bool:
    return value >= (rng.min or 0) if offer.backend == "local" else rng.contains(value)


def _sized_disk(offer: InstanceOffer, disk: Optional[Range[float]]) -> InstanceOffer:
    if offer.backend == "local":
        return offer
    disk = disk or Range[float](min=DEFAULT_DISK_GB)
    size = disk.min if disk.min is not None else DEFAULT_DISK_GB
    if disk.max is not None:
        size = min(size, disk.max)  # e.g. disk: ..50GB
    return offer.model_copy(update={"disk_gb": size})


def sort_key(offer: InstanceOffer) -> tuple:
    """Cheapest first; ties broken by backend, instance type, region (then GPUs, on-demand first)."""
    return (offer.price, offer.backend, offer.instance_type, offer.region, offer.gpu_name or "", offer.gpu_count,
            offer.spot)


def match_offers(offers: Iterable[InstanceOffer], resources: ResourcesSpec, *, spot_policy: str = "on-demand",
                 max_price: Optional[float] = None, backends: Optional[list[str]] = None,
                 regions: Optional[list[str]] = None, instance_types: Optional[list[str]] = None,
                 zones: Optional[list[str]] = None,
                 reservation: Optional[ReservationLookup] = None) -> list[InstanceOffer]:
    """The offers that meet every requirement, cheapest first, with cloud disks sized from the requirement, and,
    with ``zones``, only those zones left in each (provisioning walks an offer's zones).

    ``spot_policy``: ``spot`` keeps only spot prices, ``on-demand`` only on-demand ones, ``auto`` both.
    ``reservation``: the service asks for one, and this is what the clouds said of it: only the on-demand offers
    of a reservation that can launch now are kept, marked with its name, in its zones only.
    """
    checks = _checks(resources, spot_policy, max_price, backends, regions, instance_types, zones, reservation)
    kept = [_sized_disk(o, resources.disk) for o in _reserved(offers, reservation)
            if all(test(o) for _, test in checks)]
    if zones:
        kept = [o.model_copy(update={"zones": _zones_of(o, zones)}) for o in kept]
    return sorted(kept, key=sort_key)


def describe_mismatch(offers: Iterable[InstanceOffer], resources: ResourcesSpec, *, spot_policy: str = "on-demand",
                      max_price: Optional[float] = None, backends: Optional[list[str]] = None,
                      regions: Optional[list[str]] = None, instance_types: Optional[list[str]] = None,
                      zones: Optional[list[str]] = None,
                      reservation: Optional[ReservationLookup] = None) -> Optional[str]:
    """Why ``match_offers`` finds nothing, e.g. ``no offer has a GPU named X100``; None if something matches.

    Checks are applied in order; the first one that leaves no offer is the reason. If some offer meets it on its
    own, the reason names the earlier requirements that narrowed the offers down. A too low max_price is
    explained with the cheapest offer that meets everything else.
    """
    offers = _reserved(offers, reservation)
    if not offers:
        return "there are no offers at all"
    remaining, narrowed_by = offers, []
    for what, test in _checks(resources, spot_policy, max_price, backends, regions, instance_types, zones,
                              reservation):
        kept = [o for o in remaining if test(o)]
        if not kept and max_price is not None and what.startswith("a price"):
            cheapest = min(remaining, key=sort_key)
            return (f"no offer costs at most ${max_price:g}/h; the cheapest that fits otherwise is "
                    f"{cheapest.instance_type} in {cheapest.region} ({cheapest.backend}) at ${cheapest.price:g}/h")
        if not kept:
            if narrowed_by and any(test(o) for o in offers):
                return f"no offer has {what} together with {', '.join(narrowed_by)}"
            return f"no offer has {what}"
        if len(kept) < len(remaining):
            narrowed_by.append(what)
        remaining = kept
    return None


__all__ = ["COMPUTE_CAPABILITY", "DEFAULT_DISK_GB", "SPOT_POLICIES", "InstanceOffer", "describe_mismatch",
           "match_offers", "sort_key"]
