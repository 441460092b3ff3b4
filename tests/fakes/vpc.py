"""A simulated VPC for the cloud fakes: every instance moto or the fake Compute server runs becomes a host of its own.

* The VPC is a network namespace holding a bridge; each host is a namespace of its own on that bridge, with the
  instance's private address (private ranges, only inside these namespaces; the host's root namespace gets
  nothing, and no packet leaves them).
* A host boots from the instance's user data / startup-script, as a real instance would (its boot script runs
  with its paths moved under the host's dir), then runs asyncssh's server (tests/fakes/sim_host.py) with the host
  key the script installed, accepting only the installation's key; ``docker`` is tests/fakes/fake_docker.py.
* The gateway (this process) reaches a host only by a TCP connection made inside the VPC namespace
  (``socket_factory``, what ``activities.ssh.SSHClient`` is given), and the host serves only SSH there: the app is
  on the host's loopback, reachable through the SSH tunnel alone — as with a real cloud's firewall.

Needs root (``ip netns``); ``available()`` says why not.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ruamel.yaml import YAML

ROOT = Path(__file__).resolve().parents[2]
BRIDGE_ADDRESS = "172.31.255.254"  # the VPC's own (the gateway's side); hosts get /32 routes, whatever range
_seq = itertools.count(1)


def available() -> Optional[str]:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if not shutil.which("ip"):
        return "no ip command"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def boot_script_of(user_data: str) -> str:
    """The boot script in an AWS cloud-config (write_files) or a GCP startup-script (the script itself)."""
    if not user_data.startswith("#cloud-config"):
        return user_data
    (entry,) = YAML(typ="safe").load(user_data)["write_files"]
    content = entry["content"]
    return base64.b64decode(content).decode() if entry.get("encoding") == "b64" else content


@dataclass
class SimHost:
    name: str
    netns: str
    address: str
    root: Path
    server: subprocess.Popen

    def container_pid(self, name: str = "durastack-job") -> Optional[int]:
        path = self.root / "containers" / name / "pid"
        return int(path.read_text()) if path.exists() else None

    def stop(self) -> None:
        if self.server.poll() is None:
            self.server.terminate()
            try:
                self.server.wait(10)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait(10)
        # Containers and their supervisors: processes this host started, found by the pids it recorded.
        for pid_file in (self.root / "containers").glob("*/pid"):
            with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(int(pid_file.read_text())), signal.SIGKILL)


@dataclass
class SimulatedVPC:
    workdir: Path
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}x{next(_seq)}")
    hosts: dict[str, SimHost] = field(default_factory=dict)
    _ns: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.netns = f"dsvpc-{self.tag}"
        _ip("netns", "add", self.netns)
        self._ns.append(self.netns)
        _ip("-n", self.netns, "link", "set", "lo", "up")
        _ip("-n", self.netns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.netns, "addr", "add", f"{BRIDGE_ADDRESS}/32", "dev", "br0")
        _ip("-n", self.netns, "link", "set", "br0", "up")

    # --- hosts --------------------------------------------------------------------------------------

    def boot(self, name: str, address: str, user_data: str) -> SimHost:
        """Boot a host for instance ``name`` at its private ``address`` from its user data."""
        if name in self.hosts:
            return self.hosts[name]
        n = len(self.hosts) + 1
        netns, veth = f"dsh-{self.tag}-{n}", f"v{self.tag[-6:]}h{n}"[:15]
        _ip("netns", "add", netns)
        self._ns.append(netns)
        _ip("-n", self.netns, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("-n", self.netns, "link", "set", veth, "master", "br0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        _ip("-n", netns, "addr", "add", f"{address}/32", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "route", "add", "default", "dev", "eth0")
        _ip("-n", self.netns, "route", "add", f"{address}/32", "dev", "br0")
        root = self.workdir / name
        for d in ("opt", "etc", "home", "bin", "containers"):
            (root / d).mkdir(parents=True, exist_ok=True, mode=0o700)
        docker = root / "bin" / "docker"
        docker.write_text(f"#!/bin/sh\nexec {sys.executable} {ROOT / 'tests/fakes/fake_docker.py'} \"$@\"\n")
        docker.chmod(0o755)
        # The instance's own boot, its paths moved under the host's dir.
        script = root / "boot.sh"
        script.write_text(boot_script_of(user_data))
        env = {"PATH": "/usr/bin:/bin", "DURASTACK_SIMULATED": "1", "DURASTACK_DIR": str(root / "opt"),
               "DURASTACK_ETC": str(root / "etc"), "DURASTACK_ROOT_HOME": str(root / "home")}
        subprocess.run(["ip", "netns", "exec", netns, "bash", str(script)], env=env, check=True, timeout=60)
        server = subprocess.Popen(
            ["ip", "netns", "exec", netns, sys.executable, "-m", "tests.fakes.sim_host", "--root", str(root),
             "--listen", address], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE, stderr=open(root / "sshd.log", "ab"), text=True)
        line = server.stdout.readline()  # "ready" once listening; EOF if it died
        if line.strip() != "ready":
            server.kill()
            raise RuntimeError(f"simulated host {name} did not start: {(root / 'sshd.log').read_text()[-2000:]}")
        host = SimHost(name=name, netns=netns, address=address, root=root, server=server)
        self.hosts[name] = host
        return host

    def cut(self, host: SimHost) -> None:
        """Take the host's link down (a network partition): its SSH connections die."""
        _ip("-n", self.netns, "link", "set", f"v{self.tag[-6:]}h{list(self.hosts).index(host.name) + 1}"[:15],
            "down")

    def heal(self, host: SimHost) -> None:
        _ip("-n", self.netns, "link", "set", f"v{self.tag[-6:]}h{list(self.hosts).index(host.name) + 1}"[:15],
            "up")

    # --- the gateway's side -------------------------------------------------------------------------

    def connect(self, host: str, port: int, timeout: float = 5.0) -> socket.socket:
        """A blocking TCP connection to ``host:port`` made inside the VPC."""
        import asyncio

        sock = asyncio.run(self.socket_factory(host, port))
        sock.setblocking(True)
        sock.settimeout(timeout)
        return sock

    @property
    def socket_factory(self):
        """What the gateway's SSH client connects with (also ``DURASTACK_SSH_NETNS=<netns>`` for a worker)."""
        from activities.ssh import netns_socket_factory

        return netns_socket_factory(self.netns)

    def close(self) -> None:
        for host in self.hosts.values():
            host.stop()
        for ns in reversed(self._ns):
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "delete", ns)
        self._ns.clear()





