"""What a compute backend is asked to run for one replica, and what it hands back.

These values travel through Temporal history (activity arguments and results), so they are plain,
JSON-serialisable pydantic models with no behaviour beyond small derived properties.
"""

from __future__ import annotations

import shlex
from typing import Annotated, Literal, Optional

from pydantic import BeforeValidator, Field, FieldSerializationInfo, field_serializer

from models.common import Model
from models.registry import RegistryAuth
from models.secrets import dump_env, unmark_env
from models.volumes import VolumeMount

# Service and group names become path components of the replica's work dir, so keep them tame.
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class JobSpec(Model):
    service: str = Field(pattern=_NAME, description="Service (run) name.")
    group: str = Field(pattern=_NAME, description="Replica group name (or its index as a string).")
    replica_num: int = Field(ge=0, description="Replica number, unique within the service run.")
    submission_num: int = Field(ge=0, description="Attempt number of this replica; a retry or redeploy gets a new one.")
    commands: list[str] = Field(default_factory=list, description="Shell commands run in order, stopping at the first failure.")
    env: Annotated[dict[str, str], BeforeValidator(unmark_env)] = Field(
        default_factory=dict, description="Environment variables for the commands.")
    secrets: list[str] = Field(default_factory=list, description=(
        "Names of `env` entries that are secret besides those whose names look secret (models.secrets)."))
    port: int = Field(ge=1, le=65535, description="The port the app listens on inside the replica.")
    python: Optional[str] = Field(None, pattern=r"^3\.\d+$", description="Python version wanted on PATH, e.g. '3.12'.")
    image: Optional[str] = Field(None, description="Container image; backends without containers refuse jobs that need one.")
    working_dir: Optional[str] = Field(None, description=(
        "Directory the commands run in: relative to the replica's work dir, or absolute (backends may refuse "
        "one outside it)."))
    user: Optional[str] = Field(None, description=(
        "User (name or uid) the commands run as; a backend that cannot run them as that user refuses the job."))
    shell: Optional[str] = Field(None, description="Shell that runs the commands: sh, bash or an absolute path "
                                                   "(None: the backend's, sh locally, bash in a container that has it).")
    entrypoint: Optional[str] = Field(None, description="Runs instead of the shell, given the commands (one script) "
                                                        "as its last argument; alone with an image, instead of its own.")
    registry_auth: Optional[RegistryAuth] = Field(None, description=(
        "Credentials for pulling `image`, with the `env` values they name filled in (secret)."))
    volumes: list[VolumeMount] = Field(default_factory=list, description=(
        "What the container mounts: network volumes (attached to its instance and mounted there first) and "
        "directories of the instance (the service's `volumes`)."))
    nvcc: bool = Field(False, description="Run in the CUDA devel image (nvcc available).")
    docker: bool = Field(False, description="Docker-in-Docker: privileged, dockerd started, commands in bash.")
    privileged: bool = Field(False, description="Run the container privileged (always with docker).")

    @field_serializer("env", when_used="json")
    def _env_json(self, env: dict[str, str], info: FieldSerializationInfo) -> dict[str, str]:
        return dump_env(env, self.secrets, info.context)  # type: ignore[return-value]

    def runner(self, default_shell: str) -> list[str]:
        """The argv the commands (one script) are given to as their last argument: the entrypoint's words, else
        the shell with ``-e -c`` (stop at the first failure)."""
        if self.entrypoint:
            return shlex.split(self.entrypoint)
        return [self.shell or default_shell, "-e", "-c"]

    @property
    def replica_id(self) -> str:
        return replica_id(self.service, self.group, self.replica_num, self.submission_num)


def replica_id(service: str, group: str, replica_num: int, submission_num: int) -> str:
    """A replica submission's id: its gateway registration, its work dir, its cloud tags."""
    return f"{service}/{group}/r{replica_num}-s{submission_num}"


class LocalInstance(Model):
    kind: Literal["local"] = "local"
    replica_id: str = Field(description="JobSpec.replica_id of the job this instance runs.")
    pid: int = Field(description="PID of the process-tree leader on the host.")
    start_time: int = Field(description="Leader's start time (clock ticks after boot, /proc/<pid>/stat field 22), "
                                        "so that a reused PID is never mistaken for ours.")
    work_dir: str = Field(description="Absolute path of the replica's work dir (cwd of the commands).")
    address: str = Field(description="Where the app is reached from the host: 'unix:/abs/replica.sock' when "
                                     "isolated, '127.0.0.1:<port>' otherwise.")
    isolated: bool = Field(description="Whether the replica runs in its own network, mount and PID namespaces.")
    log_path: str = Field(description="File holding the replica's stdout and stderr.")
    ip: str = Field("", description="The address other replicas of the same service reach it at (its private "
                                    "network's, or 127.0.0.1 when replicas share the host's network); empty when "
                                    "other replicas cannot reach it.")


class InstanceStatus(Model):
    state: Literal["running", "exited", "gone"] = Field(
        description="running: the leader lives; exited: the commands ended; gone: nothing is known of it.")
    exit_code: Optional[int] = Field(None, description="Exit code of the commands when exited (128+N if killed by signal N).")
    message: str = Field("", description="Human-readable detail.")


__all__ = ["JobSpec", "LocalInstance", "InstanceStatus"]
