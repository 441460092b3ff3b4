"""The service configuration: one YAML file, several replica groups.

Field-level rules live on the fields; rules that span fields or levels live in
``models.validation`` so that each error can name the exact path it is about.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, BeforeValidator, Field, FieldSerializationInfo, ValidationInfo, field_serializer,
                      field_validator, model_validator)

from models.common import Duration, IntRange, Model, Range, duration_or_off
from models.failures import RETRY_EVENTS, RetryEvent
from models.registry import RegistryAuth
from models.reservations import RESERVATION_HELP
from models.secrets import SECRETS_DESCRIPTION, dump_env, is_secret, unmark
from models.volumes import MAX_VOLUMES, Mount

SERVICE_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{1,40}$")
GROUP_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
USER_RE = re.compile(r"^([a-z_][a-z0-9_.-]{0,31}|[0-9]{1,10})$")  # a POSIX-portable user name, or a uid
# Bounds on what one service file may ask for. A service's whole configuration lives in its workflow's
# state (twice during a rollout: the running one and the previous one, kept for rollback), one record
# per replica sits beside it, and every replica's job carries its group's commands and env. Temporal
# refuses a payload over 2 MB, and a workflow that cannot write its state is stuck for good (no `ps`,
# no `stop`). With these bounds the worst case stays far below that: 2 × 256 KiB of commands + env
# (a little more once secrets are encrypted), plus 256 replica records of well under 1 KiB.
MAX_GROUPS = 32
MAX_REPLICAS_PER_GROUP = 64          # the maximum of one group's count or range
MAX_REPLICAS_PER_SERVICE = 256       # the sum of the groups' maxima
MAX_COMMANDS = 64                    # commands per group
MAX_COMMAND_BYTES = 16 * 1024        # one command
MAX_ENV = 128                        # env entries
MAX_ENV_VALUE_BYTES = 16 * 1024      # one env value
MAX_GROUP_TEXT_BYTES = 64 * 1024     # one group's commands (what one replica's job carries besides env)
MAX_ENV_BYTES = 64 * 1024            # all env names + values
MAX_SERVICE_TEXT_BYTES = 256 * 1024  # every group's commands + env, the service's share of its workflow state
MAX_LINE = 1024                      # one-line settings: image, user, working_dir, regions, …
MAX_LIST = 64                        # lists of one-line settings

PYTHON_VERSIONS = ("3.9", "3.10", "3.11", "3.12", "3.13", "3.14")
SCALING_WINDOWS = (30, 60, 300)  # the gateway's stats windows, which `rps` is read over
ENGINE_WINDOWS = (5, 300)  # an engine is read every second: any window in this range, in seconds
MAX_PROBES = 10
MAX_PROBE_TIMEOUT = 300

SpotPolicy = Literal["spot", "on-demand", "auto"]
BackendName = Literal["aws", "gcp", "local"]

from models.resources import ResourcesSpec  # noqa: E402  (after the constants it does not need)

# C0 controls, DEL and C1 controls. A NUL cannot even reach a process (argv and environ are NUL
# terminated, so it fails only at start, or cuts the value short), and the others hide or rewrite
# what a terminal shows of a command. Tab is ordinary text. Newline is allowed only where several
# lines are legitimate: commands (a YAML block scalar `|` is the usual way to write a multi-line
# shell fragment), env values (certificates, keys) and probe bodies. A carriage return never is:
# YAML already turns line breaks into \n, so a \r can only come from an escape, and it makes a
# terminal show something other than what runs.
_CONTROL_MULTILINE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROL_LINE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def _utf8_len(value: str) -> int:
    return len(value.encode("utf-8", errors="surrogatepass"))


def check_text(value: str, multiline: bool = False, max_bytes: int = MAX_LINE) -> str:
    """Refuse control characters (see above) and values longer than ``max_bytes`` (UTF-8)."""
    m = (_CONTROL_MULTILINE if multiline else _CONTROL_LINE).search(value)
    if m:
        allowed = "tab and newline" if multiline else "tab"
        raise ValueError(f"contains the control character U+{ord(m.group()):04X} at character {m.start() + 1}; "
                         f"only {allowed} may appear here")
    size = _utf8_len(value)
    if size > max_bytes:
        raise ValueError(f"is {size} bytes long; at most {max_bytes} bytes are allowed")
    return value


def _text(multiline: bool = False, max_bytes: int = MAX_LINE):
    return AfterValidator(lambda v: check_text(v, multiline, max_bytes))


Line = Annotated[str, _text()]  # a one-line setting
Command = Annotated[str, _text(multiline=True, max_bytes=MAX_COMMAND_BYTES)]


def _env_name(value: str) -> str:
    if not ENV_NAME_RE.fullmatch(value) or len(value) > 256:
        raise ValueError(f"invalid variable name {value!r}: letters, digits and '_', not starting with a digit "
                         "(at most 256 characters)")
    return value


EnvName = Annotated[str, AfterValidator(_env_name)]
EnvValue = Annotated[str, _text(multiline=True, max_bytes=MAX_ENV_VALUE_BYTES)]


def _bounded(limit: int, what: str):
    def check(value: list) -> list:
        if len(value) > limit:
            raise ValueError(f"at most {limit} {what} are allowed, got {len(value)}")
        return value
    return AfterValidator(check)


def _python_version(value: Any) -> Any:
    """YAML reads ``3.10`` as the float 3.1; the spec reads it back as "3.10"."""
    if isinstance(value, float):
        value = "3.10" if value == 3.1 else repr(value)
    if isinstance(value, str) and value not in PYTHON_VERSIONS:
        raise ValueError(f"must be one of {', '.join(PYTHON_VERSIONS)}, got {value!r}")
    return value


PythonVersion = Annotated[str, BeforeValidator(_python_version)]


def _env(value: Any) -> Any:
    """``[K=V, K]`` or ``{K: V}``. A bare ``K`` (or ``K: null``) is read from the caller's environment."""
    if isinstance(value, list):
        out: dict[str, Optional[str]] = {}
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise ValueError(f"item {i}: expected 'NAME=value' or 'NAME', got {item!r}")
            key, sep, val = item.partition("=")
            out[key] = val if sep else None
        value = out
    if isinstance(value, dict):
        if len(value) > MAX_ENV:
            raise ValueError(f"at most {MAX_ENV} variables are allowed, got {len(value)}")
        for key, val in value.items():  # names are checked by the key type, each one on its own
            if isinstance(val, bool):
                raise ValueError(f"{key!r}: write booleans as strings, e.g. \"true\"")
            if isinstance(val, (int, float)):
                value = {**value, key: str(val)}
            elif val is not None and not isinstance(val, str):
                raise ValueError(f"{key!r}: expected a string value, got {type(val).__name__}")
            elif val is not None:
                try:
                    value = {**value, key: unmark(val)}  # a secret read back from a payload (models.secrets)
                except ValueError as e:
                    raise ValueError(f"{key!r}: {e}") from None
        return value
    raise ValueError("expected a list of 'NAME=value' / 'NAME' items or a mapping")


