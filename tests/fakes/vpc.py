"""A simulated VPC for the cloud fakes: every instance moto or the fake Compute server runs becomes a host of its own.

* The VPC is a network namespace holding a bridge; each host is a namespace of its own on that bridge, with the
  instance's private address (private ranges, only inside these namespaces; the host's root namespace gets
  nothing, and no packet leaves them).
* A host boots from the instance's user data / startup-script, as a real instance would (its boot script runs
  with its paths moved under the host's dir), then runs asyncssh's server (tests/fakes/sim_host.py) with the host
  key the script installed, accepting only the installation's key; ``docker`` is tests/fakes/fake_docker.py. A GCP
  host's guest agent then writes new default host keys, as on a real instance's first boot.
* The gateway (this process) reaches a host only by a TCP connection made inside the VPC namespace
  (``socket_factory``, what ``backends.ssh.SSHClient`` is given), and the host serves only SSH there: the app is
  on the host's loopback, reachable through the SSH tunnel alone — as with a real cloud's firewall. The gateway's
  address is 172.31.255.254, or 10.255.255.254 towards a host in 10.0.0.0/8 (GCE's ranges): inside the VPC.
* The cloud's disks: the VPC keeps each one's contents in a directory (``disks/<cloud id>``), and a host shows it at
  the device path a real instance would only while the cloud says it is attached there (``Booter``'s ``list_disks``;
  tests/fakes/blockdev.py): a file written by one host is read by the next one after a detach and an attach.
* The cloud's firewall is honoured: a host booted with ``admits`` (what ``moto_instances`` / ``gce_instances`` read
  from the security groups and firewall rules, refreshed by the Booter as they change) takes TCP and UDP on its
  interface only from those sources, protocols and ports; the rest is dropped, as the cloud drops it. No
  iptables here: the host's routing rules do it (``ip rule ... ipproto tcp dport 22 lookup local`` before a
  ``prohibit``). Stateless, unlike a security group: a reply to a connection the host opened is refused unless
  its source is admitted (hosts here open connections only to their service's peers, which are). ICMP passes.

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
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import asyncssh
from ruamel.yaml import YAML

from tests.fakes import blockdev

ROOT = Path(__file__).resolve().parents[2]
BRIDGE_ADDRESS = "172.31.255.254"  # the VPC's own (the gateway's side); hosts get /32 routes, whatever range
LINK_ADDRESS = "172.31.255.253"  # this machine's side of ``link_machine()``: a control plane inside the VPC
GCE_GATEWAY_ADDRESS = "10.255.255.254"  # the gateway's address towards hosts in 10.0.0.0/8
INTERNET_ADDRESS = "198.51.100.7"  # a gateway on the internet (``internet()``): where it connects from
_ADMIT_PREFS = (100, 899)  # the host's routing rules that admit; 900, 901 drop the rest of TCP and UDP


@dataclass(frozen=True, order=True)
class Admit:
    """Traffic a host takes on its interface: from ``cidr``, of ``proto`` (tcp/udp; None: every protocol), to
    ``ports`` (first, last; None: every port)."""

    cidr: str
    proto: Optional[str] = None
    ports: Optional[tuple[int, int]] = None


def gateway_address(address: str) -> str:
    """The gateway's own address towards a host at ``address``."""
    return GCE_GATEWAY_ADDRESS if ipaddress.ip_address(address) in ipaddress.ip_network("10.0.0.0/8") \
        else BRIDGE_ADDRESS


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


def _guest_agent_host_keys(ssh_dir: Path) -> None:
    """What GCP's guest agent does on an instance's first boot, racing its startup script: new host keys in sshd's
    default places (``set_host_keys``), whatever the script wrote there."""
    key = asyncssh.generate_private_key("ssh-ed25519")
    (ssh_dir / "ssh_host_ed25519_key").write_bytes(key.export_private_key("openssh"))
    (ssh_dir / "ssh_host_ed25519_key.pub").write_bytes(key.export_public_key("openssh"))


