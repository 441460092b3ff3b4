"""Where the embedded stack lives and listens; every value can be set by environment variable."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, Field

TASK_QUEUE = "durastack"
NAMESPACE = "default"
# Custom search attributes registered on the Temporal server, so the Web UI list filters by them.
SEARCH_ATTRIBUTES = ("DurastackService", "DurastackGroup", "DurastackBackend", "DurastackStatus")


class Settings(BaseModel):
    home: Path = Field(description="State directory (DURASTACK_HOME, default ~/.durastack).")
    temporal_address: Optional[str] = Field(
        None, description="An external Temporal server (DURASTACK_TEMPORAL_ADDRESS); none is started then.")
    temporal_port: int = Field(7233, description="gRPC port of the embedded Temporal dev server.")
    ui_port: int = Field(8233, description="Web UI port of the embedded Temporal dev server.")
    gateway_port: int = Field(8000, description="Port the gateway (nginx) listens on for service traffic.")
    gateway_control_port: int = Field(8001, description="Port of the gateway's control API (127.0.0.1).")
    namespace: str = Field(NAMESPACE, description="Temporal namespace.")
    task_queue: str = Field(TASK_QUEUE, description="Temporal task queue of the worker.")

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
            "namespace": env.get("DURASTACK_NAMESPACE", NAMESPACE),
            "task_queue": env.get("DURASTACK_TASK_QUEUE", TASK_QUEUE),
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
        return f"http://127.0.0.1:{self.gateway_control_port}"

    def to_env(self) -> dict[str, str]:
        """The same settings as environment variables, for the processes the server starts."""
        env = {
            "DURASTACK_HOME": str(self.home),
            "DURASTACK_TEMPORAL_PORT": str(self.temporal_port),
            "DURASTACK_UI_PORT": str(self.ui_port),
            "DURASTACK_GATEWAY_PORT": str(self.gateway_port),
            "DURASTACK_GATEWAY_CONTROL_PORT": str(self.gateway_control_port),
            "DURASTACK_NAMESPACE": self.namespace,
            "DURASTACK_TASK_QUEUE": self.task_queue,
        }
        env["DURASTACK_TEMPORAL_ADDRESS"] = self.address
        return env


def load_or_create_token(home: Path) -> str:
    """The token the gateway accepts, created on first use and kept (mode 600) in the home."""
    import secrets

    path = home / "token"
    if path.exists():
        token = path.read_text().strip()
        if token:
            return token
    home.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token