def _env_size(value: dict[str, Optional[str]]) -> dict[str, Optional[str]]:
    size = sum(_utf8_len(k) + _utf8_len(v or "") for k, v in value.items())
    if size > MAX_ENV_BYTES:
        raise ValueError(f"names and values add up to {size} bytes; at most {MAX_ENV_BYTES} bytes are allowed")
    return value


Env = Annotated[dict[EnvName, Optional[EnvValue]], BeforeValidator(_env), AfterValidator(_env_size)]


def _port(value: Any) -> Any:
    """``8000``, ``"80:8000"`` or ``{local_port, container_port}``: only the container port matters."""
    if isinstance(value, bool):
        raise ValueError(f"expected a port number, got {value!r}")
    if isinstance(value, int):
        return {"container_port": value}
    if isinstance(value, str):
        parts = value.split(":")
        if len(parts) in (1, 2) and all(p.strip().isdigit() for p in parts):
            ports = [int(p) for p in parts]
            return {"local_port": ports[0] if len(ports) == 2 else None, "container_port": ports[-1]}
        raise ValueError(f"expected a port like 8000 or '80:8000', got {value!r}")
    return value


class PortMapping(Model):
    local_port: Optional[int] = Field(None, ge=1, le=65535, description="Port on the gateway side (informative).")
    container_port: int = Field(ge=1, le=65535, description="Port the replica's app listens on.")