def _boot_env(root: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "DURASTACK_SIMULATED": "1", "DURASTACK_DIR": str(root / "opt"),
            "DURASTACK_ETC": str(root / "etc"), "DURASTACK_ROOT_HOME": str(root / "home")}


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
    veth: str  # its link's end on the VPC's bridge
    address: str
    root: Path
    server: subprocess.Popen
    public: Optional[str] = None  # its public address, if the cloud gave it one

    def boot_again(self) -> None:
        """The boot script once more, as GCP's agent runs it at every boot, then sshd restarted (read again)."""
        subprocess.run(["ip", "netns", "exec", self.netns, "bash", str(self.root / "boot.sh")], env=_boot_env(self.root),
                       check=True, timeout=60)
        os.kill(self.server.pid, signal.SIGHUP)

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
    admitted: dict[str, tuple[Admit, ...]] = field(default_factory=dict)  # host → what its firewall takes
    _ns: list[str] = field(default_factory=list)
    _link: Optional[str] = None
    _internet: Optional[tuple[str, str]] = None  # (namespace, its link's name there)
    _booted: Iterator[int] = field(default_factory=lambda: itertools.count(1))  # hosts ever booted: unique names

    def __post_init__(self) -> None:
        self.netns = f"dsvpc-{self.tag}"
        _ip("netns", "add", self.netns)
        self._ns.append(self.netns)
        _ip("-n", self.netns, "link", "set", "lo", "up")
        _ip("-n", self.netns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.netns, "addr", "add", f"{BRIDGE_ADDRESS}/32", "dev", "br0")
        _ip("-n", self.netns, "addr", "add", f"{GCE_GATEWAY_ADDRESS}/32", "dev", "br0")
        _ip("-n", self.netns, "link", "set", "br0", "up")

    @property
    def registry(self) -> Path:
        """The private repositories of the hosts' image registry (tests/fakes/fake_docker.py): a test writes it."""
        return self.workdir / "registry.json"

    # --- hosts --------------------------------------------------------------------------------------

    def boot(self, name: str, address: str, user_data: str, admits: Optional[Sequence[Admit]] = None,
             public: Optional[str] = None) -> SimHost:
        """Boot a host for instance ``name`` at its private ``address`` from its user data; with ``admits``, behind
        that firewall from the start (without, open: the bare host of tests/test_ssh_path.py); with a ``public``
        address, reached at it from the internet (``internet()``)."""
        if name in self.hosts:
            return self.hosts[name]
        n = next(self._booted)
        netns, veth = f"dsh-{self.tag}-{n}", f"v{self.tag[-6:]}h{n}"[:15]
        _ip("netns", "add", netns)
        self._ns.append(netns)
        _ip("-n", self.netns, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("-n", self.netns, "link", "set", veth, "master", "br0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        _ip("-n", netns, "addr", "add", f"{address}/32", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "route", "add", "default", "dev", "eth0")
        _ip("-n", self.netns, "route", "add", f"{address}/32", "dev", "br0", "src", gateway_address(address))
        if admits is not None:
            self._firewall(netns, name, admits)
        if self._link:
            _ip("route", "add", f"{address}/32", "dev", self._link)
        if public:
            self._publish(netns, public)
        root = self.workdir / name
        for d in ("opt", "etc", "home", "bin", "containers", "dev"):
            (root / d).mkdir(parents=True, exist_ok=True, mode=0o700)
        blockdev.install(root / "bin")
        docker = root / "bin" / "docker"
        docker.write_text(f"#!/bin/sh\nFAKE_REGISTRY={self.registry} exec {sys.executable} "
                          f"{ROOT / 'tests/fakes/fake_docker.py'} \"$@\"\n")
        docker.chmod(0o755)
        # systemd's part that durastack uses over SSH: sshd's reload (sim_host reads its host keys again).
        systemctl = root / "bin" / "systemctl"
        systemctl.write_text(f"#!/bin/sh\ncase \"$1 $2\" in\n  'reload ssh'|'reload sshd') "
                             f"exec kill -HUP \"$(cat {root / 'sshd.pid'})\" ;;\n"
                             "  *) echo \"systemctl $*: not simulated\" >&2; exit 1 ;;\nesac\n")
        systemctl.chmod(0o755)
        # The instance's own boot, its paths moved under the host's dir.
        script = root / "boot.sh"
        script.write_text(boot_script_of(user_data))
        subprocess.run(["ip", "netns", "exec", netns, "bash", str(script)], env=_boot_env(root), check=True, timeout=60)
        if not user_data.startswith("#cloud-config"):
            _guest_agent_host_keys(root / "etc" / "ssh")
        server = subprocess.Popen(
            ["ip", "netns", "exec", netns, sys.executable, "-m", "tests.fakes.sim_host", "--root", str(root),
             "--listen", address, *(["--listen", public] if public else [])], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE, stderr=open(root / "sshd.log", "ab"), text=True)
        line = server.stdout.readline()  # "ready" once listening; EOF if it died
        if line.strip() != "ready":
            server.kill()
            raise RuntimeError(f"simulated host {name} did not start: {(root / 'sshd.log').read_text()[-2000:]}")
        host = SimHost(name=name, netns=netns, veth=veth, address=address, root=root, server=server, public=public)
        self.hosts[name] = host
        return host

    @property
    def disks(self) -> Path:
        """Each cloud disk's contents, by cloud id (tests/fakes/blockdev.py)."""
        return self.workdir / "disks"

    def show_disks(self, name: str, attached: dict[str, str]) -> None:
        """Host ``name`` shows exactly the disks ``attached`` (device path under /dev → cloud id)."""
        blockdev.show(self.hosts[name].root / "dev", self.disks, attached)

    def firewall(self, name: str, admits: Sequence[Admit]) -> None:
        """Bring host ``name``'s firewall to ``admits`` (the cloud's rules changed)."""
        self._firewall(self.hosts[name].netns, name, admits)

    def _firewall(self, netns: str, name: str, admits: Sequence[Admit]) -> None:
        wanted = tuple(sorted(set(admits)))
        if len(wanted) > _ADMIT_PREFS[1] - _ADMIT_PREFS[0] + 1:
            raise ValueError(f"{name}: too many firewall entries ({len(wanted)})")
        if name not in self.admitted:
            # Local delivery after our rules: move the kernel's `from all lookup local` (pref 0) behind them.
            _ip("-n", netns, "rule", "add", "pref", "1000", "lookup", "local")
            _ip("-n", netns, "rule", "del", "pref", "0")
            for pref, proto in ((900, "tcp"), (901, "udp")):
                _ip("-n", netns, "rule", "add", "pref", str(pref), "iif", "eth0", "ipproto", proto, "prohibit")
        elif self.admitted[name] == wanted:
            return
        for pref in range(_ADMIT_PREFS[0], _ADMIT_PREFS[0] + len(self.admitted.get(name, ()))):
            _ip("-n", netns, "rule", "del", "pref", str(pref))
        for pref, admit in enumerate(wanted, _ADMIT_PREFS[0]):
            match = ["from", admit.cidr, "iif", "eth0"]
            if admit.proto:
                match += ["ipproto", admit.proto]
                if admit.ports:
                    match += ["dport", f"{admit.ports[0]}-{admit.ports[1]}" if admit.ports[0] != admit.ports[1]
                              else str(admit.ports[0])]
            _ip("-n", netns, "rule", "add", "pref", str(pref), *match, "lookup", "local")
        self.admitted[name] = wanted

    def cut(self, host: SimHost) -> None:
        """Take the host's link down (a network partition): its SSH connections die."""
        _ip("-n", self.netns, "link", "set", host.veth, "down")

    def heal(self, host: SimHost) -> None:
        _ip("-n", self.netns, "link", "set", host.veth, "up")

    def power_off(self, name: str) -> None:
        """The cloud terminated (or stopped) instance ``name``: its host, its processes and its address go away,
        and its address may come back on another instance. Its files stay for tests to read."""
        host = self.hosts.pop(name)
        self.admitted.pop(name, None)
        host.stop()
        subprocess.run(["ip", "netns", "delete", host.netns], capture_output=True, timeout=30)  # its veth with it
        self._ns.remove(host.netns)
        subprocess.run(["ip", "-n", self.netns, "route", "del", f"{host.address}/32"], capture_output=True,
                       timeout=30)
        if self._link:
            subprocess.run(["ip", "route", "del", f"{host.address}/32", "dev", self._link], capture_output=True,
                           timeout=30)
        if host.public:
            subprocess.run(["ip", "-n", self.netns, "route", "del", f"{host.public}/32"], capture_output=True, timeout=30)
            if self._internet:
                subprocess.run(["ip", "-n", self._internet[0], "route", "del", f"{host.public}/32"],
                               capture_output=True, timeout=30)

    # --- the gateway's side -------------------------------------------------------------------------

    def link_machine(self) -> str:
        """Put this machine in the VPC, as a control plane running inside it (``data_path: private``): a veth from
        the machine's own namespace to the VPC's, its side at ``LINK_ADDRESS``, and a /32 route to each host (made
        as hosts boot); the VPC's namespace forwards between them. Only the hosts' addresses are routed, and the
        link, with its routes, goes with the VPC's namespace. Returns where the machine connects from, a CIDR."""
        if self._link is None:
            mine, theirs = f"vr{self.tag}"[:15], f"vv{self.tag}"[:15]
            _ip("link", "add", mine, "type", "veth", "peer", "name", theirs, "netns", self.netns)
            _ip("addr", "add", f"{LINK_ADDRESS}/32", "dev", mine)
            _ip("link", "set", mine, "up")
            _ip("-n", self.netns, "link", "set", theirs, "up")
            _ip("-n", self.netns, "route", "add", f"{LINK_ADDRESS}/32", "dev", theirs)
            self._forward(theirs)
            self._link = mine
            for host in self.hosts.values():
                _ip("route", "add", f"{host.address}/32", "dev", mine)
        return f"{LINK_ADDRESS}/32"

    def _forward(self, link: str) -> None:
        """The VPC's namespace forwards between its bridge and ``link``, answering ARP for either side."""
        sysctls = ["net.ipv4.ip_forward=1", "net.ipv4.conf.br0.proxy_arp=1", f"net.ipv4.conf.{link}.proxy_arp=1",
                   "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.br0.rp_filter=0", f"net.ipv4.conf.{link}.rp_filter=0"]
        subprocess.run(["ip", "netns", "exec", self.netns, "sysctl", "-q", "-w", *sysctls], check=True,
                       capture_output=True, timeout=30)

    def internet(self) -> str:
        """A namespace outside the VPC, as the internet is, for a gateway there (``DURASTACK_SSH_NETNS``): it connects
        from ``INTERNET_ADDRESS`` and reaches the hosts' public addresses only, through the VPC's namespace (its
        internet gateway), never a private one. A host has its public address on its interface (a real one sees
        its private address, the cloud translating; the same to sshd). Returns the namespace's name."""
        if self._internet is None:
            netns, mine, theirs = f"dsnet-{self.tag}", f"ni{self.tag}"[:15], f"ng{self.tag}"[:15]
            _ip("netns", "add", netns)
            self._ns.append(netns)
            _ip("-n", netns, "link", "set", "lo", "up")
            _ip("-n", self.netns, "link", "add", theirs, "type", "veth", "peer", "name", mine, "netns", netns)
            _ip("-n", netns, "addr", "add", f"{INTERNET_ADDRESS}/32", "dev", mine)
            _ip("-n", netns, "link", "set", mine, "up")
            _ip("-n", self.netns, "link", "set", theirs, "up")
            _ip("-n", self.netns, "route", "add", f"{INTERNET_ADDRESS}/32", "dev", theirs)
            self._forward(theirs)
            self._internet = (netns, mine)
            for host in self.hosts.values():
                if host.public:
                    _ip("-n", netns, "route", "add", f"{host.public}/32", "dev", mine)
        return self._internet[0]

    def _publish(self, netns: str, public: str) -> None:
        _ip("-n", netns, "addr", "add", f"{public}/32", "dev", "eth0")
        _ip("-n", self.netns, "route", "add", f"{public}/32", "dev", "br0")
        if self._internet:
            _ip("-n", self._internet[0], "route", "add", f"{public}/32", "dev", self._internet[1])

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
        from backends.ssh import netns_socket_factory

        return netns_socket_factory(self.netns)

    def close(self) -> None:
        for host in self.hosts.values():
            host.stop()
        if self._link:  # at once (its namespace's end would take it along, but later)
            subprocess.run(["ip", "link", "delete", self._link], capture_output=True, timeout=30)
            self._link = None
        for ns in reversed(self._ns):
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "delete", ns)
        self._ns.clear()





def _ports(proto: Optional[str], first, last) -> Optional[tuple[int, int]]:
    if proto not in ("tcp", "udp") or first is None or (int(first), int(last)) == (0, 65535):
        return None
    return int(first), int(last)


def moto_instances(region: str = "us-east-1") -> list[tuple[str, str, str, list[Admit], Optional[str]]]:
    """(id, private IP, user data, what its security groups admit, public IP) of every running instance moto has
    (AWS env pointed at it). A group's rule from a group admits the private IPs of that group's instances."""
    import boto3

    ec2 = boto3.client("ec2", region_name=region)
    res = ec2.describe_instances(Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}])
    raws = [i for r in res["Reservations"] for i in r["Instances"] if i.get("PrivateIpAddress")]
    # moto lists the groups of the primary interface, not always on the instance itself
    groups_of = {raw["InstanceId"]: {g["GroupId"] for g in (raw.get("SecurityGroups") or
                                                            (raw.get("NetworkInterfaces") or [{}])[0].get("Groups", []))}
                 for raw in raws}
    rules = {g["GroupId"]: g["IpPermissions"] for g in ec2.describe_security_groups()["SecurityGroups"]}
    found = []
    for raw in raws:
        data = ec2.describe_instance_attribute(InstanceId=raw["InstanceId"], Attribute="userData")
        value = data.get("UserData", {}).get("Value")
        if not value:
            continue
        admits = []
        for group in groups_of[raw["InstanceId"]]:
            for perm in rules.get(group, []):
                proto = None if perm["IpProtocol"] in ("-1", "all") else perm["IpProtocol"]
                ports = _ports(proto, perm.get("FromPort"), perm.get("ToPort"))
                cidrs = [r["CidrIp"] for r in perm.get("IpRanges", [])]
                for pair in perm.get("UserIdGroupPairs", []):
                    cidrs += [f"{o['PrivateIpAddress']}/32" for o in raws if pair["GroupId"] in groups_of[o["InstanceId"]]]
                admits += [Admit(cidr, proto, ports) for cidr in cidrs]
        found.append((raw["InstanceId"], raw["PrivateIpAddress"], base64.b64decode(value).decode(), admits,
                      raw.get("PublicIpAddress")))
    return found


