"""State of a service run, as the ServiceRunWorkflow keeps it and `durastack ps` shows it.

Everything here travels through Temporal history (workflow input, continue-as-new, queries), so
it stays small: ids, specs and states — no logs, no stats history.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal, Optional

from pydantic import BaseModel, Field

from models.replica import JobSpec
from models.service import ServiceConfiguration

ReplicaStatus = Literal["submitted", "provisioning", "running", "terminating", "terminated", "failed"]
ACTIVE = ("submitted", "provisioning", "running")
FINISHED = ("terminated", "failed")


class Placement(BaseModel):
    """Where a replica landed: the offer it was provisioned from and how the gateway reaches it."""

    backend: str = Field(description="aws, gcp or local.")
    region: str = Field("", description="Region (or 'local').")
    instance_type: str = Field("", description="Instance type of the offer.")
    price: float = Field(0.0, description="Hourly price, USD.")
    spot: bool = Field(False, description="Whether the instance is spot.")
    address: str = Field("", description="Gateway upstream address of the app.")
    instance_id: str = Field("", description="Backend-specific instance identity.")


class Replica(BaseModel):
    """One submission of one replica (spec 2.3): the row `ps` shows."""

    replica_num: int = Field(description="Run-global replica number; only goes up, never reused by another group.")
    submission_num: int = Field(0, description="0 for the first submission; +1 for each resubmission.")
    group: str = Field(description="Name of the replica group the replica belongs to.")
    deployment_num: int = Field(0, description="Deployment the replica's spec comes from.")
    status: ReplicaStatus = Field("submitted", description="Lifecycle state.")
    ready: bool = Field(False, description="All probes passed.")
    registered: bool = Field(False, description="The gateway routes traffic to it.")
    placement: Optional[Placement] = Field(None, description="Where it runs, once provisioned.")
    submitted_at: datetime = Field(description="When this submission was created.")
    finished_at: Optional[datetime] = Field(None, description="When it reached terminated/failed.")
    reason: str = Field("", description="Why it stopped or failed: scaled_down, stopped, exited (N), no offers, …")
    stop_requested: bool = Field(False, description="The service asked it to stop.")
    spec_hash: str = Field("", description="What it runs (workflows.changes.spec_hash); equal = no restart needed.")

    @property
    def active(self) -> bool:
        return self.status in ACTIVE and not self.stop_requested

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    @property
    def key(self) -> tuple[int, int]:
        return self.replica_num, self.submission_num


class GroupState(BaseModel):
    name: str = Field(description="Group name.")
    desired: int = Field(description="Replicas the group should have now.")
    last_scaled_at: Optional[datetime] = Field(None, description="This group's last scaling event (not retries).")
    failures: int = Field(0, description="Consecutive replica failures; sets the resubmission back-off.")
    retry_after: Optional[datetime] = Field(None, description="No resubmission in this group before this time.")
    rollout_failed: str = Field("", description="Why this group's rollout stopped; old replicas keep serving.")


class Event(BaseModel):
    """One entry of the decision log (`durastack events`)."""

    at: datetime
    kind: str = Field(description="scale, replica, rollout, apply, stop, rejected, …")
    group: Optional[str] = None
    message: str
    seq: int = Field(0, description="Position in the service's log (from 1): the store's key, so a retried write "
                                    "never duplicates an entry.")


class ServiceState(BaseModel):
    """All durable state of a ServiceRunWorkflow, carried whole across continue-as-new."""

    name: str
    config: ServiceConfiguration
    previous_config: Optional[ServiceConfiguration] = Field(None, description="For `durastack rollback`.")
    deployment_num: int = 0
    groups: dict[str, GroupState] = Field(default_factory=dict)
    replicas: list[Replica] = Field(default_factory=list)
    next_replica_num: int = 0
    events: list[Event] = Field(default_factory=list)
    last_seq: int = Field(0, description="`seq` of the latest event.")
    unrecorded: list[Event] = Field(
        default_factory=list, description="Events not yet written to the store's decision log (kept on failure).")
    submitted_at: Optional[datetime] = None
    stopping: bool = False
    stats: Optional["StatsSnapshot"] = Field(None, description="Latest gateway snapshot; None = no stats yet.")

    def latest(self) -> list[Replica]:
        """The latest submission of every replica number."""
        latest: dict[int, Replica] = {}
        for r in self.replicas:
            if r.replica_num not in latest or r.submission_num > latest[r.replica_num].submission_num:
                latest[r.replica_num] = r
        return sorted(latest.values(), key=lambda r: r.replica_num)

    def find(self, replica_num: int, submission_num: int) -> Optional[Replica]:
        return next((r for r in self.replicas if r.key == (replica_num, submission_num)), None)


class ServiceRecord(BaseModel):
    """What a service writes to the store after a pass: new decision-log entries and its `ps` row."""

    service: str
    events: list[Event] = Field(default_factory=list, description="New events, oldest first.")
    status: "ServiceStatus"


class ReplicaUpdate(BaseModel):
    """A child ReplicaWorkflow's report to its service (signal `replica_changed`)."""

    replica_num: int
    submission_num: int
    status: ReplicaStatus
    ready: bool = False
    registered: bool = False
    placement: Optional[Placement] = None
    reason: str = ""


