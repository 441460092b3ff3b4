"""The SSH data path to cloud replicas (asyncssh): the job's start, its liveness, exec and logs, and the gateway's
tunnel — the only way into an instance, whose firewall admits SSH from the gateway and nothing else.

* ``SSHTarget``: an instance's address and the host key durastack made for it (backends.ssh_keys), so every
  connection, the first included, verifies the host; a host presenting another key is refused (and, while an
  instance boots, simply not ready yet).
* ``start_job``: uploads the job's files (commands, env as a mode-600 ``--env-file``) and runs its ``docker run``.
* ``container_state``: the container's state, polled by the monitor over the same connection.
* ``Tunnel``: a Unix socket under ``$DURASTACK_HOME/tunnels`` forwarded to the container's port on the instance's
  loopback; nginx's upstream is ``unix:<socket>`` as for a local replica. A lost connection is reconnected with
  back-off; ``on_down``/``on_up`` unroute and route the replica meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import shlex
import socket
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Optional

import asyncssh

from backends.runtime import CONTAINER_NAME, REPLICA_LABEL, runtime_of
from backends.userdata import job_upload, start_command
from models.registry import RegistryAuth, docker_config
from models.replica import JobSpec

log = logging.getLogger("durastack.ssh")
CONNECT_TIMEOUT = 10.0
KEEPALIVE_SECONDS = 2.0  # a dead peer is noticed within KEEPALIVE_SECONDS * KEEPALIVE_MAX
KEEPALIVE_MAX = 3
# AES-GCM first (the CPU's AES instructions, one AEAD call per packet); asyncssh's first choice, chacha20-poly1305,
# builds four cipher contexts per packet in Python: ~1.8x the client CPU per request and per byte (bench/tunnel.py).
# The rest of asyncssh's list follows, so a host without GCM still connects.
ENCRYPTION_ALGS = "^aes128-gcm@openssh.com,aes256-gcm@openssh.com"
REMOTE_DIR = '"${DURASTACK_DIR:-/opt/durastack}"'

# How a connection reaches the instance: by default a TCP connection to its address; tests pass one that
# connects inside their simulated VPC.
SocketFactory = Callable[[str, int], Awaitable[socket.socket]]


CLONE_NEWNET = 0x40000000
NETNS_ENV = "DURASTACK_SSH_NETNS"


def netns_socket_factory(netns: str) -> SocketFactory:
    """Connections made inside the named network namespace (``ip netns``): for a control plane whose instances
    are reached through a namespace of their own (a VPN's), and for the tests' simulated VPC."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)

    def connect(host: str, port: int) -> socket.socket:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {netns}")
            try:
                return socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
            finally:
                if libc.setns(own, CLONE_NEWNET) != 0:  # a pool thread must never stay in the namespace
                    raise OSError(ctypes.get_errno(), "setns back")
        finally:
            os.close(own)
            os.close(target)

    async def factory(host: str, port: int) -> socket.socket:
        sock = await asyncio.to_thread(connect, host, port)
        sock.setblocking(False)
        return sock

    return factory


def socket_factory_from_env(environ=os.environ) -> Optional[SocketFactory]:
    netns = environ.get(NETNS_ENV)
    return netns_socket_factory(netns) if netns else None


class NotReady(Exception):
    """The instance does not answer SSH as durastack set it up (yet): not booted, another host key, no ready file."""


@dataclass(frozen=True)
class SSHTarget:
    host: str
    host_key: str  # ``ssh-ed25519 AAAA…``, derived from the instance's provisioning key
    port: int = 22
    username: str = "root"
    boot_key: Optional[str] = None  # also trusted: the key its boot data carries, until durastack replaces it


def ssh_target(keys, host: str, provisioning_key: str, after_boot: bool, booting: bool = False) -> SSHTarget:
    """An instance's sshd, pinned to the host key it serves (``backends.ssh_keys.SSHKeys``): the one made after boot
    for an instance that gets one (``CloudInstance.host_key_after_boot``), with its boot key too while ``booting``;
    else its boot key."""
    boot = keys.host_key(provisioning_key).public_openssh
    if not after_boot:
        return SSHTarget(host, boot)
    return SSHTarget(host, keys.host_key(provisioning_key, after_boot=True).public_openssh,
                     boot_key=boot if booting else None)


@dataclass
class SSHClient:
    """Connections to instances with the installation's key, each pinned to the instance's host key."""

    client_key: asyncssh.SSHKey
    socket_factory: Optional[SocketFactory] = None
    connect_timeout: float = CONNECT_TIMEOUT

    @classmethod
    def from_keys(cls, keys, socket_factory: Optional[SocketFactory] = None) -> "SSHClient":
        """From ``backends.ssh_keys.SSHKeys``; the socket factory defaults to ``$DURASTACK_SSH_NETNS``'s."""
        return cls(asyncssh.import_private_key(keys.client_key_path.read_bytes()),
                   socket_factory or socket_factory_from_env())

    async def connect(self, target: SSHTarget) -> asyncssh.SSHClientConnection:
        trusted = [asyncssh.import_public_key(k) for k in (target.host_key, target.boot_key) if k]
        options = dict(username=target.username, client_keys=[self.client_key], known_hosts=(trusted, [], []),
                       server_host_key_algs=sorted({k.algorithm.decode() for k in trusted}),
                       encryption_algs=ENCRYPTION_ALGS,
                       agent_path=None, config=[],
                       keepalive_interval=KEEPALIVE_SECONDS, keepalive_count_max=KEEPALIVE_MAX,
                       connect_timeout=self.connect_timeout)
        try:
            if self.socket_factory is not None:
                sock = await asyncio.wait_for(self.socket_factory(target.host, target.port), self.connect_timeout)
                return await asyncssh.connect(sock=sock, host=target.host, **options)
            return await asyncssh.connect(target.host, target.port, **options)
        except asyncssh.HostKeyNotVerifiable as e:
            # Before the boot script has installed durastack's host key, sshd presents the image's own.
            raise NotReady(f"{target.host}: host key not (yet) the one durastack made: {e}") from e
        except (OSError, asyncio.TimeoutError, asyncssh.Error) as e:
            raise NotReady(f"{target.host}:{target.port}: {e or type(e).__name__}") from e


async def run(conn: asyncssh.SSHClientConnection, command: str, *, input: Optional[str] = None,
              timeout: float = 60.0) -> tuple[int, str, str]:
    result = await asyncio.wait_for(conn.run(command, input=input, check=False), timeout)
    return int(result.exit_status if result.exit_status is not None else 255), str(result.stdout or ""), \
        str(result.stderr or "")


# The instance's sshd serves the host key durastack made after boot in place of the one its boot data carries (user
# data and metadata are kept by the cloud, readable by whoever may describe the instance): that one then opens
# nothing. The marker keeps a boot script that runs again (GCP, at every boot) from putting the old key back.
REPLACE_HOST_KEY = ('set -e; umask 077; K="${DURASTACK_ETC:-/etc}/ssh/durastack_host_ed25519_key"; '
                    'cat >"$K.new"; mv "$K.new" "$K"; printf \'%s\\n\' "$PUBLIC" >"$K.pub"; '
                    f'touch {REMOTE_DIR}/host_key_after_boot; '
                    'systemctl reload ssh 2>/dev/null || systemctl reload sshd')


async def replace_host_key(conn: asyncssh.SSHClientConnection, private_openssh: str, public_openssh: str) -> None:
    """Have the instance's sshd serve ``private_openssh`` from its next connection on (this one goes on)."""
    status, _, err = await run(conn, f"PUBLIC={shlex.quote(public_openssh)}; {REPLACE_HOST_KEY}",
                               input=private_openssh)
    if status != 0:
        raise RuntimeError(f"replacing the host key failed ({status}): {err.strip()[:300]}")


async def wait_booted(conn: asyncssh.SSHClientConnection) -> bool:
    """Whether the boot script has finished (Docker installed, GPU runtime configured)."""
    status, _, _ = await run(conn, f"test -f {REMOTE_DIR}/ready", timeout=30.0)
    return status == 0


async def booted_driver(conn: asyncssh.SSHClientConnection) -> str:
    """The NVIDIA driver (and newest CUDA) the boot found, as the boot script wrote it; '' without a GPU, or when
    it cannot be read (it is told, never needed)."""
    try:
        status, out, _ = await run(conn, f"cat {REMOTE_DIR}/nvidia-driver", timeout=30.0)
    except (OSError, asyncio.TimeoutError, asyncssh.Error):
        return ""
    return out.strip() if status == 0 else ""


async def start_job(conn: asyncssh.SSHClientConnection, job: JobSpec, *, gpu: bool, replica_ip: str = "",
                    said: Callable[[str], None] = lambda text: None) -> bool:
    """Write the job's files (root's, mode 600: the env holds secrets), pull its image (telling ``said`` how far)
    and start its container, which gets ``replica_ip`` (the instance's private address) as
    ``DURASTACK_REPLICA_IP``. False, and nothing done, when this submission's container already ran here
    (``ran_before``)."""
    if await ran_before(conn, job):
        return False
    files = job_upload(job)
    prepare = f"umask 077; J={REMOTE_DIR}/job; rm -rf \"$J\"; mkdir -p \"$J/env.d\""
    status, _, err = await run(conn, prepare)
    if status != 0:
        raise RuntimeError(f"preparing the job dir failed ({status}): {err.strip()[:300]}")
    for name, text in files.items():
        # Names are fixed or validated env names (backends.runtime): nothing to escape but to be sure.
        status, _, err = await run(conn, f"umask 077; cat > {REMOTE_DIR}/job/{shlex.quote(name)}", input=text)
        if status != 0:
            raise RuntimeError(f"writing {name} failed ({status}): {err.strip()[:300]}")
    await pull_image(conn, runtime_of(job).image, said, auth=job.registry_auth)
    said("starting the container")
    status, _, err = await run(conn, start_command(job, gpu=gpu, replica_ip=replica_ip), timeout=300.0)
    if status != 0:
        raise RuntimeError(f"docker run failed ({status}): {err.strip()[-500:]}")
    return True


async def clear_job(conn: asyncssh.SSHClientConnection) -> None:
    """Remove the replica's container and job files (its env), keeping the images and the volumes: the instance
    is left idle for the next replica of its group (`idle_duration`)."""
    status, _, err = await run(conn, f"docker rm -f {CONTAINER_NAME} >/dev/null 2>&1; rm -rf {REMOTE_DIR}/job",
                               timeout=120.0)
    if status != 0:
        raise RuntimeError(f"clearing the job failed ({status}): {err.strip()[:300]}")


# `docker pull`'s lines without a terminal: "<layer id>: <state>" per layer, e.g. "Pulling fs layer", "Downloading",
# "Pull complete", "Already exists".
LAYER_LINE = re.compile(r"^([0-9a-f]{12}): (.+)$")
LAYER_DONE = ("Pull complete", "Already exists")


class PullDenied(RuntimeError):
    """The registry refused the image: private without (the right) ``registry_auth``, or no such repository."""


# Docker's words when the registry refuses a pull (Docker Hub's "pull access denied … denied: …", a registry's
# "unauthorized: authentication required", "denied: requested access to the resource is denied").
_DENIED = re.compile(r"pull access denied|unauthorized|denied: ")
PULL_CONFIG = f"{REMOTE_DIR}/job/docker"  # the credentials' Docker config, for the pull only (mode 700)


async def pull_image(conn: asyncssh.SSHClientConnection, image: str, said: Callable[[str], None],
                     auth: Optional[RegistryAuth] = None) -> None:
    """``docker pull image``, telling ``said`` each change of its layer count ("pulling I: 3/7 layers"). The
    caller's activity bounds it: a pull of tens of GB takes as long as it takes. An image already there is quick.
    With ``auth``, the pull reads it from a Docker config written (over stdin, mode 600) for it alone and removed
    when it ends; nothing of it is on a command line."""
    layers: dict[str, str] = {}
    last: deque[str] = deque(maxlen=5)  # for the error
    told = ""
    pull = f"docker pull {shlex.quote(image)} 2>&1"
    if auth is not None:
        status, _, err = await run(conn, f'umask 077; mkdir -p {PULL_CONFIG}; cat > {PULL_CONFIG}/config.json',
                                   input=docker_config(image, auth))
        if status != 0:
            raise RuntimeError(f"writing the registry credentials failed ({status}): {err.strip()[:300]}")
        pull = f"docker --config {PULL_CONFIG} pull {shlex.quote(image)} 2>&1; s=$?; rm -rf {PULL_CONFIG}; exit $s"
    async with conn.create_process(pull) as proc:
        async for line in proc.stdout:
            line = line.strip()
            last.append(line)
            match = LAYER_LINE.match(line)
            if match:
                layers[match[1]] = match[2]
            done = sum(1 for state in layers.values() if state in LAYER_DONE)
            text = f"pulling {image}: {done}/{len(layers)} layers"
            if text != told:
                said(text)
                told = text
        await proc.wait()
    if proc.exit_status != 0:
        said_last = " | ".join(last)[-500:]
        denied = _DENIED.search(said_last)
        raise (PullDenied if denied else RuntimeError)(f"docker pull {image} failed ({proc.exit_status}): {said_last}")


async def ran_before(conn: asyncssh.SSHClientConnection, job: JobSpec) -> bool:
    """Whether an earlier attempt of this submission's launch started its container here (its label names the
    submission). Kept as it is: started again, a model that was loading would load from the start (a worker
    restart cost a large model its whole load), and one that exited would run twice; the readiness wait then
    sees it serve or reports its exit. A container only created (its start failed) or another submission's is
    started anew."""
    template = f'{{{{.State.Status}}}} {{{{index .Config.Labels "{REPLICA_LABEL}"}}}}'
    status, out, _ = await run(conn, f"docker inspect -f '{template}' {CONTAINER_NAME}",
                               timeout=CONTAINER_CHECK_SECONDS)
    state, _, replica = out.strip().partition(" ")
    return status == 0 and replica == job.replica_id and state in ("running", "restarting", "exited")


# A container check over a connection that stopped answering (the network cut, the instance hung) gives up after
# this: the caller counts it as unknown, drops the connection and asks again on a new one, instead of holding up
# every other check of its pass. `docker inspect` answers in well under a second.
CONTAINER_CHECK_SECONDS = 2.0


async def container_state(conn: asyncssh.SSHClientConnection) -> Optional[str]:
    """None while the container runs; else why not (``exited (N)``, ``no container``)."""
    status, out, _ = await run(
        conn, f"docker inspect -f '{{{{.State.Status}}}} {{{{.State.ExitCode}}}}' {CONTAINER_NAME}",
        timeout=CONTAINER_CHECK_SECONDS)
    if status != 0:
        return "no container"
    state, _, code = out.strip().partition(" ")
    if state in ("running", "restarting"):
        return None
    return f"exited ({code})" if state == "exited" else state or "unknown"


def exec_command(argv: list[str], *, tty: bool = False) -> str:
    return f"docker exec {'-it ' if tty else ''}{CONTAINER_NAME} " + " ".join(shlex.quote(a) for a in argv)


def logs_command(*, follow: bool, tail: Optional[int] = None) -> str:
    return "docker logs" + (" -f" if follow else "") + (f" --tail {int(tail)}" if tail is not None else "") + \
        f" {CONTAINER_NAME}"


def tunnel_socket(home: Path, replica_id: str) -> Path:
    """A short path (Unix socket paths are limited to 107 bytes) under ``$DURASTACK_HOME/tunnels``."""
    return Path(home) / "tunnels" / (hashlib.sha256(replica_id.encode()).hexdigest()[:16] + ".sock")


Callback = Callable[[], Awaitable[None]]


@dataclass
class Tunnel:
    """Keeps ``socket_path`` forwarded to ``127.0.0.1:remote_port`` on the instance, reconnecting when lost."""

    client: SSHClient
    target: SSHTarget
    socket_path: Path
    remote_port: int
    on_up: Optional[Callback] = None
    on_down: Optional[Callback] = None
    # Asked while reconnecting fails at the longest back-off: False ends the tunnel (e.g. its instance is gone,
    # torn down through another worker).
    still_wanted: Optional[Callable[[], Awaitable[bool]]] = None
    backoff: tuple[float, float] = (0.2, 10.0)
    connection: Optional[asyncssh.SSHClientConnection] = field(default=None, init=False)
    up: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    reconnects: int = field(default=0, init=False)
    _task: Optional[asyncio.Task] = field(default=None, init=False)

    def start(self) -> "Tunnel":
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._keep(), name=f"tunnel {self.socket_path}")
        return self

    async def wait_up(self, timeout: float) -> None:
        await asyncio.wait_for(self.up.wait(), timeout)

    async def _keep(self) -> None:
        delay = self.backoff[0]
        while True:
            try:
                conn = await self.client.connect(self.target)
            except Exception as e:  # noqa: BLE001 — NotReady, or anything else: this loop must never die
                if not isinstance(e, NotReady):
                    log.warning("tunnel %s: %s: %s", self.socket_path.name, type(e).__name__, e)
                log.info("tunnel %s: %s; again in %.1fs", self.socket_path.name, e, delay)
                if delay >= self.backoff[1] and self.still_wanted is not None:
                    with contextlib.suppress(Exception):
                        if not await self.still_wanted():
                            log.info("tunnel %s: no longer wanted; closed", self.socket_path.name)
                            with contextlib.suppress(FileNotFoundError):
                                self.socket_path.unlink()
                            return
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff[1])
                continue
            try:
                self.socket_path.parent.mkdir(mode=0o711, parents=True, exist_ok=True)
                with contextlib.suppress(FileNotFoundError):
                    self.socket_path.unlink()
                listener = await conn.forward_local_path_to_port(str(self.socket_path), "127.0.0.1",
                                                                 self.remote_port)
                # nginx's workers may run as another user: the gateway gives the socket to their group.
                os.chmod(self.socket_path, 0o660)
                self.connection, delay = conn, self.backoff[0]
                self.up.set()
                if self.on_up is not None:
                    await self.on_up()
                await conn.wait_closed()
                listener.close()
            except Exception as e:  # noqa: BLE001 — e.g. the gateway refused the route: retried with a new connection
                log.warning("tunnel %s: %s: %s", self.socket_path.name, type(e).__name__, e)
            finally:
                was_up = self.up.is_set()
                self.up.clear()
                self.connection = None
                conn.close()
            if was_up:
                self.reconnects += 1
                log.warning("tunnel %s to %s lost; reconnecting", self.socket_path.name, self.target.host)
                if self.on_down is not None:
                    with contextlib.suppress(Exception):
                        await self.on_down()
            await asyncio.sleep(delay)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self.connection is not None:
            self.connection.close()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()


__all__ = ["NETNS_ENV", "netns_socket_factory", "socket_factory_from_env", "NotReady", "PullDenied", "SSHClient",
           "SSHTarget", "Tunnel", "booted_driver", "container_state", "exec_command", "logs_command", "run",
           "start_job", "tunnel_socket", "wait_booted"]
