"""How the offer walk (activities/cloud.py) reads a cloud's failure: capacity (try the next zone, then the next
offer), quota (skip what the quota covers), region (skip a region the account may not launch in yet), transient
(retry the same call, same key) or fatal (fail the replica).

The AWS and GCP backends raise ``CloudError`` with a kind from ``classify_aws`` / ``classify_gcp``; only
activities handle these, so they live beside them rather than with the models that travel through history.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from models.offers import InstanceOffer


class ErrorKind(str, Enum):
    CAPACITY = "capacity"    # no capacity for this offer (or zone): try the next offer
    QUOTA = "quota"          # account quota: skip the offer's region and quota class
    REGION = "region"        # the account may not launch in the region (not enabled, being verified): skip it
    TRANSIENT = "transient"  # throttling, 5xx, network, lost response: retry the same call (same key)
    FATAL = "fatal"          # credentials, permissions, bad configuration: fail the replica with the message


AWS_CAPACITY = {"InsufficientInstanceCapacity", "InsufficientCapacity", "UnfulfillableCapacity",
                "InsufficientHostCapacity", "SpotMaxPriceTooLow", "Unsupported", "InvalidInstanceType",
                "InvalidInstanceType.NotFound",
                "InsufficientFreeAddressesInSubnet",  # the zone's subnet is full: the next zone's may not be
                # The launch under this key ran before and its instance is gone: that offer is spent.
                "IdempotentInstanceTerminated",
                # The targeted reservation is full, expired, cancelled or gone: that offer cannot be placed now.
                "ReservationCapacityExceeded", "InvalidCapacityReservationId.NotFound"}
AWS_QUOTA = {"VcpuLimitExceeded", "InstanceLimitExceeded", "MaxSpotInstanceCountExceeded"}
AWS_REGION = {"OptInRequired", "PendingVerification"}
AWS_TRANSIENT = {"RequestLimitExceeded", "Throttling", "ThrottlingException", "InternalError", "InternalFailure",
                 "ServiceUnavailable", "Unavailable", "RequestTimeout", "RequestExpired"}


def classify_aws(code: str, http_status: int = 400) -> ErrorKind:
    """EC2 error code → kind (cloud-testing.md 4.2). Unknown 5xx are transient; unknown 4xx fatal (fail fast)."""
    if code in AWS_CAPACITY:
        return ErrorKind.CAPACITY
    if code in AWS_QUOTA:
        return ErrorKind.QUOTA
    if code in AWS_REGION:
        return ErrorKind.REGION
    if code in AWS_TRANSIENT or http_status >= 500:
        return ErrorKind.TRANSIENT
    return ErrorKind.FATAL


GCP_CAPACITY = {"ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
                "REGION_RESOURCE_POOL_EXHAUSTED", "GPU_STOCKOUT", "insufficientCapacity", "UNSUPPORTED_OPERATION",
                "RESOURCE_NOT_READY", "resourceNotReady"}
GCP_QUOTA = {"QUOTA_EXCEEDED", "quotaExceeded", "rateLimitExceeded_QUOTA"}
# CONDITION_NOT_MET also says an organisation policy forbids the instance (fatal); these messages say the specific
# reservation it targets is gone, not READY, full or holds other VMs: that offer cannot be placed in that zone now.
GCP_RESERVATION = ("Specified reservation", "No available resources in specified reservations",
                   "requires reservation to be in READY state")
# conditionNotMet: a fingerprint (setLabels) no longer matches, the labels changed meanwhile: read them again.
GCP_TRANSIENT = {"RESOURCE_OPERATION_RATE_EXCEEDED", "rateLimitExceeded", "userRateLimitExceeded", "backendError",
                 "internalError", "conditionNotMet"}


# What to do about a code, said after the cloud's own message (which names no setting).
AWS_HINTS = {
    "OptInRequired": "the account has not enabled this region (AWS console → Account → AWS Regions) or subscribed "
                     "to the image; the region is skipped",
    "PendingVerification": "AWS is still verifying the account for this region (minutes, at most 4 hours); the "
                           "region is skipped until then",
    "InsufficientFreeAddressesInSubnet": "the zone's subnet has no free address (free some, or give the VPC "
                                         "larger subnets in `subnet_ids`); the next zone is tried",
    "ReservationCapacityExceeded": "the capacity reservation (`reservation`) has no free instance of this type in "
                                   "this zone: it is full, expired or cancelled",
    "InvalidCapacityReservationId.NotFound": "the capacity reservation (`reservation`) is not in this region",
}


def classify_gcp(codes: list[str], http_status: int, messages: tuple[str, ...] = ()) -> ErrorKind:
    """GCE error codes/reasons (by string, not exception class) → kind; then the HTTP status decides. ``messages``:
    the errors' own, which alone tell a specific reservation's refusal from another unmet condition."""
    if any(c in GCP_CAPACITY for c in codes) or any(r in m for m in messages for r in GCP_RESERVATION):
        return ErrorKind.CAPACITY
    if any(c in GCP_QUOTA for c in codes):
        return ErrorKind.QUOTA
    if any(c in GCP_TRANSIENT for c in codes) or http_status >= 500 or http_status in (408, 429):
        return ErrorKind.TRANSIENT
    return ErrorKind.FATAL


def aws_quota_class(offer: InstanceOffer) -> str:
    """EC2 vCPU quota class of an offer: P, G (G and VT) or standard — spot and on-demand quotas are separate."""
    family = offer.instance_type.split(".")[0].lower()
    cls = "P" if family.startswith("p") else "G" if family.startswith(("g", "vt")) else "standard"
    return f"{'spot' if offer.spot else 'on-demand'}:{cls}"


class QuotaScope(BaseModel):
    """Offers a quota error rules out for the rest of one walk."""

    model_config = ConfigDict(frozen=True)

    backend: str = Field(description="aws or gcp.")
    region: Optional[str] = Field(None, description="The region; None means every region (a global quota).")
    quota_class: Optional[str] = Field(None, description="aws_quota_class value; None means every class.")
    spot_only: bool = Field(False, description="Only spot offers (MaxSpotInstanceCountExceeded, GCP's PREEMPTIBLE_* "
                                               "quotas).")
    cause: str = Field("quota exceeded", description="Why the offers it covers are skipped, as the walk says it.")

    def covers(self, offer: InstanceOffer) -> bool:
        return (offer.backend == self.backend and (self.region is None or offer.region == self.region)
                and (self.quota_class is None or aws_quota_class(offer) == self.quota_class)
                and (not self.spot_only or offer.spot))

    def __str__(self) -> str:
        what = "spot" if self.spot_only else (self.quota_class or "all")
        return f"{self.backend} {self.region or 'all regions'} ({what})"


class CloudError(Exception):
    """A classified cloud failure. ``message`` is safe to show and to keep in history (no secrets)."""

    def __init__(self, kind: ErrorKind, message: str, *, code: str = "", scope: Optional[QuotaScope] = None):
        super().__init__(message)
        self.kind, self.message, self.code, self.scope = kind, message, code, scope

__all__ = ["CloudError", "ErrorKind", "QuotaScope", "aws_quota_class", "classify_aws", "classify_gcp"]
