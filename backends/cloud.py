"""The cloud backends as one kind: what ``backends.aws.AWSBackend`` and ``backends.gcp.GCPBackend`` both provide,
the ones a configuration makes, and a reservation looked up in the regions a service allows. Blocking."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

from models.backends import BackendsConfig, CloudInstance
from models.offers import InstanceOffer
from models.replica import JobSpec
from models.reservations import ReservationLookup


class CloudBackend(ABC):
    """What ``backends.aws.AWSBackend`` and ``backends.gcp.GCPBackend`` provide (all blocking)."""

    name: str
    regions: list[str]
    installation: Optional[str]  # this control plane's id: tagged on its instances, the only ones it lists

    @abstractmethod
    def create(self, job: JobSpec, offer: InstanceOffer, key: str, *, nvcc: bool = False) -> CloudInstance:
        """Launch ``offer`` for the replica; ``key`` makes a retry return the instance the first call made."""

    @abstractmethod
    def find_reservation(self, value: str, regions: Optional[list[str]] = None) -> ReservationLookup:
        """What this cloud says of the reservation ``value`` in ``regions``."""

    @abstractmethod
    def find_replica(self, job: JobSpec, regions: Optional[list[str]] = None) -> list[CloudInstance]:
        """The instances tagged for this replica submission."""

    @abstractmethod
    def list_tagged(self, regions: Optional[list[str]] = None, *,
                    service: Optional[str] = None) -> list[CloudInstance]:
        """This control plane's instances (of ``service`` if given)."""

    @abstractmethod
    def get(self, instance: CloudInstance) -> Optional[CloudInstance]:
        """The instance as the cloud sees it now; None once gone."""

    @abstractmethod
    def terminate(self, instance: CloudInstance) -> None:
        """Terminate it; already gone is success."""

    @abstractmethod
    def retag(self, instance: CloudInstance, job: JobSpec) -> None:
        """Tag an idle instance for the replica that takes it."""

    def release(self, service: str) -> None:
        """The service has no instance left here: let go of the network rules made for it (none by default)."""



def make_backends(config: BackendsConfig, catalog: Optional[list[InstanceOffer]] = None) -> dict[str, CloudBackend]:
    """Backends for the configured clouds; a cloud without configured regions uses the catalog's regions."""
    from backends.catalog import load_catalog

    offers = catalog if catalog is not None else load_catalog()
    regions = {c: sorted({o.region for o in offers if o.backend == c}) for c in ("aws", "gcp")}
    backends: dict[str, CloudBackend] = {}
    if config.aws:
        from backends.aws import AWSBackend
        backends["aws"] = AWSBackend(config.aws, regions=regions["aws"], installation=config.installation)
    if config.gcp:
        from backends.gcp import GCPBackend
        backends["gcp"] = GCPBackend(config.gcp, regions=regions["gcp"], installation=config.installation)
    return backends


def reservation_in(cloud: CloudBackend, value: str, regions: Optional[list[str]] = None) -> ReservationLookup:
    """What ``cloud`` says of the reservation ``value`` in its regions that ``regions`` allows (all when None)."""
    allowed = [r for r in cloud.regions if not regions or r in regions]
    if not allowed:
        return ReservationLookup(name=value, notes=[f"{cloud.name}: none of the service's regions"])
    return cloud.find_reservation(value, allowed)
