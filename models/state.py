"""State of a service run, as the ServiceRunWorkflow keeps it: its groups, its replicas and where they run.

Everything here travels through Temporal history (workflow input, continue-as-new, queries), so
it stays small: ids, specs and states — no logs, no stats history. The latest watcher readings (gateway
request rates, engine signals) are kept here too: the service scales on them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal, Optional

from pydantic import BaseModel, Field

from models.router import Instance, RouterView
from models.secrets import SecretText
from models.service import SCALING_WINDOWS, ServiceConfiguration
from models.views import Event

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
    ip: str = Field("", description="The address other replicas of the same service reach it at; empty: the host "
                                    "part of `address`, if it has one.")
    instance_id: str = Field("", description="Backend-specific instance identity.")
    gpu: str = Field("", description="The offer's GPUs, `name×count` (e.g. `A10G×1`); empty without GPU.")


class Replica(BaseModel):
    """One submission of one replica: the row `ps` shows."""

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
    spec_hash: str = Field("", description="What it runs (rules.changes.spec_hash); equal = no restart needed.")
    seq: int = Field(0, description="The newest lifecycle report applied (ReplicaUpdate.seq); older ones are dropped.")
    instance: Optional["Instance"] = Field(None, description="Its instance, once provisioned.")
    routed: bool = Field(True, description="The gateway routes to it; False: a worker behind the service's router "
                                           "group, never registered, which serves once it is ready.")
    refs: dict[str, str] = Field(default_factory=dict, description=(
        "The replica addresses its commands were started with, by reference (models.interpolation)."))
    synced: Optional[bool] = Field(None, description=(
        "A worker behind a router whose worker list durastack keeps (`router: {type: sglang}`): False until a "
        "router lists it healthy, then True; it serves only then. None: not behind such a router."))
    placement_key: str = Field("", description=(
        "What its instance was chosen by (rules.jobs.placement_key): an instance it leaves idle is reused only "
        "by a replica of its group with the same key (`idle_duration`)."))
    reuse: Optional["IdleInstance"] = Field(None, description=(
        "The idle instance it was given to start on; cleared once its launch placed it (there or elsewhere) and the "
        "replica that left the instance was told."))

    @property
    def serves(self) -> bool:
        """Ready, routed by the gateway (or a worker behind the router), and not asked to stop: the one spelling
        of "this replica serves"."""
        return self.status == "running" and self.ready and (self.registered or not self.routed) \
            and self.synced is not False and not self.stop_requested

    @property
    def active(self) -> bool:
        return self.status in ACTIVE and not self.stop_requested

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    @property
    def key(self) -> tuple[int, int]:
        return self.replica_num, self.submission_num


class IdleInstance(BaseModel):
    """An instance a replica of the service left idle (`idle_duration`): the group's next replica with the same
    placement inputs starts on it. The replica's workflow stays open until it is taken or released."""

    group: str = Field(description="The group of the replica that left it: only that group's replicas take it.")
    replica_num: int = Field(description="The replica that left it (its workflow owns it until it is released).")
    submission_num: int = Field(description="That replica's submission.")
    backend: str = Field(description="Where it runs (its task queue's backend).")
    instance_id: str = Field(description="Its Placement.instance_id: a replica placed there took it.")
    instance: "Instance" = Field(description="The instance, as the replica that left it knew it.")
    placement_key: str = Field("", description="Its replica's rules.jobs.placement_key; '' matches none.")
    until: datetime = Field(description="Terminated then, unless a replica took it.")


class GroupState(BaseModel):
    name: str = Field(description="Group name.")
    desired: int = Field(description="Replicas the group should have now.")
    last_scaled_at: Optional[datetime] = Field(None, description="This group's last scaling event (not retries).")
    below_since: Optional[datetime] = Field(None, description=(
        "Since when the group's metric has asked for fewer replicas than it has, without a break (its scale-down "
        "waits for the whole down-delay of it); None when it asks for as many or more."))
    below_most: int = Field(0, description="The most replicas the metric asked for since below_since.")
    failures: int = Field(0, description="Replica failures in a row (each within FAILURE_MEMORY of the end of the last back-off); "
                                         "sets the resubmission back-off.")
    last_failed_at: Optional[datetime] = Field(None, description="When a replica of this group last failed.")
    failing_since: Optional[datetime] = Field(None, description=(
        "When the group's current row of failures began (planner.count_failure); `retry.duration` is measured "
        "from it. None: no failure since the last deployment or manual scale of the group."))
    retry_after: Optional[datetime] = Field(None, description="No resubmission in this group before this time.")
    rollout_failed: str = Field("", description="Why this group's rollout stopped; old replicas keep serving.")
    engine_note: str = Field("", description="The last engine without the metric's names noted (said once).")
    waiting: str = Field("", description="Why a replica of this group cannot start yet (a replica its commands "
                                         "reference has no address); noted once.")
    readdressed: str = Field("", description="Why replicas of this group roll though their deployment is current "
                                             "(a replica they reference has a new address); noted once.")
    failed_start: str = Field("", description=(
        "The group's latest failure, when its replica failed before it served ('replica 3 exited (1)'); '' once a "
        "replica of the group serves, and after a deployment or manual scale of the group. With none serving, the "
        "gateway answers 503 with it instead of holding requests (lifecycle.unavailable)."))


