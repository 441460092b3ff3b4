"""The service configuration: one YAML file, several replica groups (spec section 1).

Field-level rules live on the fields; rules that span fields or levels live in
``models.validation`` so that each error can name the exact path it is about.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, BeforeValidator, Field, FieldSerializationInfo, field_serializer,
                      field_validator, model_validator)

from models.common import Duration, IntRange, Model, Range
from models.secrets import SECRETS_DESCRIPTION, dump_env, is_secret, unmark

SERVICE_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{1,40}$")
GROUP_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PYTHON_VERSIONS = ("3.9", "3.10", "3.11", "3.12", "3.13", "3.14")
SCALING_WINDOWS = (30, 60, 300)
MAX_PROBES = 10
MAX_PROBE_TIMEOUT = 300

SpotPolicy = Literal["spot", "on-demand", "auto"]
Backend = Literal["aws", "gcp", "local"]

from models.resources import ResourcesSpec  # noqa: E402  (after the constants it does not need)


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
        for key, val in value.items():
            if not isinstance(key, str) or not ENV_NAME_RE.match(key):
                raise ValueError(f"invalid variable name {key!r}")
            if isinstance(val, bool):
                raise ValueError(f"{key}: write booleans as strings, e.g. \"true\"")
            if isinstance(val, (int, float)):
                value = {**value, key: str(val)}
            elif val is not None and not isinstance(val, str):
                raise ValueError(f"{key}: expected a string value, got {type(val).__name__}")
            elif val is not None:
                try:
                    value = {**value, key: unmark(val)}  # a secret read back from a payload (models.secrets)
                except ValueError as e:
                    raise ValueError(f"{key}: {e}") from None
        return value
    raise ValueError("expected a list of 'NAME=value' / 'NAME' items or a mapping")


Env = Annotated[dict[str, Optional[str]], BeforeValidator(_env)]


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


class ScalingSpec(Model):
    metric: Literal["rps"] = Field(description="The scaling metric; only `rps` (requests per second).")
    target: float = Field(gt=0, description="Target requests per second per replica.")
    window: Duration = Field(60, description="Window over which the rate is measured: 30s, 60s or 300s.")
    scale_up_delay: Duration = Field(300, description="Time since this group's last scaling before scaling up.")
    scale_down_delay: Duration = Field(600, description="Time since this group's last scaling before scaling down.")

    @field_validator("window")
    @classmethod
    def _window(cls, v: int) -> int:
        if v not in SCALING_WINDOWS:
            raise ValueError("window must be one of: `30s`, `60s`, `300s`")
        return v


class ProbeSpec(Model):
    type: Literal["http"] = Field(description="Probe type; only `http`.")
    url: str = Field("/", max_length=2048, pattern=r"^/[\x21-\x7e]*$", description="Path to request, starting with /.")
    method: Literal["get", "post", "put", "delete", "patch", "head"] = Field("get", description="HTTP method.")
    headers: list["ProbeHeader"] = Field(default_factory=list, max_length=16, description="Request headers.")
    body: Optional[str] = Field(None, min_length=1, max_length=2048, description="Request body (not with get/head).")
    timeout: Duration = Field(10, description="Timeout of one probe request (1s..300s).")
    interval: Duration = Field(15, description="Time between the end of one probe and the next (≥ 1s).")
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
    name: str = Field(min_length=1, max_length=256, description="Header name.")
    value: str = Field(min_length=1, max_length=2048, description="Header value.")


class RateLimitKey(Model):
    type: Literal["ip_address", "header"] = Field("ip_address", description="What a limit is counted per.")
    header: Optional[str] = Field(None, max_length=500, pattern=r"^[a-zA-Z0-9_-]+$", description="Header name.")


class RateLimit(Model):
    prefix: str = Field("/", max_length=4094, pattern=r"^/[^\s{}\\]*$", description="Path prefix the limit covers.")
    key: RateLimitKey = Field(default_factory=RateLimitKey, description="What requests are counted per.")
    rps: float = Field(ge=1 / 60, description="Allowed requests per second.")
    burst: int = Field(0, ge=0, description="Requests allowed above the rate at once.")


def _model(value: Any) -> Any:
    return {"name": value} if isinstance(value, str) else value


class ModelSpec(Model):
    type: Literal["chat"] = Field("chat", description="Model type.")
    name: str = Field(min_length=1, description="Model name as served, e.g. meta-llama/Llama-3.2-3B-Instruct.")
    format: Literal["openai"] = Field("openai", description="API format.")
    prefix: str = Field("/v1", pattern=r"^/", description="Path prefix of the OpenAI-compatible API.")


class RouterSpec(Model):
    type: Literal["sglang", "dynamo"] = Field(description="In-service router this group runs.")


class RetrySpec(Model):
    on_events: list[Literal["no-capacity", "interruption", "error"]] = Field(
        default_factory=lambda: ["no-capacity", "interruption", "error"], description="Events that trigger a retry.")
    duration: Optional[Duration] = Field(None, description="How long to keep retrying.")


def _retry(value: Any) -> Any:
    if value is True:
        return {}
    if value is False:
        return None
    return value


def _replica_count(value: Range[int]) -> Range[int]:
    # V1: a count needs a maximum; a missing minimum is 0.
    if value.max is None:
        raise ValueError("the maximum number of replicas is required (e.g. 0..4)")
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


# Fields a group shares with the service level and may override (spec 1.4).
IMAGE_FIELDS = ("image", "python", "nvcc", "docker", "privileged")


class ReplicaGroup(Model):
    name: Optional[str] = Field(None, description="Group name; defaults to the group's position (\"0\", \"1\", …).")
    count: ReplicaCount = Field(description="Replica count or range, e.g. 2 or 0..4 (also spelled `replicas`).")
    scaling: Optional[ScalingSpec] = Field(None, description="Autoscaling of this group; needed for a range.")
    commands: list[str] = Field(default_factory=list, description="Shell commands, run in order.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Resources of each replica.")
    image: Optional[str] = Field(None, min_length=1, description="Docker image of this group.")
    python: Optional[PythonVersion] = Field(None, description="Python version of this group.")
    nvcc: Optional[bool] = Field(None, description="Use the CUDA devel image (nvcc available).")
    docker: Optional[bool] = Field(None, description="Docker-in-Docker (implies privileged).")
    privileged: Optional[bool] = Field(None, description="Run the container privileged.")
    spot_policy: Optional[SpotPolicy] = Field(None, description="spot, on-demand or auto for this group.")
    reservation: Optional[str] = Field(None, description="Capacity reservation for this group.")
    router: Optional[RouterSpec] = Field(None, description="This group runs the in-service router.")

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
    image: Optional[str] = Field(None, min_length=1, description="Docker image; default is durastack's CUDA image.")
    python: Optional[PythonVersion] = Field(None, description="Python version (3.9 … 3.14).")
    nvcc: Optional[bool] = Field(None, description="Use the CUDA devel image (nvcc available).")
    docker: Optional[bool] = Field(None, description="Docker-in-Docker (implies privileged).")
    privileged: Optional[bool] = Field(None, description="Run the container privileged.")
    env: Env = Field(default_factory=dict, description="Environment: [K=V, K] or {K: V}; a bare K is read from yours "
                                                       "and is secret (see `secrets`).")
    secrets: list[Annotated[str, Field(pattern=ENV_NAME_RE.pattern)]] = Field(
        default_factory=list, description=SECRETS_DESCRIPTION)
    commands: list[str] = Field(default_factory=list, description="Shell commands of the implicit group.")
    entrypoint: Optional[str] = Field(None, description="Container entrypoint.")
    working_dir: Optional[str] = Field(None, description="Working directory of the commands.")
    user: Optional[str] = Field(None, description="User the commands run as.")
    shell: Optional[str] = Field(None, description="Shell that runs the commands.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Resources of the implicit group.")
    replicas: Optional[ReplicaCount] = Field(None, description="Replica count or range (no groups), or a list of groups.")
    groups: Optional[list[ReplicaGroup]] = Field(None, description="Replica groups, each with its own count.")
    scaling: Optional[ScalingSpec] = Field(None, description="Autoscaling of the implicit group.")
    probes: Optional[list[ProbeSpec]] = Field(None, description="Readiness probes; [] disables the model default.")
    rate_limits: list[RateLimit] = Field(default_factory=list, description="Rate limits at the gateway.")
    model: Optional[Annotated[ModelSpec, BeforeValidator(_model)]] = Field(None, description="Model served.")
    https: Optional[Annotated[Union[bool, str], BeforeValidator(_https)]] = Field(
        None, description="Serve over HTTPS: true, false or auto (gateway setting).")
    auth: bool = Field(True, description="Require a bearer token at the gateway.")
    gateway: Optional[Annotated[Union[bool, str], BeforeValidator(_gateway)]] = Field(
        None, description="Gateway to publish on: true, false or a gateway name.")
    strip_prefix: bool = Field(True, description="Strip /services/<name> before forwarding.")
    backends: Optional[list[Backend]] = Field(None, description="Backends to use: aws, gcp, local.")
    regions: Optional[list[str]] = Field(None, description="Regions to use.")
    availability_zones: Optional[list[str]] = Field(None, description="Zones to use.")
    instance_types: Optional[list[str]] = Field(None, description="Instance types to use.")
    spot_policy: Optional[SpotPolicy] = Field(None, description="spot, on-demand (default) or auto.")
    reservation: Optional[str] = Field(None, description="Capacity reservation.")
    max_price: Optional[float] = Field(None, gt=0, description="Highest hourly price of an offer, USD.")
    retry: Optional[Annotated[RetrySpec, BeforeValidator(_retry)]] = Field(None, description="Retry policy.")
    max_duration: Optional[Duration] = Field(None, description="Stop the service after this long.")
    stop_duration: Duration = Field(300, description="How long a stopping replica may drain in-flight requests.")
    cold_start_timeout: Duration = Field(
        300, description="How long the gateway holds a request while a scaled-to-zero service starts.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not SERVICE_NAME_RE.match(v):
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
                             commands=self.commands, resources=self.resources)]

    def group(self, name: str) -> Optional[ReplicaGroup]:
        return next((g for g in self.replica_groups if g.name == name), None)

    def effective_probes(self) -> list[ProbeSpec]:
        """Explicit probes, or the default chat probe when a model is set (spec 1.7)."""
        if self.probes is not None or self.model is None:
            return list(self.probes or [])
        body = ('{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
                % self.model.name)
        return [ProbeSpec(type="http", url=f"{self.model.prefix}/chat/completions", method="post",
                          headers=[ProbeHeader(name="Content-Type", value="application/json")], body=body,
                          timeout=30)]


ProbeSpec.model_rebuild()