# The engine signals a group may scale on, read from each replica's Prometheus endpoint; `rps` is the gateway's.
ENGINE_METRICS = ("queue", "running", "kv_cache", "ttft", "itl")
SUMMED_METRICS = ("queue", "running")  # the group's sum; the others are each replica's share, latency or mean
SCALING_TARGETS = {
    "rps": "requests per second per replica",
    "queue": "requests waiting per replica",
    "running": "requests in flight (running + waiting) per replica",
    "kv_cache": "KV-cache use per replica, 0..1",
    "ttft": "p90 time to first token, seconds",
    "itl": "p90 inter-token latency, seconds",
}


class ScalingSpec(Model):
    metric: Literal["rps", "queue", "running", "kv_cache", "ttft", "itl"] = Field(description=(
        "The scaling metric: `rps` (the gateway's requests per second), or a signal of each replica's engine: "
        "`queue` (waiting requests), `running` (running + waiting), `kv_cache` (KV-cache use, 0..1), `ttft` / "
        "`itl` (p90 time to first token / inter-token latency). `rps`, `queue` and `running` scale to "
        "ceil(sum / target); `kv_cache`, `ttft` and `itl` to ceil(replicas × value / target)."))
    target: float = Field(gt=0, description="Target per replica: " + "; ".join(
        f"`{k}`: {v}" for k, v in SCALING_TARGETS.items()) + ".")
    window: Duration = Field(60, description=(
        "Window over which the metric is measured: `rps` 30s, 60s or 300s (the gateway's windows); an engine "
        f"signal, read every second, any window from {ENGINE_WINDOWS[0]}s to {ENGINE_WINDOWS[1]}s."))
    scale_up_delay: Duration = Field(300, description="Time since this group's last scaling before scaling up.")
    scale_down_delay: Duration = Field(600, description=(
        "How long the metric must ask for fewer replicas without a break, and the time since this group's last "
        "scaling, before scaling down; then to the most it asked for in that time."))

    @field_validator("window")
    @classmethod
    def _window(cls, v: int, info: ValidationInfo) -> int:
        lo, hi = ENGINE_WINDOWS
        if info.data.get("metric") in ENGINE_METRICS:
            if not lo <= v <= hi:
                raise ValueError(f"window of an engine metric must be from `{lo}s` to `{hi}s`")
        elif v not in SCALING_WINDOWS:
            raise ValueError("window must be one of: `30s`, `60s`, `300s` (an engine metric takes any from "
                             f"`{lo}s` to `{hi}s`)")
        return v

    @model_validator(mode="after")
    def _target(self) -> "ScalingSpec":
        if self.metric == "kv_cache" and self.target > 1:
            raise ValueError(f"a `kv_cache` target is a share of the KV cache, in (0, 1]; got {self.target:g}")
        return self

    @property
    def engine(self) -> bool:
        """Read from the replicas' engines, not from the gateway."""
        return self.metric in ENGINE_METRICS


class MetricsSpec(Model):
    port: Optional[int] = Field(None, ge=1, le=65535, description=(
        "Port of the replicas' Prometheus endpoint; default the service's port (the one port a replica is reached "
        "on)."))
    path: str = Field("/metrics", max_length=2048, pattern=r"^/[\x21-\x7e]*$",
                      description="Path of the Prometheus endpoint, starting with /.")


class ProbeSpec(Model):
    type: Literal["http"] = Field(description="Probe type; only `http`.")
    url: str = Field("/", max_length=2048, pattern=r"^/[\x21-\x7e]*$", description="Path to request, starting with /.")
    method: Literal["get", "post", "put", "delete", "patch", "head"] = Field("get", description="HTTP method.")
    headers: list["ProbeHeader"] = Field(default_factory=list, max_length=16, description="Request headers.")
    body: Optional[Annotated[str, _text(multiline=True, max_bytes=2048)]] = Field(
        None, min_length=1, max_length=2048, description="Request body (not with get/head).")
    timeout: Duration = Field(10, description="Timeout of one probe request (1s..300s).")
    interval: Duration = Field(15, description="Time between the end of one probe and the next (≥ 1s). Until "
                                                   "it first passes, a probe is retried sooner: after 0.1 s, "
                                                   "doubling up to this.")
    ready_after: int = Field(1, ge=1, description="Consecutive successes before the replica is ready.")
    until_ready: bool = Field(False, description="Stop probing once the replica is ready.")

    @model_validator(mode="after")
    def _check(self) -> "ProbeSpec":
        if self.body is not None and self.method in ("get", "head"):
            raise ValueError(f"`body` is not allowed with method {self.method}")
        if not 1 <= self.timeout <= MAX_PROBE_TIMEOUT:
            raise ValueError(f"timeout must be between 1s and {MAX_PROBE_TIMEOUT}s")
        if self.interval < 1:
            raise ValueError("interval must be at least 1s")
        return self


