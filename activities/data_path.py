"""How the gateway, the readiness probes and the container checks reach a cloud replica's instance.

``CloudReplicas`` (activities/replica_cloud.py) picks one data path per cloud, once, from its configuration:

* ``TunnelPath`` (``data_path: ssh``, the default): an SSH tunnel whose Unix socket is the gateway's upstream and
  the probes' address; its SSH connection also checks the container. A lost tunnel unroutes the replica until it
  is back, and a worker that restarted opens the tunnels of the replicas it watches again.
* ``PrivatePath`` (``data_path: private``, a control plane inside the VPC): the instance's ``<private IP>:<port>``,
  no tunnel; the container is checked over a plain SSH connection of the monitor's own, made in the background.
* ``DirectPath``: no SSH at all (older tests): an address given by the caller, nothing to check the container with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Awaitable, Callable, Optional

import asyncssh

from activities.liveness import progress
from backends.http import Connect
from backends.ssh import SSHClient, SSHTarget, Tunnel, tunnel_socket
from gateway.client import GatewayClient
from models.backends import TAG_NAMES, CloudInstance

log = logging.getLogger("durastack.replica_cloud")
DOWN = ("stopping", "stopped", "terminated")

Route = tuple[str, str, str]  # (service, replica id, group) of a routed replica


def app_port(instance: CloudInstance) -> int:
    """The port its app listens on, as its tags say (0: an instance made without one)."""
    return int(instance.tags.get(TAG_NAMES[instance.backend]["port"], "0") or 0)


class DataPath(ABC):
    """Where the gateway and the probes reach an instance's app, and the SSH connection its container is checked
    over."""

    @abstractmethod
    def address(self, instance: CloudInstance) -> str:
        """The gateway's upstream and the probes' address ('' while there is none)."""

    def connect(self, instance: CloudInstance) -> Optional[Connect]:
        """How the probes connect to ``address`` (None: a plain connection from here)."""
        return None

    def ssh_host(self, instance: CloudInstance, public: bool) -> str:
        """The host its sshd is reached at: its own address's, else its public IP if the cloud gives it one."""
        return instance.address.rpartition(":")[0] or (instance.public_ip if public else instance.private_ip)

    def reachable(self, instance: CloudInstance) -> bool:
        """It runs, with the address SSH connects to (a pending AWS instance has no public IP yet)."""
        return instance.state == "running" and bool(instance.address)

    async def open(self, instance: CloudInstance) -> None:
        """Make the app reachable for the gateway and the probes (the readiness step, on whichever worker)."""

    async def adopt(self, instance: CloudInstance, route: Route) -> None:
        """A watched replica on a worker that may have restarted: reach it again."""

    async def connection(self, instance: CloudInstance) -> Optional[asyncssh.SSHClientConnection]:
        """The SSH connection its container is checked over; None when there is none now."""
        return None

    def drop(self, instance_id: str, connection: asyncssh.SSHClientConnection) -> None:
        """``connection`` broke during a check."""

    async def close(self, instance_id: str) -> None:
        """The replica is torn down (or its instance kept idle): let go of what reaches it."""


class DirectPath(DataPath):
    """No SSH: the app at the address ``address`` says (default: the instance's own)."""

    def __init__(self, address: Optional[Callable[[CloudInstance], str]] = None) -> None:
        self._address = address or (lambda instance: instance.address)

    def address(self, instance: CloudInstance) -> str:
        return self._address(instance)

    def reachable(self, instance: CloudInstance) -> bool:
        return instance.state == "running" and bool(self.address(instance))


