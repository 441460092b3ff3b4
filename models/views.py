"""What a service shows of itself: its `ps` row (the `status` query, `durastack ps --json`, the Web UI) and its
decision log (`durastack events`). The store keeps them as JSON, so field names stay as they are."""

from __future__ import annotations

from datetime import datetime
from typing import Optional

from pydantic import BaseModel, Field

from models.router import RouterView


class Event(BaseModel):
    """One entry of the decision log (`durastack events`)."""

    at: datetime
    kind: str = Field(description="scale, replica, rollout, apply, stop, rejected, …")
    group: Optional[str] = None
    message: str
    seq: int = Field(0, description="Position in the service's log (from 1): the store's key, so a retried write "
                                    "never duplicates an entry.")


class ReplicaView(BaseModel):
    replica: int
    submission: int
    deployment: int
    group: str
    status: str
    ready: bool
    backend: str = ""
    region: str = ""
    instance_type: str = ""
    price: float = 0.0
    address: str = ""
    gpu: str = Field("", description="The GPUs it runs on, `name×count`; empty without GPU (or unknown).")
    submitted_at: datetime
    reason: str = ""
    ssh_host: str = Field("", description="A cloud replica's instance address, where `exec` and `logs` reach it.")
    instance_key: str = Field("", description="Its provisioning key, from which its host key is derived.")
    host_key_after_boot: bool = Field(False, description="Whether its sshd serves the host key made after boot.")


class GroupView(BaseModel):
    name: str
    desired: int
    min: int
    max: int
    resources: str = ""
    rollout: str = Field("", description="Rollout state of the group: '', 'rolling', or why it failed.")
    role: str = Field("", description="'router': the gateway routes the service's traffic to this group alone; "
                                      "'worker': behind the router group, never routed to by the gateway; '' without "
                                      "a router group.")
    waiting: str = Field("", description="Why a replica of this group cannot start yet.")
    signal: str = Field("", description="What the group's scaling metric read last, per replica, and its target.")
    retry_after: Optional[datetime] = Field(None, description="Replicas of this group wait on a back-off until then.")
    idle: list[str] = Field(default_factory=list, description=(
        "Instances replicas of the group left idle for its next one (`idle_duration`), `<instance> until HH:MM:SS "
        "UTC`: they bill meanwhile."))
    replicas: list[ReplicaView]


class ServiceStatus(BaseModel):
    """What the `status` query returns; the JSON `durastack ps --json` prints."""

    name: str
    status: str
    deployment: int
    auth: bool
    submitted_at: Optional[datetime]
    groups: list[GroupView]
    extra_replicas: list[ReplicaView] = Field(default_factory=list, description="Replicas of removed groups.")
    routed: Optional[bool] = Field(None, description="The gateway route: None not put yet, True put, False refused.")
    unrecorded: int = Field(0, description="Decision-log entries waiting for the store (it failed or is behind).")
    store_failing_since: Optional[datetime] = Field(None, description="Since when writes to the store fail.")
    store_error: str = Field("", description="Why the last write to the store failed.")
    router: Optional["RouterView"] = Field(None, description="The router replicas' worker lists, as last synced.")
    place: str = Field("", description="`backend/region` all of the service's replicas go to (one place), if pinned.")
    unavailable: str = Field("", description="Why the service cannot serve (lifecycle.unavailable): the gateway "
                                             "answers 503 with it instead of holding requests; '' when it may serve.")


# Resolved here, once, as in models/state.py: the workflow sandbox imports this module again.
ServiceStatus.model_rebuild()
