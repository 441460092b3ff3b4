"""Where the embedded stack lives and listens; every value can be set by environment variable."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, Field, SecretStr

TASK_QUEUE = "durastack"
NAMESPACE = "default"
# Custom search attributes registered on the Temporal server, so the Web UI list filters by them.
SEARCH_ATTRIBUTES = ("DurastackService", "DurastackGroup", "DurastackBackend", "DurastackStatus")


TEMPORAL_TLS_ENV = {  # Settings field -> environment variable
    "temporal_tls": "DURASTACK_TEMPORAL_TLS",
    "temporal_tls_ca": "DURASTACK_TEMPORAL_TLS_CA",
    "temporal_tls_cert": "DURASTACK_TEMPORAL_TLS_CERT",
    "temporal_tls_key": "DURASTACK_TEMPORAL_TLS_KEY",
    "temporal_tls_server_name": "DURASTACK_TEMPORAL_TLS_SERVER_NAME",
    "temporal_api_key": "DURASTACK_TEMPORAL_API_KEY",
}


class Settings(BaseModel):
    home: Path = Field(description="State directory (DURASTACK_HOME, default ~/.durastack).")
    temporal_address: Optional[str] = Field(
        None, description="An external Temporal server (DURASTACK_TEMPORAL_ADDRESS); none is started then.")
    temporal_port: int = Field(7233, description="gRPC port of the embedded Temporal dev server.")
    ui_port: int = Field(8233, description="Web UI port of the embedded Temporal dev server.")
    gateway_port: int = Field(8000, description="Port the gateway (nginx) listens on for service traffic.")
    gateway_control_port: int = Field(8001, description="Port of the gateway's control API (127.0.0.1); also serves /metrics.")
    worker_metrics_port: int = Field(9464, description="Port of the worker's Prometheus endpoint, /metrics (127.0.0.1); 0: none.")
    codec_port: int = Field(8234, ge=0, le=65535, description=(
        "Port of the Web UI's codec endpoint on 127.0.0.1 (`durastack codec-server`; `durastack server` runs it); "
        "0: none."))
    namespace: str = Field(NAMESPACE, description="Temporal namespace.")
    task_queue: str = Field(TASK_QUEUE, description="Temporal task queue of the worker.")
    bind_host: str = Field("127.0.0.1", description=(
        "Address the gateway (nginx and control API) and the worker's metrics listen on (DURASTACK_BIND_HOST); "
        "anything but loopback needs DURASTACK_GATEWAY_CONTROL_TOKEN."))
    local_replicas: bool = Field(True, description=(
        "Run replicas on the worker's own machine when a service allows `local` (DURASTACK_LOCAL_REPLICAS=on/off); "
        "off in a cluster, where the gateway cannot reach a worker's container."))
    gateway_control: Optional[str] = Field(None, description=(
        "URL of the gateway's control API when it runs elsewhere (DURASTACK_GATEWAY_CONTROL_URL, e.g. "
        "http://gateway:8001); unset: 127.0.0.1 and DURASTACK_GATEWAY_CONTROL_PORT."))
    gateway_control_token: Optional[SecretStr] = Field(None, description=(
        "Bearer token the gateway's control API requires (DURASTACK_GATEWAY_CONTROL_TOKEN); unset: the one the "
        "gateway makes in <home>/gateway/control.token (mode 600), which only a loopback gateway may use."))
    # How clients reach an external Temporal server (Temporal Cloud, a TLS cluster); connect.connection uses them.
    temporal_tls: Optional[bool] = Field(None, description=(
        "TLS to Temporal (DURASTACK_TEMPORAL_TLS=on/off); unset: on when a CA, a client certificate or an API key "
        "is set."))
    temporal_tls_ca: Optional[Path] = Field(None, description=(
        "PEM file of the CA that signed the server's certificate (DURASTACK_TEMPORAL_TLS_CA); unset: system roots."))
    temporal_tls_cert: Optional[Path] = Field(None, description=(
        "PEM client certificate for mTLS (DURASTACK_TEMPORAL_TLS_CERT); needs DURASTACK_TEMPORAL_TLS_KEY."))
    temporal_tls_key: Optional[Path] = Field(None, description=(
        "PEM private key of the client certificate (DURASTACK_TEMPORAL_TLS_KEY)."))
    temporal_tls_server_name: Optional[str] = Field(None, description=(
        "Name the server's certificate is checked against, and the SNI (DURASTACK_TEMPORAL_TLS_SERVER_NAME); "
        "unset: the host of the address."))
    temporal_api_key: Optional[SecretStr] = Field(None, description=(
        "API key sent as `Authorization: Bearer` (DURASTACK_TEMPORAL_API_KEY, Temporal Cloud); implies TLS."))
    worker_versioning: bool = Field(True, description=(
        "Worker Versioning (DURASTACK_WORKER_VERSIONING=on/off): the main workers are a Worker Deployment named "
        "after the task queue, and the newest build takes every workflow task; off for a Temporal server without "
        "Worker Deployments."))
    build_id: Optional[str] = Field(None, max_length=255, description=(
        "The workers' build in their Worker Deployment (DURASTACK_BUILD_ID, e.g. a git commit); unset: a hash of "
        "durastack's code, so any change of it is a new build."))

    @classmethod
    def from_env(cls, environ: Optional[dict] = None, **overrides) -> "Settings":
        env = os.environ if environ is None else environ
        values = {
            "home": Path(env.get("DURASTACK_HOME") or Path.home() / ".durastack").expanduser(),
            "temporal_address": env.get("DURASTACK_TEMPORAL_ADDRESS") or None,
            "temporal_port": env.get("DURASTACK_TEMPORAL_PORT", 7233),
            "ui_port": env.get("DURASTACK_UI_PORT", 8233),
            "gateway_port": env.get("DURASTACK_GATEWAY_PORT", 8000),
            "gateway_control_port": env.get("DURASTACK_GATEWAY_CONTROL_PORT", 8001),
            "worker_metrics_port": env.get("DURASTACK_WORKER_METRICS_PORT", 9464),
            "codec_port": env.get("DURASTACK_CODEC_PORT", 8234),
            "namespace": env.get("DURASTACK_NAMESPACE", NAMESPACE),
            "task_queue": env.get("DURASTACK_TASK_QUEUE", TASK_QUEUE),
            "bind_host": env.get("DURASTACK_BIND_HOST") or "127.0.0.1",
            "local_replicas": env.get("DURASTACK_LOCAL_REPLICAS") or True,
            "gateway_control": env.get("DURASTACK_GATEWAY_CONTROL_URL") or None,
            "gateway_control_token": env.get("DURASTACK_GATEWAY_CONTROL_TOKEN") or None,
            "worker_versioning": env.get("DURASTACK_WORKER_VERSIONING") or True,
            "build_id": env.get("DURASTACK_BUILD_ID") or None,
            **{field: env.get(var) or None for field, var in TEMPORAL_TLS_ENV.items()},
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(values)

    @property
    def address(self) -> str:
        return self.temporal_address or f"127.0.0.1:{self.temporal_port}"

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.ui_port}"

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def gateway_control_url(self) -> str:
        return self.gateway_control or f"http://127.0.0.1:{self.gateway_control_port}"

    @property
    def control_token(self) -> Optional[str]:
        """DURASTACK_GATEWAY_CONTROL_TOKEN, else the token the gateway of this home made on its first start."""
        if self.gateway_control_token:
            return self.gateway_control_token.get_secret_value()
        from models.gateway import read_control_token

        return read_control_token(self.home / "gateway")

    @property
    def gateway_metrics_url(self) -> str:
        return f"{self.gateway_control_url}/metrics"

    @property
    def worker_metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.worker_metrics_port}/metrics"

    @property
    def codec_url(self) -> str:
        return f"http://127.0.0.1:{self.codec_port}"

    def to_env(self) -> dict[str, str]:
        """The same settings as environment variables, for the processes the server starts."""
        env = {
            "DURASTACK_HOME": str(self.home),
            "DURASTACK_TEMPORAL_PORT": str(self.temporal_port),
            "DURASTACK_UI_PORT": str(self.ui_port),
            "DURASTACK_GATEWAY_PORT": str(self.gateway_port),
            "DURASTACK_GATEWAY_CONTROL_PORT": str(self.gateway_control_port),
            "DURASTACK_WORKER_METRICS_PORT": str(self.worker_metrics_port),
            "DURASTACK_CODEC_PORT": str(self.codec_port),
            "DURASTACK_NAMESPACE": self.namespace,
            "DURASTACK_TASK_QUEUE": self.task_queue,
            "DURASTACK_BIND_HOST": self.bind_host,
            "DURASTACK_LOCAL_REPLICAS": "on" if self.local_replicas else "off",
            "DURASTACK_WORKER_VERSIONING": "on" if self.worker_versioning else "off",
        }
        if self.build_id:
            env["DURASTACK_BUILD_ID"] = self.build_id
        if self.gateway_control:
            env["DURASTACK_GATEWAY_CONTROL_URL"] = self.gateway_control
        if self.gateway_control_token:  # only a given one: the home's file stays out of every child's environment
            env["DURASTACK_GATEWAY_CONTROL_TOKEN"] = self.gateway_control_token.get_secret_value()
        if self.temporal_address:  # else the embedded one, whose door the children open with the home's key
            env["DURASTACK_TEMPORAL_ADDRESS"] = self.temporal_address
        for field, var in TEMPORAL_TLS_ENV.items():
            value = getattr(self, field)
            if value is not None:
                value = value.get_secret_value() if isinstance(value, SecretStr) else value
                env[var] = ("on" if value else "off") if isinstance(value, bool) else str(value)
        return env