def gce_instances(gce) -> list[tuple[str, str, str, list[Admit]]]:
    """(name, private IP, startup-script, what the firewall rules admit) of every instance the fake Compute server
    has. A rule applies to the instances carrying one of its target tags (all without any); its source tags admit
    the private IPs of the instances carrying them."""
    instances = gce.all_instances()
    tags_of = {i["name"]: set(i.get("tags", {}).get("items", [])) for i in instances}
    ip_of = {i["name"]: (i.get("networkInterfaces") or [{}])[0].get("networkIP") for i in instances}
    rules = [r for r in gce.firewall_rules() if r.get("direction", "INGRESS") == "INGRESS"]
    found = []
    for inst in instances:
        items = {i["key"]: i["value"] for i in inst.get("metadata", {}).get("items", [])}
        name = inst["name"]
        if "startup-script" not in items or not ip_of[name] or inst.get("status") != "RUNNING":
            continue
        admits = []
        for rule in rules:
            if rule.get("targetTags") and not set(rule["targetTags"]) & tags_of[name]:
                continue
            cidrs = list(rule.get("sourceRanges", []))
            cidrs += [f"{ip_of[o]}/32" for o in tags_of if ip_of[o] and set(rule.get("sourceTags", [])) & tags_of[o]]
            for allowed in rule.get("allowed", []):
                proto = None if allowed["IPProtocol"] == "all" else allowed["IPProtocol"]
                spans = [p.split("-") for p in allowed.get("ports", [])] or [[None, None]]
                for span in spans:
                    ports = _ports(proto, span[0], span[-1]) if span[0] is not None else None
                    admits += [Admit(cidr, proto, ports) for cidr in cidrs]
        found.append((name, ip_of[name], items["startup-script"], admits))
    return found


