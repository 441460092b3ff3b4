"""One job builder for every backend: what a group's runtime fields (``image``, ``python``, ``nvcc``,
``docker``, ``privileged``, ``user``, ``working_dir``, ``env``, the port) become.

On a cloud instance they become one ``docker run`` (``docker_run_argv``) on the instance's network, started
over SSH after boot, with the env in a mode-600 file (``--env-file``) that never travels in user data or
instance metadata. The
local backend runs the commands on this machine without containers and says at plan time, with the field
path, which of these it cannot honour (``local_limits``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from dataclasses import dataclass
from typing import Optional

from backends.local_host import Account, probe_confinement, replica_account, replica_user, user_refusal
from models.replica import JobSpec
from models.volumes import CONTAINER_JOB_DIR

# CUDA 12.4 needs an NVIDIA driver of 550 or newer: the clouds' default GPU images run R580 or newer (which also serve
# the CUDA 12.8, 12.9 and 13.0 images vLLM and SGLang ship), and most local GPU hosts have one. A job on a newer
# CUDA names its image; docker refuses one whose CUDA the driver cannot serve, and the start step fails with its words.
DEFAULT_IMAGE = "nvidia/cuda:12.4.1-runtime-ubuntu22.04"
DEFAULT_DEVEL_IMAGE = "nvidia/cuda:12.4.1-devel-ubuntu22.04"  # nvcc: true
DIND_IMAGE = "docker:27-dind"  # docker: true; its dockerd is started by the job wrapper
CONTAINER_NAME = "durastack-job"
REPLICA_LABEL = "durastack.replica"  # the submission a container runs (its replica id)
CONTAINER_DIR = CONTAINER_JOB_DIR  # where the job's files are mounted in the container (read-only)
VOLUMES_DIR = "/opt/durastack/volumes"  # where an instance mounts its network volumes, one directory each
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def python_image(version: str) -> str:
    """An image with that Python and pip (the official one: Debian, bash, pip)."""
    return f"python:{version}"


@dataclass(frozen=True)
class Runtime:
    image: str
    privileged: bool
    preamble: tuple[str, ...]  # shell lines run before the commands, in the container


def runtime_of(job: JobSpec) -> Runtime:
    """The image and flags the job runs with. An explicit image wins; ``docker: true`` is Docker-in-Docker
    (privileged, dockerd started, bash); ``nvcc`` the CUDA devel image (with ``python`` installed into it);
    ``python`` alone an image with that Python and pip; else the CUDA runtime image."""
    preamble: list[str] = []
    if job.image:
        image = job.image
    elif job.docker:
        image = DIND_IMAGE
        preamble += [
            # The dind image is Alpine: the commands are written for bash.
            "command -v bash >/dev/null 2>&1 || apk add --no-cache bash >/dev/null",
            "(dockerd-entrypoint.sh dockerd >/var/log/dockerd.log 2>&1 &)",
            "timeout 120 sh -c 'until docker info >/dev/null 2>&1; do sleep 0.5; done'",
        ]
    elif job.nvcc:
        image = DEFAULT_DEVEL_IMAGE
        if job.python:  # the devel image has no Python of a chosen version: install it, with pip, on PATH
            preamble += [
                "command -v curl >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq curl >/dev/null)",
                "curl -LsSf https://astral.sh/uv/install.sh | env UV_INSTALL_DIR=/usr/local/bin sh >/dev/null",
                f"uv venv --seed --python {shlex.quote(job.python)} /opt/durastack-python >/dev/null",
                "export PATH=/opt/durastack-python/bin:$PATH",
            ]
    elif job.python:
        image = python_image(job.python)
    else:
        image = DEFAULT_IMAGE
    return Runtime(image=image, privileged=job.docker or job.privileged, preamble=tuple(preamble))


def job_script(job: JobSpec) -> str:
    """The file the container runs with bash (``sh`` if the image has none): preamble, then the commands,
    stopping at the first failure. The commands stay in a file so no quoting of theirs can break out."""
    rt = runtime_of(job)
    lines = ["set -e", f"# durastack replica {job.replica_id}", *rt.preamble]
    lines += _multiline_env_exports()
    if job.entrypoint:  # it runs the commands, given as one script in its last argument
        script = ["\n".join(job.commands)] if job.commands else []
        return "\n".join(lines + ["exec " + shlex.join(job.runner("sh") + script)]) + "\n"
    return "\n".join(lines + list(job.commands)) + "\n"


def _multiline_env_exports() -> list[str]:
    # docker's --env-file holds one line per variable; values with newlines (keys, certificates) are files.
    return [f'for f in {CONTAINER_DIR}/env.d/*; do if [ -f "$f" ]; then export "$(basename "$f")=$(cat "$f")"; fi; done']


def env_files(job: JobSpec) -> tuple[str, dict[str, str]]:
    """(the ``--env-file`` text, {name: value} of the values with newlines, written to ``env.d/<name>``).

    Written on the instance mode 600 by root, over SSH, after boot."""
    bad = [k for k in job.env if not _ENV_NAME.match(k)]
    if bad:
        raise ValueError(f"invalid environment variable names: {', '.join(sorted(bad))}")
    single = {k: v for k, v in job.env.items() if "\n" not in v and "\r" not in v}
    multi = {k: v for k, v in job.env.items() if k not in single}
    text = "".join(f"{k}={v}\n" for k, v in sorted(single.items()))
    return text, multi


# The cgroup every container runs in: the boot script closes the metadata service to it (backends/userdata.py).
REPLICA_SLICE = "durastack.slice"


def docker_run_argv(job: JobSpec, *, gpu: bool, job_dir: str, replica_ip: str = "",
                    volumes_dir: str = VOLUMES_DIR) -> list[str]:
    """``docker run`` for the job on a cloud instance whose job files are in ``job_dir``; ``replica_ip`` is the
    instance's private address (``DURASTACK_REPLICA_IP``); its network volumes are mounted under ``volumes_dir``
    (activities/volume_mounts.py), its instance volumes' directories are made by Docker if missing.

    The container uses the instance's network (``--network=host``, as dstack does): the replicas of one service
    reach each other at their private addresses on any port (a router and its prefill/decode workers), which
    the instance's firewall admits from the service's own instances only, with SSH from the gateway. The
    gateway reaches the app through the SSH tunnel, at 127.0.0.1:<port> on the instance."""
    rt = runtime_of(job)
    argv = ["docker", "run", "-d", "--name", CONTAINER_NAME, "--restart", "no", "--ipc=host", "--network=host",
            f"--cgroup-parent={REPLICA_SLICE}", "--label", f"{REPLICA_LABEL}={job.replica_id}"]
    if gpu:
        argv += ["--gpus", "all"]
    if rt.privileged:
        argv += ["--privileged"]
    argv += ["--env-file", f"{job_dir}/env", "-e", f"PORT={job.port}"]
    if replica_ip:
        argv += ["-e", f"DURASTACK_REPLICA_IP={replica_ip}"]
    if job.user:
        argv += ["-u", job.user]
    if job.working_dir:
        argv += ["-w", job.working_dir]
    argv += ["-v", f"{job_dir}:{CONTAINER_DIR}:ro"]
    for mount in job.volumes:
        argv += ["-v", f"{volumes_dir}/{mount.name}:{mount.path}" if mount.network else
                 f"{mount.instance_path}:{mount.path}"]
    if job.shell:
        argv += ["--entrypoint", job.shell if job.shell.startswith("/") else f"/bin/{job.shell}", rt.image,
                 f"{CONTAINER_DIR}/job.sh"]
    elif job.commands or job.entrypoint:
        # The commands are written for bash, but an image may have only sh.
        argv += ["--entrypoint", "/bin/sh", rt.image, "-c",
                 f"if command -v bash >/dev/null 2>&1; then exec bash {CONTAINER_DIR}/job.sh; fi; "
                 f"exec sh {CONTAINER_DIR}/job.sh"]
    else:
        argv += [rt.image]
    return argv


# --- what the local backend cannot honour ----------------------------------------------------------

def docker_daemon() -> Optional[str]:
    """Why there is no usable Docker daemon here, or None if there is one."""
    if not shutil.which("docker"):
        return "no docker command on this machine"
    sock = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if sock.startswith("unix://") and not os.path.exists(sock[len("unix://"):]):
        return f"no Docker daemon on this machine ({sock[len('unix://'):]} does not exist)"
    return None


def local_limits(fields: dict[str, tuple[object, str]]) -> tuple[list[str], list[str]]:
    """(errors, warnings) for a group's effective runtime fields on the local backend: ``fields`` maps
    ``docker``/``privileged``/``nvcc``/``image``/``commands``/``user``/``registry_auth``/``volumes`` to (value, field
    path). Local replicas run their commands on this machine, confined, without containers."""
    errors, warnings = [], []
    value = lambda name: fields.get(name, (None, name))[0]  # noqa: E731
    path = lambda name: fields.get(name, (None, name))[1]  # noqa: E731
    if value("docker"):
        why = docker_daemon()
        errors.append(f"{path('docker')}: the local backend cannot run Docker-in-Docker "
                      f"({why or 'its replicas run confined, without containers'})")
    elif value("privileged"):
        errors.append(f"{path('privileged')}: the local backend never runs replicas privileged")
    if value("nvcc") and not shutil.which("nvcc"):
        errors.append(f"{path('nvcc')}: the local backend has no CUDA compiler (no nvcc on this machine's PATH)")
    if value("image"):
        if value("commands"):
            pulls = " (and so is `registry_auth`)" if value("registry_auth") else ""
            warnings.append(f"{path('image')}: ignored by the local backend, which runs the commands on this "
                            f"machine{pulls}")
        else:
            errors.append(f"{path('image')}: the local backend cannot run images; give the group commands")
    for i, mount in enumerate(value("volumes") or []):
        # No path of a service reaches the root processes that start a local replica: nothing is bound into it.
        if mount.network:
            errors.append(f"{path('volumes')}[{i}]: volume {mount.name} is a cloud disk, attached to cloud "
                          "instances only; the local backend has none")
        elif not mount.optional:
            errors.append(f"{path('volumes')}[{i}]: the local backend runs replicas without containers and binds "
                          f"no path of this machine into them (`optional: true` runs without {mount.instance_path} "
                          "here)")
        else:
            warnings.append(f"{path('volumes')}[{i}]: optional, not mounted by the local backend")
    # The local backend's own rule (it refuses at start too), said here, at plan time, with the field.
    refusal = user_refusal(value("user"), _replica_account())
    if refusal:
        errors.append(f"{path('user')}: {refusal}")
    return errors, warnings


def _replica_account() -> Optional[Account]:
    """Who confined replicas run as here (None: they are not confined); one not yet made has no uid yet."""
    if not probe_confinement()[0]:
        return None
    return replica_account(create=False) or Account(replica_user(), -1, -1)


def group_runtime_fields(config, index: int) -> dict[str, tuple[object, str]]:
    """A ``ServiceConfiguration`` group's effective runtime fields with the path of the level that set each."""
    group = config.replica_groups[index]
    explicit = bool(config.groups)
    out: dict[str, tuple[object, str]] = {}
    for name in ("docker", "privileged", "nvcc", "image", "python"):
        own = getattr(group, name) if explicit else None
        out[name] = (own, f"groups[{index}].{name}") if own is not None else (getattr(config, name), name)
    out["commands"] = (list(group.commands), f"groups[{index}].commands" if explicit else "commands")
    out["user"] = (config.user, "user")
    out["registry_auth"] = (config.registry_auth, "registry_auth")
    out["volumes"] = (list(config.volumes), "volumes")
    return out


__all__ = ["CONTAINER_NAME", "DEFAULT_DEVEL_IMAGE", "DEFAULT_IMAGE", "DIND_IMAGE", "Runtime", "docker_run_argv",
           "env_files", "group_runtime_fields", "job_script", "local_limits", "python_image", "runtime_of"]