class StatsSnapshot(BaseModel):
    """Request rates the gateway saw for a service, per window (seconds → requests per second)."""

    rps: dict[int, float] = Field(default_factory=dict)
    held: int = Field(0, description="Requests held by the gateway's activator, waiting for a replica.")

    def rate(self, window: int) -> float:
        """Over the gateway's shortest window that holds ``window`` (an engine group's may be shorter than any)."""
        kept = next(w for w in SCALING_WINDOWS if w >= window)
        # Held requests are arrivals too: they make a scaled-to-zero group wake at once.
        return self.rps.get(kept, 0.0) + self.held / kept


NOT_READ_YET = "not read yet (a latency needs two readings)"


UNKNOWN_NAMES = "none of "  # how an engine that exposes none of a metric's names is said


class ReplicaSignal(BaseModel):
    """One replica's engine signal over its group's window; None with the reason it could not be read."""

    replica_num: int
    submission_num: int
    group: str
    value: Optional[float] = None
    error: str = Field("", description="Why there is no value: unreachable, none of the names, not read yet.")

    def same_kind(self, other: "ReplicaSignal") -> bool:
        return (self.value is None) == (other.value is None) and self.error == other.error

    @property
    def unreadable(self) -> bool:
        """Its engine could not be read (not merely read once so far)."""
        return self.value is None and self.error != NOT_READ_YET


class EngineSnapshot(BaseModel):
    """What one backend's engine watcher read, when."""

    backend: str
    at: datetime
    replicas: list[ReplicaSignal] = Field(default_factory=list)


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
    hash_key: SecretText = Field("", description=(
        "The key of the replica spec hashes (rules.changes.spec_hash), which go into history in clear and hash "
        "secret values: without it nobody can test guesses of a secret against them. Random per service, given by "
        "`apply`; secret itself (encrypted in history). Empty: unkeyed hashes, as in runs that predate it."))
    stopping: bool = False
    failure: str = Field("", description=(
        "Why the service gave up (a replica failure its `retry` does not cover); set with `stopping`, the run "
        "then ends as failed. Empty: not failed."))
    store_failing_since: Optional[datetime] = Field(
        None, description="First failed write of the current store outage; None while the store takes writes.")
    store_error: str = Field("", description="Why the last write to the store failed (during an outage).")
    backends: list[str] = Field(default_factory=list, description="Backends this deployment serves (served_backends).")
    routed: Optional[bool] = Field(None, description="The gateway route: None not put yet, True put, False refused.")
    stats: Optional["StatsSnapshot"] = Field(None, description="Latest gateway snapshot; None = no stats yet.")
    engines: dict[str, "EngineSnapshot"] = Field(default_factory=dict, description=(
        "Per backend, the latest engine signals of replicas whose group scales on one."))
    router_view: Optional["RouterView"] = Field(None, description="What the router replicas list, as last synced "
                                                                  "(`router: {type: sglang}`).")
    one_place: bool = Field(False, description="Its replicas reach each other (a router, address references): all "
                                               "of them go where the first one was placed (patch one-place).")
    place: str = Field("", description="`backend/region` every replica goes to once `one_place` placed the first.")
    idle: list[IdleInstance] = Field(default_factory=list, description=(
        "Instances left idle by replicas that were scaled down or replaced (`idle_duration`), oldest first."))
    places: list[str] = Field(default_factory=list, description=(
        "`backend/region` places that hold every group, cheapest first, as `apply` planned them: the first replica "
        "of a `one_place` service is placed in one of them (none: anywhere)."))

    def latest(self) -> list[Replica]:
        """The latest submission of every replica number."""
        latest: dict[int, Replica] = {}
        for r in self.replicas:
            if r.replica_num not in latest or r.submission_num > latest[r.replica_num].submission_num:
                latest[r.replica_num] = r
        return sorted(latest.values(), key=lambda r: r.replica_num)

    def find(self, replica_num: int, submission_num: int) -> Optional[Replica]:
        return next((r for r in self.replicas if r.key == (replica_num, submission_num)), None)

    def rolling(self, group: str) -> bool:
        """The one spelling of "the group is rolling": it still has active replicas of an older deployment."""
        return any(r.group == group and r.active and r.deployment_num < self.deployment_num for r in self.replicas)


# Fields that name a class defined further down (or in another module) are resolved here, once: the workflow
# sandbox imports these modules again, and pydantic's lazy resolution at first use finds nothing there.
for _model in (Replica, IdleInstance, ServiceState):
    _model.model_rebuild()
