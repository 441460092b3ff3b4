"""What workflows and activities exchange: requests and answers of updates and queries, signals, and the inputs
and results of activities (launch, teardown, watchers, the store).

Everything here travels through Temporal history, and recorded histories decode it again: field names and
shapes stay as they are.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, Literal, Optional

from pydantic import BaseModel, Field

from models.gateway import RouteRateLimit
from models.replica import JobSpec
from models.resources import ResourcesSpec
from models.router import Instance, RouterLeave
from models.service import DEFAULT_STARTUP_TIMEOUT, ProbeSpec, ServiceConfiguration
from models.state import Placement, ReplicaSignal, ReplicaStatus
from models.views import Event, ServiceStatus

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
        "The late references its launch resolved once it was placed (rules.addresses.late), key → value."))
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
        "References its launch resolves once the replica is placed (rules.addresses.late): they stay in the "
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


class Watched(BaseModel):
    """One replica a service's monitor watches."""

    replica_num: int
    submission_num: int
    group: str
    workflow_id: str = Field(description="The replica's workflow: watched too, e.g. terminated from the Web UI.")
    replica_id: str = Field(description="JobSpec.replica_id: its gateway registration.")
    instance: "Instance"


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


class PlacementRefusal(BaseModel):
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


# Resolved here, once, as in models/state.py: the workflow sandbox imports this module again.
for _model in (ReplicaUpdate, ReplicaInput, Launched, TeardownInput, Watched, EngineWatch, StopRequest, ServiceRecord):
    _model.model_rebuild()
