"""State of a service run, as the ServiceRunWorkflow keeps it and `durastack ps` shows it.

Everything here travels through Temporal history (workflow input, continue-as-new, queries), so
it stays small: ids, specs and states — no logs, no stats history.
"""

from __future__ import annotations

from datetime import datetime
from enum import IntEnum
from typing import Any, Literal, Optional

from pydantic import BaseModel, Field

from models.gateway import RouteRateLimit
from models.replica import JobSpec
from models.resources import ResourcesSpec
from models.secrets import SecretText
from models.service import DEFAULT_STARTUP_TIMEOUT, SCALING_WINDOWS, ProbeSpec, ServiceConfiguration

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
    spec_hash: str = Field("", description="What it runs (workflows.changes.spec_hash); equal = no restart needed.")
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
        "What its instance was chosen by (workflows.jobs.placement_key): an instance it leaves idle is reused only "
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
    placement_key: str = Field("", description="Its replica's workflows.jobs.placement_key; '' matches none.")
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
    hash_key: SecretText = Field("", description=(
        "The key of the replica spec hashes (workflows.changes.spec_hash), which go into history in clear and hash "
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


class ServiceRecord(BaseModel):
    """What a service writes to the store after a pass: new decision-log entries and its `ps` row."""

    service: str
    events: list[Event] = Field(default_factory=list, description="New events, oldest first.")
    status: "ServiceStatus"


class RecordResult(BaseModel):
    """What the store holds of the service's run just below the entries written (to find a lost stretch)."""

    last_before: int = Field(0, description="The highest seq of this run the store has below the first entry "
                                            "written; 0: none. Less than first - 1 means entries are missing.")


# The lifecycle steps a replica reports, in order (ReplicaUpdate.seq): a retried activity sends its step's
# number again, and the service drops any report not newer than the last it applied.
class Step(IntEnum):
    PROVISIONING = 1  # launch started
    PROVISIONED = 2  # running, not ready yet
    SERVING = 3  # ready and registered with the gateway
    TERMINATING = 10  # teardown started
    FINISHED = 11  # teardown done: terminated or failed


class ReplicaUpdate(BaseModel):
    """A replica's report to its service (signal `replica_changed`), sent by its launch and teardown activities."""

    replica_num: int
    submission_num: int
    status: ReplicaStatus
    ready: bool = False
    registered: bool = False
    placement: Optional[Placement] = None
    reason: str = ""
    seq: int = Field(0, description="Lifecycle position of this report: the service drops one not newer than the last.")
    instance: Optional["Instance"] = Field(None, description="The instance, once provisioned (for a teardown the "
                                                             "service must do itself).")
    refs: dict[str, str] = Field(default_factory=dict, description=(
        "The late references its launch resolved once it was placed (workflows.addresses.late), key → value."))
    idle: bool = Field(False, description="With its end: its instance was kept idle, not terminated (`instance`).")


class ReplicaInput(BaseModel):
    """Input of a ReplicaWorkflow: everything it needs, so it never reads its parent's state."""

    service_workflow_id: str
    job: JobSpec
    deployment_num: int = 0
    # Typed: their JSON is what the earlier ``dict`` fields held, so inputs already in history still decode.
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="What offers are matched on.")
    probes: list[ProbeSpec] = Field(default_factory=list, description="Readiness probes; none: any HTTP answer.")
    backends: Optional[list[str]] = None
    launch_on: list[str] = Field(default_factory=lambda: ["local"], description=(
        "Backends to launch on, in order: those this deployment serves that the service allows."))
    regions: Optional[list[str]] = None
    instance_types: Optional[list[str]] = Field(None, description="Only these instance types (the service's).")
    zones: Optional[list[str]] = Field(None, description="Only these availability zones (the service's).")
    reservation: Optional[str] = Field(None, description=(
        "The capacity reservation it is launched into (its group's `reservation`, else the service's)."))
    spot_policy: str = "on-demand"
    max_price: Optional[float] = None
    stop_duration: int = 300
    startup_timeout: int = Field(DEFAULT_STARTUP_TIMEOUT, description="Seconds it may take to become ready once its "
                                                                     "commands run.")
    route: bool = Field(True, description="Register it with the gateway once ready; False for a worker behind the "
                                          "service's router group.")
    heartbeat_seconds: int = Field(20, description="Heartbeat timeout of its launch and teardown (the service's).")
    unserved_seconds: int = Field(60, description="Its launch on a backend no worker takes within this moves on "
                                                  "to the next backend (the service's).")
    late_refs: list[str] = Field(default_factory=list, description=(
        "References its launch resolves once the replica is placed (workflows.addresses.late): they stay in the "
        "job's commands as expressions until then."))
    late_env: dict[str, str] = Field(default_factory=dict, description="Env variables set to a late reference's "
                                                                       "value (name → reference).")
    reuse: Optional["Instance"] = Field(None, description=(
        "An instance a replica of the same group and service left idle, with the same placement inputs: placed "
        "on it when it still runs, else on a new one as usual (`idle_duration`)."))


class AddressQuery(BaseModel):
    """A placed replica asks its service for the values of its late references (query `addresses`)."""

    replica_num: int
    submission_num: int
    keys: list[str]


class AddressAnswer(BaseModel):
    values: dict[str, str] = Field(default_factory=dict, description="Key → value, for those that resolve.")
    missing: dict[str, str] = Field(default_factory=dict, description="Key → why it does not resolve yet.")
    placed: bool = Field(False, description="Whether the service knows where the asking replica is (its report "
                                            "of that arrived): until then, nobody can resolve a reference to it.")


class ApplyRequest(BaseModel):
    """A new configuration for a service: the CLI runs every rule of the loader before sending it."""

    config: ServiceConfiguration


class ApplyResult(BaseModel):
    deployment: int
    changed: bool = Field(True, description=(
        "False when the service already ran this configuration (nothing changed, `deployment` is the running "
        "one), which is also what the apply that just started the service sees."))
    in_place: list[str] = Field(default_factory=list, description="Changed fields applied without restarts.")
    rolling: list[str] = Field(default_factory=list, description="Changed fields that roll replicas.")
    kept: int = Field(0, description="Replicas that joined the new deployment without a restart.")
    replacing: int = Field(0, description="Replicas that will be replaced one at a time.")
    following: dict[str, int] = Field(default_factory=dict, description=(
        "Group → its replicas that roll too, after a replica their commands name is replaced (not in `replacing`)."))


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


# --- activity inputs --------------------------------------------------------------------------------
# Delegation, Provisioned, InstanceRef, ReadyInput and Registration are the old ReplicaWorkflow's messages
# (provision → wait_ready → register → watch → unregister → terminate). No activity takes them any more; they
# stay only so that workflows/replica.py imports until its rewrite on the lean lifecycle lands, then go with it.

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
    pass_authorization: bool = Field(False, description="With auth, the replicas get the client's Authorization header.")
    strip_prefix: bool = Field(True, description="Drop /services/<name> from the path the replicas get.")
    rate_limits: list[RouteRateLimit] = Field(default_factory=list, description="The gateway's request-rate limits.")
    unavailable: str = Field("", description="Why the service cannot serve (its routed groups crash-loop, or it "
                                             "failed): the gateway answers 503 with it at once; '' holds requests.")


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
        """Over the gateway's shortest window that holds ``window`` (an engine group's may be shorter than any)."""
        kept = next(w for w in SCALING_WINDOWS if w >= window)
        # Held requests are arrivals too: they make a scaled-to-zero group wake at once.
        return self.rps.get(kept, 0.0) + self.held / kept


class EngineGroupWatch(BaseModel):
    """One group scaling on an engine signal, as one backend's engine watcher needs it."""

    name: str
    metric: str
    target: float
    window: int
    lo: int
    hi: int
    path: str = Field("/metrics", description="The engines' Prometheus endpoint, on the replica's app port.")
    others: float = Field(0.0, description="Sum of the values other backends' watchers last read in this group.")
    others_read: int = Field(0, description="How many replicas those values are of.")
    others_counted: int = Field(0, description="Those and the other backends' replicas that could not be read.")
    wanted: int = Field(description="The count the last reading asked for; the watcher returns when it changes.")


class EngineWatch(BaseModel):
    """A service's serving replicas on one backend whose group scales on an engine signal."""

    service: str
    backend: str
    groups: list[EngineGroupWatch]
    replicas: list[Watched]
    known: list["ReplicaSignal"] = Field(default_factory=list, description=(
        "What the last snapshot said of each replica: the watcher also returns when a replica is read for the "
        "first time or its error changes."))
    poll_seconds: float = Field(1.0, description="How often each engine is read.")
    max_seconds: int = Field(3000, description="Return a snapshot after this long even without a change.")


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


# The instance union (a local process tree or a cloud VM) is models.router's. Imported here, after Placement:
# models.backends, which it imports, imports models.offers only.
from models.router import Instance, RouterLeave, RouterView  # noqa: E402

ServiceRecord.model_rebuild()


# --- the lean replica lifecycle (activities/interface.py) -------------------------------------------

class Launched(BaseModel):
    """Where a replica runs: what its launch steps return (placed, then started) and, once it serves, its
    workflow keeps."""

    placement: Placement
    instance: "Instance"
    refs: dict[str, str] = Field(default_factory=dict, description="The late references it was started with.")
    done: Literal["placed", "started", "serving"] = Field("placed", description=(
        "How far the launch got: a step that ends at once goes on with the next in the same activity (a local "
        "replica's whole launch is one), and the workflow schedules only the steps still to do. Not read for runs "
        "recorded before the steps."))


class LaunchInput(BaseModel):
    """Launch one replica on one backend (the task queue ``<queue>-<backend>`` serves it)."""

    replica: ReplicaInput
    backend: str = Field(description="local, aws or gcp: the backend this attempt uses.")


# One attempt of the readiness step probes this long, then fails retryably (NotReadyYet) unless a probe's streak is
# under way: a model that loads for an hour costs its workflow no event, and a worker lost meanwhile costs a minute.
READY_ATTEMPT_SECONDS = 60


class LaunchStep(BaseModel):
    """A launch step after the first (``start_replica``, ``await_ready``): the replica where the first placed it."""

    replica: ReplicaInput
    backend: str = Field(description="The backend it was placed on.")
    launched: Launched = Field(description="Its placement and instance (and, once started, its late references).")


class NoCapacity(BaseModel):
    """Details of the typed ``NoCapacity`` ApplicationError a launch raises when a backend cannot place it."""

    backend: str
    tried: bool = Field(description="True: offers were tried and each failed; False: no offer matched at all.")
    reasons: list[str] = Field(default_factory=list, description="Why, per offer or per backend.")


class TeardownInput(BaseModel):
    """Leave the gateway, drain, terminate; report the final state to the service. Idempotent."""

    service_workflow_id: str
    job: JobSpec
    backend: str
    instance: Optional["Instance"] = Field(None, description="None: a launch may have made one; find it by the job.")
    drain_seconds: int = 0
    reason: str = ""
    final: Literal["terminated", "failed"] = "terminated"
    router: Optional["RouterLeave"] = Field(None, description="A worker behind a synced router: leave it first, then "
                                                               "wait for its in-flight requests.")
    keep: bool = Field(False, description=(
        "Keep the instance idle instead of terminating it, if its backend can (a cloud VM reached over SSH): its "
        "container and job files removed, its tunnel closed. The teardown returns whether it kept it."))
    idle: bool = Field(False, description=(
        "The instance was kept idle: terminate it only while its tags still name this replica (another replica "
        "may have taken it)."))


class Watched(BaseModel):
    """One replica a service's monitor watches."""

    replica_num: int
    submission_num: int
    group: str
    workflow_id: str = Field(description="The replica's workflow: watched too, e.g. terminated from the Web UI.")
    replica_id: str = Field(description="JobSpec.replica_id: its gateway registration.")
    instance: "Instance"


class MonitorInput(BaseModel):
    """All serving replicas of one service on one backend; the monitor returns when one is down."""

    service: str
    backend: str
    replicas: list[Watched]
    poll_seconds: float = Field(0.5, description="How often each instance is checked.")
    workflow_check_seconds: float = Field(5.0, description="How often each replica's workflow is described.")


class Down(BaseModel):
    """A watched replica that stopped serving: already unrouted by the monitor."""

    replica_num: int
    submission_num: int
    reason: str = Field(description="exited (1), instance terminated, workflow terminated, …")
    workflow_closed: bool = Field(False, description="Its workflow is gone: the service must tear it down itself.")

class FleetInput(BaseModel):
    """A backend's fleet monitor (workflows/fleet.py): what every service watches there, carried across its
    continue-as-new. One heartbeating activity watches all of it, where each service's own monitor cost one."""

    backend: str
    watched: list[MonitorInput] = Field(default_factory=list)
    heartbeat_seconds: int = Field(24, description="Heartbeat timeout of its activity: how soon another worker "
                                                   "takes the watch over from a dead one (its first look follows: "
                                                   "within the failover goal of 30 s).")
    query_seconds: float = Field(5.0, description="How often the activity asks the workflow what changed.")
    closed_check_seconds: float = Field(15.0, description="How often replica workflows that closed (e.g. "
                                                          "terminated from the Web UI) are listed.")
    history_limit: int = Field(10_000, description="Continue-as-new past this many events (or when suggested).")


class FleetChanges(BaseModel):
    """What the fleet monitor's watched set gained or lost since a version (query ``changes``)."""

    version: int
    full: bool = Field(description="``watched`` is the whole set, not only what changed.")
    watched: list[MonitorInput] = Field(description="Each changed service's input; no replicas: no longer watched.")


class FleetDowns(BaseModel):
    """The fleet monitor's news for one service (signal ``replicas_down``): these are down, already unrouted."""

    backend: str
    downs: list[Down]


for _model in (Replica, IdleInstance, ReplicaUpdate, ReplicaInput, Launched, TeardownInput, Watched, EngineWatch):
    _model.model_rebuild()


# --- messages of the service workflow ------------------------------------------------------------

class StopRequest(BaseModel):
    """Ask a replica to leave: ``failed`` when the service saw it die (it counts toward the back-off)."""

    reason: str = "stopped"
    failed: bool = False
    router: Optional["RouterLeave"] = Field(None, description="A worker behind a synced router: leave it first.")
    idle_seconds: int = Field(0, description=(
        "Keep its instance idle up to this long for the group's next replica (`idle_duration`, asked only of a "
        "scale-down or a rolling replacement); 0: terminate it."))


class Release(BaseModel):
    """The service tells a replica whose instance is idle that its idle time is over: ``terminate`` it (its time is
    up, or the replica that took it did not place on it), or leave it as it is (another replica runs on it, or the
    service terminated it itself)."""

    terminate: bool = True


class SignalInput(BaseModel):
    """A `scale` or `apply` signal's raw payload and what the service is now, for the judge (a local activity)."""

    kind: Literal["scale", "apply", "start"]  # start: the run's own configuration, as each run begins
    payload: Any = None
    service: str
    config: ServiceConfiguration
    stopping: bool = False


class Verdict(BaseModel):
    """The judge's answer, recorded in history: replay never judges a signal again with newer rules."""

    reason: str = Field("", description="Why it was refused; empty when accepted.")
    scale: Optional[ScaleRequest] = None
    apply: Optional[ApplyRequest] = None

for _model in (StopRequest, ServiceState, ServiceStatus, ServiceRecord):
    _model.model_rebuild()