class ProbeHeader(Model):
    name: Line = Field(min_length=1, max_length=256, description="Header name.")
    value: Annotated[str, _text(max_bytes=2048)] = Field(min_length=1, max_length=2048, description="Header value.")


class RateLimitKey(Model):
    type: Literal["ip_address", "header"] = Field("ip_address", description="What a limit is counted per: the "
                                                  "client's address, or the value of a header (`header`).")
    header: Optional[str] = Field(None, max_length=500, pattern=r"^[a-zA-Z0-9_-]+$",
                                  description="With type `header`: the header name; requests without it are not limited.")


class RateLimit(Model):
    prefix: str = Field("/", max_length=4094, pattern=r"^/[^\s{}\\]*$", description=(
        "Path prefix the limit covers, relative to the service; a request counts against the limit with the "
        "longest matching prefix."))
    key: RateLimitKey = Field(default_factory=RateLimitKey, description="What requests are counted per.")
    rps: float = Field(ge=1 / 60, description="Allowed requests per second per key; past it (and the burst) "
                                              "the gateway answers 429.")
    burst: int = Field(0, ge=0, description="Requests allowed above the rate at once.")


def _model(value: Any) -> Any:
    return {"name": value} if isinstance(value, str) else value


class ModelSpec(Model):
    type: Literal["chat"] = Field("chat", description="Model type.")
    name: Line = Field(min_length=1, description="Model name as served, e.g. meta-llama/Llama-3.2-3B-Instruct.")
    format: Literal["openai"] = Field("openai", description="API format.")
    prefix: str = Field("/v1", pattern=r"^/", description="Path prefix of the OpenAI-compatible API.")


class RouterSpec(Model):
    type: Literal["sglang", "dynamo"] = Field(description=(
        "In-service router this group runs. `sglang`: SGLang's model gateway, started with no workers "
        "(`smg launch --pd-disaggregation …`); durastack keeps its worker list equal to the service's ready "
        "workers through its worker API (role from each worker's /server_info), a worker leaves it before it "
        "stops, and without probes of the service's own the router is ready once `GET /readiness` passes. "
        "`dynamo`: the workers find the router themselves, at $DSTACK_ROUTER_INTERNAL_IP."))


class RetrySpec(Model):
    on_events: list[RetryEvent] = Field(
        default_factory=lambda: list(RETRY_EVENTS), description=(
            "Which replica failures are retried, i.e. the replica is replaced: `no-capacity` (no offer fits, or "
            "every offer failed), `interruption` (the cloud took a spot instance back), `error` (anything else: "
            "the app exited, the instance died, …). Any other failure fails the service: every replica is "
            "stopped and the run ends as failed. An empty list retries nothing (as `retry: false`). A new "
            "replica of a rollout that fails never fails the service: the rollout stops and the old replicas "
            "keep serving."))
    duration: Optional[Duration] = Field(None, description=(
        "How long a group may keep failing: a failure that comes when its group has been failing for longer "
        "fails the service. A group is failing from a failure until it goes 10 minutes without one (the back-off "
        "it waits between attempts not counted); a new deployment or a manual scale of the group starts the "
        "count again. Unset: retry for as long as it takes."))


def _retry(value: Any) -> Any:
    """``true``: retry every event for as long as it takes; ``false``: retry nothing."""
    if value is True:
        return {}
    if value is False:
        return {"on_events": []}
    return value


def _replica_count(value: Range[int]) -> Range[int]:
    # V1: a count needs a maximum; a missing minimum is 0.
    if value.max is None:
        raise ValueError("the maximum number of replicas is required (e.g. 0..4)")
    # The bound (MAX_REPLICAS_PER_GROUP) is a rule in models.validation, not a field check: a running
    # service's state is read back through this model, and must still load if it predates the bound.
    return value if value.min is not None else Range[int](min=0, max=value.max)


ReplicaCount = Annotated[IntRange, AfterValidator(_replica_count)]