def moto_instances(region: str = "us-east-1") -> list[tuple[str, str, str]]:
    """(id, private IP, user data) of every running instance moto has (AWS env pointed at it)."""
    import boto3

    ec2 = boto3.client("ec2", region_name=region)
    found = []
    res = ec2.describe_instances(Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}])
    for raw in (i for r in res["Reservations"] for i in r["Instances"]):
        data = ec2.describe_instance_attribute(InstanceId=raw["InstanceId"], Attribute="userData")
        value = data.get("UserData", {}).get("Value")
        if value and raw.get("PrivateIpAddress"):
            found.append((raw["InstanceId"], raw["PrivateIpAddress"], base64.b64decode(value).decode()))
    return found


def gce_instances(gce) -> list[tuple[str, str, str]]:
    """(name, private IP, startup-script) of every instance the fake Compute server has."""
    found = []
    for inst in gce.all_instances():
        items = {i["key"]: i["value"] for i in inst.get("metadata", {}).get("items", [])}
        nic = (inst.get("networkInterfaces") or [{}])[0]
        if "startup-script" in items and nic.get("networkIP"):
            found.append((inst["name"], nic["networkIP"], items["startup-script"]))
    return found


class Booter:
    """Boots a simulated host for every instance the fake cloud runs (polled in a thread), as a cloud would."""

    def __init__(self, vpc: SimulatedVPC, list_instances, interval: float = 0.2):
        import threading

        self.vpc, self.list_instances, self.interval = vpc, list_instances, interval
        self.errors: list[str] = []
        self.user_data: dict[str, str] = {}  # what each booted instance was given
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vpc-booter", daemon=True)

    def __enter__(self) -> "Booter":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for name, address, user_data in self.list_instances():
                    if name not in self.vpc.hosts:
                        self.user_data[name] = user_data
                        self.vpc.boot(name, address, user_data)
            except Exception as e:  # noqa: BLE001 — reported by the test, never swallowed silently
                self.errors.append(f"{type(e).__name__}: {e}")
            self._stop.wait(self.interval)
__all__ = ["Booter", "SimHost", "SimulatedVPC", "available", "boot_script_of", "gce_instances", "moto_instances"]