def moto_disks(region: str = "us-east-1") -> dict[str, dict[str, str]]:
    """Instance id → {device path under /dev → volume id} of the EBS volumes moto has attached: a Nitro instance
    shows each as an NVMe device named by the volume's id (with its dash dropped)."""
    import boto3

    volumes = boto3.client("ec2", region_name=region).describe_volumes()["Volumes"]
    out: dict[str, dict[str, str]] = {}
    for volume in volumes:
        for a in volume.get("Attachments", []):
            if a.get("State") == "attached":
                device = f"disk/by-id/nvme-Amazon_Elastic_Block_Store_{volume['VolumeId'].replace('-', '')}"
                out.setdefault(a["InstanceId"], {})[device] = volume["VolumeId"]
    return out


def gce_disks(gce) -> dict[str, dict[str, str]]:
    """Instance name → {device path under /dev → disk name} of the persistent disks attached to it: GCE names each
    ``google-<device name>``."""
    return {i["name"]: {f"disk/by-id/google-{d['deviceName']}": d["source"].rsplit("/", 1)[-1]
                        for d in i.get("disks", []) if not d.get("boot") and d.get("deviceName")}
            for i in gce.all_instances()}


class Booter:
    """Boots a simulated host for every instance the fake cloud runs (polled in a thread), as a cloud would; with
    ``list_disks`` (``moto_disks``, ``gce_disks``), shows each host the disks attached to its instance."""

    def __init__(self, vpc: SimulatedVPC, list_instances, interval: float = 0.2, list_disks=None):
        import threading

        self.vpc, self.list_instances, self.interval = vpc, list_instances, interval
        self.list_disks = list_disks
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
                running = self.list_instances()
                for name in set(self.vpc.hosts) - {name for name, *_ in running}:
                    self.vpc.power_off(name)  # terminated or stopped: it no longer answers
                for name, address, user_data, *rest in running:
                    admits = rest[0] if rest else None  # without: an open host
                    public = rest[1] if len(rest) > 1 else None
                    if name not in self.vpc.hosts:
                        self.user_data[name] = user_data
                        self.vpc.boot(name, address, user_data, admits, public)
                    elif admits is not None:
                        self.vpc.firewall(name, admits)  # the rules changed, or its peers did
                if self.list_disks is not None:
                    attached = self.list_disks()
                    for name in list(self.vpc.hosts):
                        self.vpc.show_disks(name, attached.get(name, {}))
            except Exception as e:  # noqa: BLE001 — reported by the test, never swallowed silently
                self.errors.append(f"{type(e).__name__}: {e}")
            self._stop.wait(self.interval)
__all__ = ["Admit", "Booter", "SimHost", "SimulatedVPC", "available", "boot_script_of", "gateway_address",
           "gce_disks", "gce_instances", "moto_disks", "moto_instances"]