def _https(value: Any) -> Any:
    if isinstance(value, bool) or value == "auto":
        return value
    raise ValueError(f"expected true, false or auto, got {value!r}")


def _gateway(value: Any) -> Any:
    if isinstance(value, (bool, str)):
        return value
    raise ValueError(f"expected true, false or a gateway name, got {value!r}")


# A 70B model's weights take 20-40 minutes to download and load on a fresh instance: an hour by default, a day at most.
DEFAULT_STARTUP_TIMEOUT = 3600
StartupTimeout = Annotated[Duration, Field(ge=1, le=86400)]

# Fields a group shares with the service level and may override.
IMAGE_FIELDS = ("image", "python", "nvcc", "docker", "privileged")


class ReplicaGroup(Model):
    name: Optional[str] = Field(None, description="Group name; defaults to the group's position (\"0\", \"1\", …).")
    count: ReplicaCount = Field(description="Replica count or range, e.g. 2 or 0..4 (also spelled `replicas`).")
    scaling: Optional[ScalingSpec] = Field(None, description="Autoscaling of this group; needed for a range.")
    metrics: Optional[MetricsSpec] = Field(None, description=(
        "Where the replicas' engines expose Prometheus metrics (vLLM's and SGLang's names), read for an engine "
        "`scaling.metric`; default the service's port and /metrics."))
    commands: Annotated[list[Command], _bounded(MAX_COMMANDS, "commands")] = Field(
        default_factory=list, description="Shell commands, run in order.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Resources of each replica.")
    image: Optional[Line] = Field(None, min_length=1, description="Docker image of this group.")
    python: Optional[PythonVersion] = Field(None, description="Python version of this group.")
    nvcc: Optional[bool] = Field(None, description="Use the CUDA devel image (nvcc available).")
    docker: Optional[bool] = Field(None, description="Docker-in-Docker (implies privileged).")
    privileged: Optional[bool] = Field(None, description="Run the container privileged.")
    spot_policy: Optional[SpotPolicy] = Field(None, description="spot, on-demand or auto for this group.")
    reservation: Optional[Line] = Field(None, description=(
        "Capacity reservation of this group's replicas (else the service's): " + RESERVATION_HELP))
    router: Optional[RouterSpec] = Field(None, description="This group runs the in-service router.")
    startup_timeout: Optional[StartupTimeout] = Field(None, description=(
        "How long a replica of this group may take to become ready once its commands run; default the service's."))

    @model_validator(mode="before")
    @classmethod
    def _replicas_alias(cls, data: Any) -> Any:
        # `replicas` (HEAD spelling) wins over `count` (seed spelling) when both are given.
        if isinstance(data, dict) and "replicas" in data:
            data = {k: v for k, v in data.items() if k not in ("replicas", "count")} | {"count": data["replicas"]}
        return data