class TunnelPath(DataPath):
    """An SSH tunnel per instance, its socket under ``home/tunnels``. ``routes``: the replicas registered with
    the gateway, by instance id (a tunnel that comes back routes its replica again); ``current``: the instance as
    its cloud sees it now."""

    def __init__(self, ssh: SSHClient, home: Path, target: Callable[[CloudInstance], SSHTarget],
                 gateway: Optional[GatewayClient], routes: dict[str, Route],
                 current: Callable[[CloudInstance], Awaitable[CloudInstance]]) -> None:
        self.ssh, self.home, self.target, self.gateway = ssh, home, target, gateway
        self.routes, self.current = routes, current
        self.tunnels: dict[str, Tunnel] = {}

    def address(self, instance: CloudInstance) -> str:
        return f"unix:{tunnel_socket(self.home, instance.instance_id)}" if instance.state == "running" else ""

    async def open(self, instance: CloudInstance) -> None:
        tunnel = self._open(instance, app_port(instance))
        while not tunnel.up.is_set():
            progress(f"{instance.instance_id}: opening the tunnel")
            with contextlib.suppress(asyncio.TimeoutError):
                await tunnel.wait_up(5.0)

    async def adopt(self, instance: CloudInstance, route: Route) -> None:
        if instance.instance_id not in self.tunnels:
            self.routes[instance.instance_id] = route
            port = app_port(instance)
            if port:
                self._open(instance, port)

    def _open(self, instance: CloudInstance, port: int) -> Tunnel:
        tunnel = self.tunnels.get(instance.instance_id)
        if tunnel is None:
            iid = instance.instance_id

            async def up() -> None:  # back after a loss: route it again, if it was routed
                route = self.routes.get(iid)
                if route and self.gateway is not None:
                    await self.gateway.register(route[0], route[1], route[2], self.address(instance))

            async def down() -> None:  # while the tunnel is down the replica is unrouted
                route = self.routes.get(iid)
                if route and self.gateway is not None:
                    await self.gateway.unregister(route[0], route[1])

            async def wanted() -> bool:  # its instance still runs (not torn down through another worker)
                if (await self.current(instance)).state in DOWN:
                    self.tunnels.pop(iid, None)
                    self.routes.pop(iid, None)
                    return False
                return True

            tunnel = Tunnel(self.ssh, self.target(instance), tunnel_socket(self.home, iid), port, on_up=up,
                            on_down=down, still_wanted=wanted)
            self.tunnels[iid] = tunnel
        return tunnel.start()

    async def connection(self, instance: CloudInstance) -> Optional[asyncssh.SSHClientConnection]:
        tunnel = self.tunnels.get(instance.instance_id)
        return tunnel.connection if tunnel is not None else None

    async def close(self, instance_id: str) -> None:
        tunnel = self.tunnels.pop(instance_id, None)
        if tunnel is not None:
            await tunnel.close()


class PrivatePath(DataPath):
    """The instance's private address, from inside the VPC (connected as SSH is: ``DURASTACK_SSH_NETNS``)."""

    def __init__(self, ssh: SSHClient, target: Callable[[CloudInstance], SSHTarget]) -> None:
        self.ssh, self.target = ssh, target
        self.controls: dict[str, asyncssh.SSHClientConnection] = {}  # the monitor's SSH, by instance id
        self._connecting: dict[str, asyncio.Future] = {}

    def address(self, instance: CloudInstance) -> str:
        port = instance.tags.get(TAG_NAMES[instance.backend]["port"], "")
        ok = instance.state == "running" and instance.private_ip and port
        return f"{instance.private_ip}:{port}" if ok else ""

    def connect(self, instance: CloudInstance) -> Optional[Connect]:
        return self.ssh.socket_factory

    def ssh_host(self, instance: CloudInstance, public: bool) -> str:
        return instance.private_ip  # from inside the VPC: its private address, whatever public_ip says

    def reachable(self, instance: CloudInstance) -> bool:
        return instance.state == "running" and bool(self.address(instance))

    async def connection(self, instance: CloudInstance) -> Optional[asyncssh.SSHClientConnection]:
        """Made in the background, on first use and again after a loss, so an unreachable instance never holds up
        the checks of the others; None until it is made (the cloud state still says whether the instance is gone,
        and the gateway's upstream does not depend on it)."""
        iid = instance.instance_id
        conn = self.controls.get(iid)
        if conn is not None and not conn.is_closed():
            return conn
        pending = self._connecting.get(iid)
        if pending is None or pending.done():
            self._connecting[iid] = asyncio.ensure_future(self._connect_control(instance))
            with contextlib.suppress(asyncio.TimeoutError):  # usually made at once: checked in this same pass
                await asyncio.wait_for(asyncio.shield(self._connecting[iid]), 1.0)
        return self.controls.get(iid)

    async def _connect_control(self, instance: CloudInstance) -> None:
        try:
            conn = await self.ssh.connect(self.target(instance))
        except Exception as e:  # noqa: BLE001 — NotReady, or anything else: tried again at the next check
            log.info("%s: container check: %s", instance.instance_id, e)
            return
        old = self.controls.pop(instance.instance_id, None)
        if old is not None:
            old.close()
        self.controls[instance.instance_id] = conn

    def drop(self, instance_id: str, connection: asyncssh.SSHClientConnection) -> None:
        if self.controls.get(instance_id) is connection:
            self.controls.pop(instance_id, None)
            connection.close()

    async def close(self, instance_id: str) -> None:
        pending = self._connecting.pop(instance_id, None)
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pending
        control = self.controls.pop(instance_id, None)
        if control is not None:
            control.close()


__all__ = ["DataPath", "DirectPath", "PrivatePath", "TunnelPath", "app_port"]