class ReplicaInput(BaseModel):
    """Input of a ReplicaWorkflow: everything it needs, so it never reads its parent's state."""

    service_workflow_id: str
    job: JobSpec
    deployment_num: int = 0
    resources: dict = Field(default_factory=dict, description="ResourcesSpec as JSON (offers are matched on it).")
    probes: list[dict] = Field(default_factory=list, description="ProbeSpec list as JSON.")
    backends: Optional[list[str]] = None
    regions: Optional[list[str]] = None
    spot_policy: str = "on-demand"
    max_price: Optional[float] = None
    stop_duration: int = 300
    heartbeat_seconds: int = Field(30, description="Heartbeat timeout of the long activities (probes, watch).")
    watch_heartbeat_seconds: int = Field(300, description=(
        "The watch's heartbeat timeout, if longer than heartbeat_seconds: a watch lost with its worker only delays "
        "noticing the app's exit, while every watch heartbeats for the replica's whole life (bench/scale_out.py)."))


class ApplyRequest(BaseModel):
    """A new configuration for a running service, as JSON: validated again by the workflow."""

    config: dict


class ApplyResult(BaseModel):
    deployment: int
    in_place: list[str] = Field(default_factory=list, description="Changed fields applied without restarts.")
    rolling: list[str] = Field(default_factory=list, description="Changed fields that roll replicas.")
    kept: int = Field(0, description="Replicas that joined the new deployment without a restart.")
    replacing: int = Field(0, description="Replicas that will be replaced one at a time.")


class ScaleRequest(BaseModel):
    group: str
    count: int


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
    submitted_at: datetime
    reason: str = ""


class GroupView(BaseModel):
    name: str
    desired: int
    min: int
    max: int
    resources: str = ""
    rollout: str = Field("", description="Rollout state of the group: '', 'rolling', or why it failed.")
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


# --- activity inputs and results (names in workflows.names) ---------------------------------------

class Delegation(BaseModel):
    """Provision on ``backend`` alone, by the worker polling ``task_queue`` (a worker with its credentials)."""

    backend: str
    task_queue: str


class Provisioned(BaseModel):
    placement: Optional[Placement] = Field(None, description="Where it runs; None only when ``delegate`` is set.")
    instance: dict = Field(default_factory=dict, description="The backend's own instance record (e.g. LocalInstance "
                                                               "or CloudInstance as JSON).")
    delegate: list[Delegation] = Field(default_factory=list, description=(
        "Nothing provisioned yet: try these, in order (clouds served by workers of their own; see worker.py)."))


class InstanceRef(BaseModel):
    """Enough to find an instance again: its backend, its record, and the job it runs."""

    backend: str
    job: JobSpec
    instance: Optional[dict] = None


class ReadyInput(BaseModel):
    ref: InstanceRef
    probes: list[dict] = Field(default_factory=list)


class Registration(BaseModel):
    service: str
    replica_id: str
    group: str
    address: str = ""
    drain_seconds: int = 0


class RouteInput(BaseModel):
    service: str
    auth: bool = True
    cold_start_timeout: Optional[int] = Field(None, description="How long the gateway holds a request at zero.")


class GroupWatch(BaseModel):
    """What the stats watcher needs to know of one autoscaled group."""

    name: str
    target: float
    window: int
    lo: int
    hi: int
    wanted: int = Field(description="The count the last snapshot asked for; the watcher returns when it changes.")


class StatsWatch(BaseModel):
    service: str
    groups: list[GroupWatch]
    max_seconds: int = Field(3000, description="Return a snapshot after this long even without a change.")
    poll_seconds: float = Field(1.0, description="How often the gateway's stats are read.")


class StatsSnapshot(BaseModel):
    """Request rates the gateway saw for a service, per window (seconds → requests per second)."""

    rps: dict[int, float] = Field(default_factory=dict)
    held: int = Field(0, description="Requests held by the gateway's activator, waiting for a replica.")

    def rate(self, window: int) -> float:
        # Held requests are arrivals too: they make a scaled-to-zero group wake at once.
        return self.rps.get(window, 0.0) + self.held / window


ServiceState.model_rebuild()
ServiceRecord.model_rebuild()