class ServiceConfiguration(Model):
    type: Literal["service"] = Field(description="Always `service`.")
    name: Optional[str] = Field(None, description="Service name: ^[a-z][a-z0-9-]{1,40}$.")
    port: Annotated[PortMapping, BeforeValidator(_port)] = Field(description="Port the replicas' app listens on.")
    image: Optional[Line] = Field(None, min_length=1, description="Docker image; default is durastack's CUDA image.")
    python: Optional[PythonVersion] = Field(None, description="Python version (3.9 … 3.14).")
    nvcc: Optional[bool] = Field(None, description="Use the CUDA devel image (nvcc available).")
    docker: Optional[bool] = Field(None, description="Docker-in-Docker (implies privileged).")
    privileged: Optional[bool] = Field(None, description="Run the container privileged.")
    env: Env = Field(default_factory=dict, description="Environment: [K=V, K] or {K: V}; a bare K is read from yours "
                                                       "and is secret (see `secrets`).")
    secrets: Annotated[list[Annotated[str, Field(pattern=ENV_NAME_RE.pattern)]], _bounded(MAX_ENV, "names")] = Field(
        default_factory=list, description=SECRETS_DESCRIPTION)
    commands: Annotated[list[Command], _bounded(MAX_COMMANDS, "commands")] = Field(
        default_factory=list, description="Shell commands of the implicit group.")
    entrypoint: Optional[Line] = Field(None, description="Container entrypoint.")
    registry_auth: Optional[RegistryAuth] = Field(None, description=(
        "Credentials for pulling a private `image` on cloud instances: `username` and `password`, each may be "
        "`${{ env.NAME }}` (an `env` entry's value). A new one applies to the next pulls: no replica restarts."))
    working_dir: Optional[Line] = Field(None, min_length=1, description=(
        "Working directory of the commands: relative to the replica's work dir, or absolute."))
    volumes: Annotated[list[Mount], _bounded(MAX_VOLUMES, "volumes")] = Field(default_factory=list, description=(
        "Volumes every replica mounts: `{name, path}` (or `NAME:PATH`) a network volume made beforehand (`durastack "
        "apply -f` of a `type: volume` file), `{instance_path, path}` (or `/HOST/PATH:PATH`) a directory of the "
        "instance. Cloud replicas only; a change rolls the replicas."))
    user: Optional[Annotated[str, Field(pattern=USER_RE.pattern)]] = Field(
        None, description="User the commands run as (a name or a numeric uid).")
    shell: Optional[Line] = Field(None, description="Shell that runs the commands.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Resources of the implicit group.")
    replicas: Optional[ReplicaCount] = Field(None, description="Replica count or range (no groups), or a list of groups.")
    groups: Optional[Annotated[list[ReplicaGroup], _bounded(MAX_GROUPS, "replica groups")]] = Field(None, description="Replica groups, each with its own count.")
    scaling: Optional[ScalingSpec] = Field(None, description="Autoscaling of the implicit group.")
    metrics: Optional[MetricsSpec] = Field(None, description="The implicit group's Prometheus endpoint (see groups).")
    probes: Optional[list[ProbeSpec]] = Field(None, description="Readiness probes; [] disables the model default.")
    rate_limits: Annotated[list[RateLimit], _bounded(MAX_LIST, "rate limits")] = Field(default_factory=list, description="Rate limits at the gateway.")
    model: Optional[Annotated[ModelSpec, BeforeValidator(_model)]] = Field(None, description="Model served.")
    https: Optional[Annotated[Union[bool, str], BeforeValidator(_https)]] = Field(
        None, description="Serve over HTTPS: true, false or auto (gateway setting).")
    auth: bool = Field(True, description="Require a bearer token at the gateway.")
    gateway: Optional[Annotated[Union[bool, str], BeforeValidator(_gateway)]] = Field(
        None, description="Gateway to publish on: true, false or a gateway name.")
    strip_prefix: bool = Field(True, description="Strip /services/<name> before forwarding; false: the replicas get "
                                                 "the path as the client sent it.")
    pass_authorization: bool = Field(
        False, description="With `auth`, hand the client's Authorization header (a gateway token, which opens every "
                           "service of the gateway) on to the replicas; by default the gateway drops it. Without "
                           "`auth` the client's header always passes.")
    backends: Optional[list[BackendName]] = Field(None, description="Backends to use: aws, gcp, local.")
    regions: Optional[Annotated[list[Line], _bounded(MAX_LIST, "regions")]] = Field(None, description="Regions to use.")
    availability_zones: Optional[Annotated[list[Line], _bounded(MAX_LIST, "zones")]] = Field(
        None, description="Zones to use.")
    instance_types: Optional[Annotated[list[Line], _bounded(MAX_LIST, "instance types")]] = Field(
        None, description="Instance types to use.")
    spot_policy: Optional[SpotPolicy] = Field(None, description="spot, on-demand (default) or auto.")
    reservation: Optional[Line] = Field(None, description=(
        "Capacity reservation of every group's replicas (or set it per group): " + RESERVATION_HELP))
    max_price: Optional[float] = Field(None, gt=0, description="Highest hourly price of an offer, USD.")
    retry: Optional[Annotated[RetrySpec, BeforeValidator(_retry)]] = Field(None, description=(
        "Which replica failures are retried (`on_events`) and for how long (`duration`); any other failure "
        "fails the whole service. `true`: every event, for as long as it takes; `false`: none, the first failure "
        "fails the service. Unset: every failure is retried, with a back-off after failures in a row."))
    max_duration: Annotated[Optional[Duration], BeforeValidator(duration_or_off)] = Field(None, gt=0, description=(
        "Stop the service this long after it was submitted (e.g. 8h; an apply that changes it counts from the "
        "same submission); the run ends as stopped. `off` (the default): runs until stopped."))
    stop_duration: Duration = Field(300, description="How long a stopping replica may drain in-flight requests.")
    idle_duration: Annotated[Optional[Duration], BeforeValidator(duration_or_off)] = Field(None, description=(
        "Keep a cloud replica's instance idle this long after the replica was scaled down or replaced in a rolling "
        "deployment, and start the group's next replica on it when its resources, backends, regions, zones, "
        "instance types, spot policy and max price are the same: no new VM, its image already pulled, its instance "
        "volumes kept (never across services). An idle instance bills as a running one. Never for a replica that "
        "failed or whose instance died; a stopped service terminates its idle instances. `off` or `0`: no reuse. "
        "Unset (the default): terminated at once, as before it existed (dstack's default is 5m: its fleets keep "
        "instances, durastack keeps none unless asked, so that nothing bills after a scale-down)."))
    startup_timeout: StartupTimeout = Field(DEFAULT_STARTUP_TIMEOUT, description=(
        "How long a replica may take to become ready once its commands run (loading a large model's weights "
        "included), e.g. 90m; past it the replica fails, saying what its probes saw. Its instance's boot and "
        "image pull have their own budget. A group may set its own."))
    cold_start_timeout: Duration = Field(
        300, description="How long the gateway holds a request while a scaled-to-zero service starts.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not SERVICE_NAME_RE.fullmatch(v):  # fullmatch: `$` would let a final \n through
            raise ValueError("must match ^[a-z][a-z0-9-]{1,40}$ (lowercase letters, digits, '-'; 2–41 characters)")
        return v

    @model_validator(mode="before")
    @classmethod
    def _groups_under_replicas(cls, data: Any) -> Any:
        # Seed-era shape: a list under `replicas` is the list of groups.
        if isinstance(data, dict) and isinstance(data.get("replicas"), list):
            if data.get("groups") is not None:
                raise ValueError("`replicas` (a list of groups) and `groups` are mutually exclusive")
            data = {k: v for k, v in data.items() if k != "replicas"} | {"groups": data["replicas"]}
        return data

    @field_serializer("env", when_used="json")
    def _env_json(self, env: dict[str, Optional[str]], info: FieldSerializationInfo) -> dict[str, Optional[str]]:
        return dump_env(env, self.secrets, info.context)

    @property
    def secret_env(self) -> list[str]:
        """Names of the `env` entries whose values are secret (models.secrets.is_secret)."""
        return [k for k in self.env if is_secret(k, self.secrets)]

    @model_validator(mode="after")
    def _default_group_names(self) -> "ServiceConfiguration":
        # Unnamed groups are named by position; frozen model, so set through object.__setattr__ on copies.
        if self.groups and any(g.name is None for g in self.groups):
            named = [g if g.name is not None else g.model_copy(update={"name": str(i)})
                     for i, g in enumerate(self.groups)]
            object.__setattr__(self, "groups", named)
        return self

    @property
    def replica_groups(self) -> list[ReplicaGroup]:
        """Always at least one group: the given groups, or the implicit group "0"."""
        if self.groups:
            return list(self.groups)
        return [ReplicaGroup(name="0", count=self.replicas or Range[int](min=1, max=1), scaling=self.scaling,
                             metrics=self.metrics, commands=self.commands, resources=self.resources)]

    def group(self, name: str) -> Optional[ReplicaGroup]:
        return next((g for g in self.replica_groups if g.name == name), None)

    @property
    def router_group(self) -> Optional[str]:
        """The group that runs the in-service router: the only one the gateway routes to (None: every group)."""
        return next((g.name for g in self.replica_groups if g.router is not None), None)

    def routed(self, group: str) -> bool:
        """Whether the gateway routes to replicas of ``group``: not to workers behind a router group."""
        return self.router_group in (None, group)

    def effective_probes(self) -> list[ProbeSpec]:
        """Explicit probes, or the default chat probe when a model is set."""
        if self.probes is not None or self.model is None:
            return list(self.probes or [])
        # json.dumps, not %-formatting: a name with a quote must not break (or rewrite) the body.
        body = json.dumps({"model": self.model.name, "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 1})
        return [ProbeSpec(type="http", url=f"{self.model.prefix}/chat/completions", method="post",
                          headers=[ProbeHeader(name="Content-Type", value="application/json")], body=body,
                          timeout=30)]


ProbeSpec.model_rebuild()
