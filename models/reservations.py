"""Capacity reservations (a service's or group's ``reservation``) as the clouds describe them, and which offers one
can take.

Pure: the backends look a reservation up (``backends.aws``, ``backends.gcp``), ``models.offers`` keeps the
offers a reservation takes, in its zones only. A value names either an EC2 Capacity Reservation or Capacity Block
(``cr-`` and 17 hex digits, looked up in every region) or a GCP reservation (``NAME`` in the backend's project, or
``projects/PROJECT/reservations/NAME`` for one shared from another project; every zone holding one of that name):
each configured cloud looks for it, and the offers come from those that have it.
"""

from __future__ import annotations

import re
from typing import Literal, Optional

from pydantic import Field

from models.common import Model

AWS_ID = re.compile(r"^cr-[0-9a-f]{17}$")
_GCP_NAME = r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?"
GCP_VALUE = re.compile(rf"^(?:projects/(?P<project>{_GCP_NAME})/reservations/)?(?P<name>{_GCP_NAME})$")
FORMS = ("an EC2 Capacity Reservation or Capacity Block id (cr- and 17 hex digits), or a GCP reservation's name "
         "(NAME, or projects/PROJECT/reservations/NAME for one shared from another project)")
RESERVATION_HELP = (f"{FORMS}. Replicas are launched into it, on demand, as its instance type and in its zone "
                    "only; a reservation no configured cloud has leaves them no offer.")
# The catalog's GPU names of N1 machines → the GCE accelerator type attached to them. Other GPU machine types
# (A2, A3, G2) come with their GPUs, so the machine type says it all.
N1_ACCELERATORS = {"t4": "nvidia-tesla-t4", "v100": "nvidia-tesla-v100", "p100": "nvidia-tesla-p100",
                   "p4": "nvidia-tesla-p4", "k80": "nvidia-tesla-k80"}
USABLE_STATES = {"aws": "active", "gcp": "READY"}


def format_error(value: str) -> Optional[str]:
    """Why ``value`` names no reservation any cloud could have; None if it may."""
    if AWS_ID.match(value) or GCP_VALUE.match(value):
        return None
    return f"`reservation` takes {FORMS}, got {value!r}"


def gcp_reservation(value: str, project: str) -> Optional[tuple[str, str]]:
    """(owner project, name) of a GCP reservation value; None if it is not one."""
    m = GCP_VALUE.match(value)
    return (m["project"] or project, m["name"]) if m else None


class Reservation(Model):
    """One reservation as its cloud describes it: what it holds, where, and how much of it is free."""

    backend: Literal["aws", "gcp"] = Field(description="The cloud that has it.")
    name: str = Field(description="The value the service gave (`reservation`).")
    region: str = Field(description="Its region.")
    zone: str = Field(description="Its zone: instances launched into it are placed there.")
    instance_type: str = Field(description="The instance (machine) type it holds.")
    accelerators: dict[str, int] = Field(default_factory=dict, description=(
        "GCP: the accelerator types attached to each reserved VM, with their counts (none for AWS)."))
    kind: Literal["capacity-reservation", "capacity-block", "reservation"] = Field(description=(
        "AWS: a Capacity Reservation or a Capacity Block (launched with the `capacity-block` market type); "
        "GCP: a reservation."))
    tenancy: str = Field("default", description="AWS: `dedicated` if its instances must be launched dedicated.")
    state: str = Field(description="As the cloud says it: AWS `active`, `expired`, …; GCP `READY`, `CREATING`, ….")
    specific: bool = Field(True, description="GCP: specificReservationRequired, without which no VM can target "
                                             "it by name.")
    total: int = Field(ge=0, description="Instances it holds.")
    in_use: int = Field(ge=0, description="Instances running in it now.")

    @property
    def free(self) -> int:
        return max(self.total - self.in_use, 0)

    def problem(self) -> Optional[str]:
        """Why no instance can be launched into it now (other than being full); None if one can."""
        if self.state != USABLE_STATES[self.backend]:
            return f"it is {self.state}" if self.backend == "aws" else f"it is {self.state}, not READY"
        if not self.specific:
            return "it does not require specific targeting (specificReservationRequired is false), so no VM can " \
                   "target it by name"
        return None

    def takes(self, offer) -> bool:
        """Whether an instance of ``offer`` is what it holds (its type, and its GPUs on GCP), spot or not."""
        if (offer.backend, offer.region, offer.instance_type) != (self.backend, self.region, self.instance_type):
            return False
        if self.backend != "gcp":
            return True
        if offer.instance_type.startswith("n1-"):  # the same N1 type is offered with several attachable GPUs
            attached = {N1_ACCELERATORS.get((offer.gpu_name or "").lower(), "?"): offer.gpu_count} \
                if offer.gpu_count else {}
            return attached == self.accelerators
        return not self.accelerators or sum(self.accelerators.values()) == offer.gpu_count

    def summary(self) -> str:
        """``g5.xlarge in us-east-1a, 1 of 2 free`` (and what else matters)."""
        extras = [k for k in (self.kind if self.kind == "capacity-block" else "",
                              f"{self.tenancy} tenancy" if self.tenancy != "default" else "") if k]
        return f"{self.instance_type} in {self.zone}, {self.free} of {self.total} free" + \
            "".join(f", {e}" for e in extras)


class ReservationLookup(Model):
    """What the configured clouds answered about one ``reservation`` value."""

    name: str = Field(description="The value the service gave.")
    found: list[Reservation] = Field(default_factory=list, description="Every reservation of that name found.")
    notes: list[str] = Field(default_factory=list, description=(
        "Where it was not found, or could not be looked for, e.g. `aws: not found in us-east-1`."))

    def merged(self, other: "ReservationLookup") -> "ReservationLookup":
        return ReservationLookup(name=self.name, found=self.found + other.found, notes=self.notes + other.notes)

    def taking(self, offer) -> list[Reservation]:
        return [r for r in self.found if r.takes(offer)]

    def describe(self) -> str:
        """The reservations found (each with what is wrong with it), or where it was looked for."""
        if not self.found:
            return "; ".join(self.notes) or "not found"
        return "; ".join(r.summary() + (f" ({r.problem()})" if r.problem() else "") for r in self.found)


__all__ = ["AWS_ID", "FORMS", "GCP_VALUE", "N1_ACCELERATORS", "RESERVATION_HELP", "Reservation", "ReservationLookup", "format_error",
           "gcp_reservation"]
