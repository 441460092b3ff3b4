"""Local backend with real processes: namespaces, the Unix-socket bridge, idempotent start, stop.

Everything binds 127.0.0.1 or Unix sockets. Every replica started here is stopped in teardown
(by its recorded PID and start time); the tests then check that no process of it remains.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from backends.local import (CODE_DIR, LocalBackend, LocalBackendError, NoOffersError, UnsupportedJobError,
                              confinement_available, confinement_reason, isolation_available, isolation_reason,
                              network_reason)
from backends.local_cgroup import Cgroups, Limits
from backends.local_host import find_python, find_tree, gpu_count
from models.replica import InstanceStatus, JobSpec, LocalInstance
from models.resources import ResourcesSpec

needs_ns = pytest.mark.skipif(not isolation_available(), reason=isolation_reason())
MODES = [pytest.param(True, marks=needs_ns, id="isolated"), pytest.param(False, id="shared")]
needs_confinement = pytest.mark.skipif(not confinement_available(), reason=confinement_reason())


def seed_job(group: int, replica: int, **kw) -> JobSpec:
    """The seed's group exactly as written: every replica writes /tmp/version.txt and binds 8000."""
    fields = dict(service="replica-groups-test", group=f"replica-{group}", replica_num=replica, submission_num=0,
                  port=8000, python="3.12",
                  commands=[f'echo "Group {group} - Version 0" > /tmp/version.txt', "python3 -m http.server 8000"])
    return JobSpec(**{**fields, **kw})


def wait_until(cond: Callable[[], object], timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def replica_pids(work_dir: str) -> set[int]:
    """Live processes of a replica: carrying its marker env var, or with a cwd inside its work dir."""
    pids = set(find_tree(work_dir))
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cwd = os.readlink(f"/proc/{entry}/cwd")
            except OSError:
                continue
            if cwd == work_dir or cwd.startswith(work_dir + "/"):
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state not in "ZX":
                    pids.add(int(entry))
    return pids


class Replicas:
    """Starts replicas and remembers them, so that teardown stops every one of them."""

    def __init__(self, home: Path):
        self.home = home
        self.started: list[tuple[LocalBackend, LocalInstance]] = []

    def backend(self, isolation: bool | None) -> LocalBackend:
        return LocalBackend(self.home, isolation=isolation)

    def start(self, backend: LocalBackend, job: JobSpec) -> LocalInstance:
        inst = backend.start(job)
        self.started.append((backend, inst))
        return inst

    def stop_all(self) -> None:
        for backend, inst in self.started:
            backend.stop(inst, grace_seconds=2)
        for _, inst in self.started:
            assert not replica_pids(inst.work_dir), f"{inst.replica_id} left processes behind"


@pytest.fixture
def replicas(tmp_path):
    r = Replicas(tmp_path / "home")
    yield r
    r.stop_all()


def wait_http_200(backend: LocalBackend, inst: LocalInstance) -> None:
    wait_until(lambda: backend.probe(inst, "/", timeout=2) == 200, what=f"HTTP 200 from {inst.address}")


# ---- the seed, isolated ----------------------------------------------------------------------

@needs_ns
def test_seed_replicas_run_unchanged_side_by_side(replicas):
    host_version = Path("/tmp/version.txt")
    before = host_version.stat().st_mtime_ns if host_version.exists() else None
    backend = replicas.backend(None)
    a = replicas.start(backend, seed_job(1, 0))
    b = replicas.start(backend, seed_job(2, 1))
    assert a.isolated and b.isolated
    assert a.address.startswith("unix:/") and a.address != b.address
    wait_http_200(backend, a)
    wait_http_200(backend, b)  # both bound port 8000 at once, each in its own network namespace

    assert backend.exec(a, ["cat", "/tmp/version.txt"]) == (0, "Group 1 - Version 0\n")
    assert backend.exec(b, ["cat", "/tmp/version.txt"]) == (0, "Group 2 - Version 0\n")
    after = host_version.stat().st_mtime_ns if host_version.exists() else None
    assert after == before, "a replica wrote the host's /tmp"
    assert (Path(a.work_dir) / "tmp" / "version.txt").read_text() == "Group 1 - Version 0\n"

    assert backend.status(a) == InstanceStatus(state="running", message=f"pid {a.pid}")
    code, out = backend.exec(a, ["python3", "-c", "import sys; print(sys.version_info[:2])"])
    if find_python("3.12"):
        assert (code, out) == (0, "(3, 12)\n")
    assert "GET / HTTP/1.1" in backend.logs(a)


@needs_ns
def test_deep_home_uses_short_socket_link(tmp_path, replicas):
    job = seed_job(1, 0)
    suffix = len("/replicas/replica-groups-test/replica-1/r0-s0/.durastack/replica.sock")
    replicas.home = tmp_path / ("d" * max(1, 110 - suffix - len(str(tmp_path)) - 1))  # socket path: 110 > 107
    backend = replicas.backend(True)
    inst = replicas.start(backend, job)
    sock = inst.address[len("unix:"):]
    assert len(sock) <= 107
    if backend.networked:  # the service's stream proxy listens at the short path itself
        assert Path(sock).parent == replicas.home / "run" and Path(sock).is_socket()
    else:
        assert Path(sock).resolve() == Path(inst.work_dir) / ".durastack" / "replica.sock"
    wait_http_200(backend, inst)
    with pytest.raises(LocalBackendError, match="too long"):
        LocalBackend(tmp_path / ("d" * 120), isolation=True).start(job)


# ---- idempotency and survival ------------------------------------------------------------------

@pytest.mark.parametrize("isolation", MODES)
def test_start_twice_returns_the_same_tree(replicas, isolation):
    backend = replicas.backend(isolation)
    job = seed_job(1, 0, commands=["python3 -m http.server $PORT --bind $DURASTACK_REPLICA_IP"])
    first = replicas.start(backend, job)
    wait_http_200(backend, first)
    again = LocalBackend(replicas.home, isolation=isolation).start(job)  # e.g. a retried activity
    assert again == first
    assert backend.find(job) == backend.find_instance(job.replica_id) == first
    assert backend.find_instance("replica-groups-test/replica-1/r9-s0") is None
    assert backend.find_instance("../../etc/r0-s0") is None
    argvs = [Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0") for p in replica_pids(first.work_dir)]
    servers = [a for a in argvs if a[0].rsplit(b"/", 1)[-1].startswith(b"python3") and b"http.server" in a]
    assert len(servers) == 1


def test_replica_outlives_a_killed_starter(replicas):
    """The worker is killed -9 right after starting a replica; the retried start finds it."""
    job = seed_job(1, 0, commands=["python3 -m http.server $PORT --bind $DURASTACK_REPLICA_IP"])
    script = (
        "import os, signal, sys\n"
        "from backends.local import LocalBackend\n"
        "from models.replica import JobSpec\n"
        f"inst = LocalBackend({str(replicas.home)!r}).start(JobSpec.model_validate_json({job.model_dump_json()!r}))\n"
        "print(inst.model_dump_json(), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    starter = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        out, _ = starter.communicate(timeout=60)
    finally:
        if starter.poll() is None:
            starter.kill()  # by PID, only if it did not kill itself
    assert starter.returncode == -signal.SIGKILL
    inst = LocalInstance.model_validate_json(out)
    backend = replicas.backend(None)
    replicas.started.append((backend, inst))
    assert backend.status(inst).state == "running"
    wait_http_200(backend, inst)
    assert backend.start(job) == inst


def test_start_adopts_a_tree_whose_record_was_lost(replicas):
    """The starter died between spawning and writing instance.json: start finds the tree by its marker."""
    backend = replicas.backend(None)
    job = seed_job(1, 0, commands=["python3 -m http.server $PORT --bind $DURASTACK_REPLICA_IP"])
    first = replicas.start(backend, job)
    (Path(first.work_dir) / ".durastack" / "instance.json").unlink()
    assert backend.start(job) == first


# ---- status, stop ------------------------------------------------------------------------------

@pytest.mark.parametrize("isolation", MODES)
def test_status_reports_the_apps_own_exit_code(replicas, isolation):
    backend = replicas.backend(isolation)
    inst = replicas.start(backend, seed_job(1, 0, commands=["sleep 0.3", "echo bye", "exit 3"]))
    assert backend.status(inst).state == "running"
    wait_until(lambda: backend.status(inst).state != "running", what="the commands to end")
    assert backend.status(inst) == InstanceStatus(state="exited", exit_code=3, message="commands exited with code 3")
    assert "bye" in backend.logs(inst, tail=2)


@pytest.mark.parametrize("isolation", MODES)
def test_failed_command_stops_the_sequence(replicas, isolation):
    backend = replicas.backend(isolation)
    inst = replicas.start(backend, seed_job(1, 0, commands=["false", "echo never"]))
    wait_until(lambda: backend.status(inst).state == "exited", what="exit")
    assert backend.status(inst).exit_code == 1
    assert "never" not in backend.logs(inst)


@pytest.mark.parametrize("isolation", MODES)
def test_stop_ends_the_whole_tree_and_is_idempotent(replicas, isolation):
    backend = replicas.backend(isolation)
    inst = replicas.start(backend, seed_job(1, 0, commands=[
        "sleep 300 &", "(sleep 301 &)", "python3 -m http.server $PORT --bind $DURASTACK_REPLICA_IP"]))
    wait_http_200(backend, inst)
    assert len(replica_pids(inst.work_dir)) >= 4
    backend.stop(inst, grace_seconds=5)
    assert not replica_pids(inst.work_dir)
    assert backend.status(inst).state == "exited"
    backend.stop(inst)  # already gone: fine
    with pytest.raises(LocalBackendError):
        backend.exec(inst, ["true"])


DRAINING_SERVER = ("python3 -c \"import signal, sys, time\n"
                   "def bye(*_): time.sleep(0.5); print('drained', flush=True); sys.exit(0)\n"
                   "signal.signal(signal.SIGTERM, bye); print('ready', flush=True)\n"
                   "while True: signal.pause()\"")


@pytest.mark.parametrize("isolation", MODES)
def test_stop_lets_the_app_drain_after_one_sigterm(replicas, isolation):
    backend = replicas.backend(isolation)
    inst = replicas.start(backend, seed_job(1, 0, commands=["echo starting", DRAINING_SERVER]))
    wait_until(lambda: "ready" in backend.logs(inst), what="the app to install its handler")
    backend.stop(inst, grace_seconds=10)
    assert backend.logs(inst).count("drained") == 1  # one SIGTERM, and time to finish
    assert not replica_pids(inst.work_dir)


@pytest.mark.parametrize("isolation", MODES)
def test_stop_right_after_start_is_prompt(replicas, isolation):
    """A SIGTERM that reaches the wrapper before it handles signals must not be lost."""
    backend = replicas.backend(isolation)
    inst = replicas.start(backend, seed_job(1, 0, commands=["sleep 300"]))
    t0 = time.monotonic()
    backend.stop(inst, grace_seconds=10)
    assert time.monotonic() - t0 < 5
    assert not replica_pids(inst.work_dir)
    assert backend.status(inst).state in ("exited", "gone")


@pytest.mark.parametrize("isolation", MODES)
def test_commands_given_later_run_once_given_and_a_stop_ends_the_wait(replicas, isolation):
    """A replica whose commands name replicas placed after it starts without them: placed (its address known), it
    waits for them, then runs them with the env they bring."""
    backend = replicas.backend(isolation)
    job = seed_job(1, 0, commands=["echo never ${{ x }}"])
    inst = backend.start(job, later=True)
    replicas.started.append((backend, inst))
    assert backend.status(inst).state == "running" and "never" not in backend.logs(inst)
    backend.give_commands(job.model_copy(update={"commands": ["echo node0 is $NODE0", "exit 4"],
                                                 "env": {**job.env, "NODE0": "10.1.2.3"}}))
    wait_until(lambda: backend.status(inst).state == "exited", what="the given commands to end")
    assert backend.status(inst).exit_code == 4 and "node0 is 10.1.2.3" in backend.logs(inst)
    waiting = backend.start(seed_job(1, 1), later=True)  # never given its commands: a stop ends it promptly
    replicas.started.append((backend, waiting))
    t0 = time.monotonic()
    backend.stop(waiting, grace_seconds=10)
    assert time.monotonic() - t0 < 5 and not replica_pids(waiting.work_dir)


@pytest.mark.parametrize("isolation", MODES)
def test_stop_kills_what_ignores_sigterm(replicas, isolation):
    backend = replicas.backend(isolation)
    inst = replicas.start(backend, seed_job(1, 0, commands=["trap '' TERM", "echo ready", "while :; do sleep 1; done"]))
    wait_until(lambda: "ready" in backend.logs(inst), what="the app to trap TERM")
    t0 = time.monotonic()
    backend.stop(inst, grace_seconds=0.5)
    assert time.monotonic() - t0 < 5
    assert not replica_pids(inst.work_dir)
    assert backend.status(inst).exit_code == 128 + signal.SIGKILL


def test_stop_never_signals_a_reused_pid(tmp_path):
    """A record whose start time does not match the live PID is treated as gone."""
    me = os.getpid()
    wd = tmp_path / "w"
    wd.mkdir()
    stale = LocalInstance(replica_id="s/g/r0-s0", pid=me, start_time=1, work_dir=str(wd), address="127.0.0.1:1",
                          isolated=False, log_path=str(wd / "replica.log"))
    backend = LocalBackend(tmp_path, isolation=False)
    backend.stop(stale, grace_seconds=0.1)  # would kill pytest itself if it trusted the bare PID
    assert backend.status(stale).state == "gone"


# ---- isolation off -------------------------------------------------------------------------------

def test_isolation_off_gives_each_replica_a_port(replicas, monkeypatch):
    monkeypatch.setenv("DURASTACK_LOCAL_ISOLATION", "0")
    assert not isolation_available() and "DURASTACK_LOCAL_ISOLATION" in isolation_reason()
    backend = replicas.backend(None)
    assert not backend.isolated
    job = dict(commands=["python3 -m http.server $PORT --bind $DURASTACK_REPLICA_IP"])
    a = replicas.start(backend, seed_job(1, 0, **job))
    b = replicas.start(backend, seed_job(2, 1, **job))
    assert not a.isolated and a.address.startswith("127.0.0.1:") and a.address != b.address
    for inst in (a, b):
        wait_http_200(backend, inst)
        assert backend.exec(inst, ["sh", "-c", "echo $PORT; pwd"]) == (0, f"{inst.address.split(':')[1]}\n{inst.work_dir}\n")
    assert "isolation off" in backend.logs(a)


# ---- environment, python, jobs refused --------------------------------------------------------------

@pytest.mark.parametrize("isolation", MODES)
def test_environment(replicas, isolation):
    backend = replicas.backend(isolation)
    inst = replicas.start(backend, seed_job(2, 5, env={"MODEL": "tiny"}, python="3.99",
                                            commands=["sleep 300"]))
    code, out = backend.exec(inst, ["env"])
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert code == 0
    assert env["MODEL"] == "tiny" and env["LANG"] and env["HOME"] and env["PATH"]
    assert (env["DURASTACK_SERVICE"], env["DURASTACK_GROUP"], env["DURASTACK_REPLICA_NUM"]) == \
        ("replica-groups-test", "replica-2", "5")
    assert env["PORT"] == ("8000" if isolation else inst.address.split(":")[1])
    assert "python 3.99 is not installed" in backend.logs(inst)


@pytest.mark.parametrize("isolation", MODES)
def test_shell_and_entrypoint_run_the_commands(replicas, isolation):
    backend = replicas.backend(isolation)
    bash = replicas.start(backend, seed_job(1, 0, shell="bash", commands=['[[ "$BASH_VERSION" ]] && echo in bash']))
    given = replicas.start(backend, seed_job(1, 1, entrypoint="/bin/sh -c 'echo \"given: $0\"'",
                                             commands=["echo a", "echo b"]))
    for inst in (bash, given):
        wait_until(lambda i=inst: backend.status(i).state == "exited", what="the commands to end")
    assert backend.status(bash).exit_code == 0 and "in bash" in backend.logs(bash)
    assert "given: echo a\necho b" in backend.logs(given)


@needs_ns
def test_an_isolated_replica_sees_no_host_socket_and_has_its_own_ipc_and_uts(replicas, tmp_path):
    """The host's /run holds sockets (a database trusting local connections, Docker's): a replica gets an empty one,
    and SysV IPC and the hostname of its own."""
    marker = Path("/run") / f"durastack-test-{os.getpid()}.sock"
    import socket as socket_module
    with socket_module.socket(socket_module.AF_UNIX) as listener:
        listener.bind(str(marker))
        try:
            backend = replicas.backend(True)
            inst = replicas.start(backend, seed_job(1, 0, commands=["sleep 300"]))
            wait_until(lambda: backend.status(inst).state == "running", what="the replica")
            code, out = backend.exec(inst, ["sh", "-c", f"ls /run /var/run; test -e {marker} && echo SEEN; "
                                                          "readlink /proc/self/ns/ipc /proc/self/ns/uts"])
        finally:
            marker.unlink()
    assert code == 0 and "SEEN" not in out and marker.name not in out, out
    ipc, uts = out.strip().splitlines()[-2:]
    assert ipc != os.readlink("/proc/self/ns/ipc") and uts != os.readlink("/proc/self/ns/uts"), out
    assert backend.exec(inst, ["sh", "-c", "getent hosts localhost >/dev/null && echo resolves"])[1].strip() \
        == "resolves"


FORKS = """python3 -c '
import subprocess
started = []
for _ in range(64):
    try:
        started.append(subprocess.Popen(["sleep", "30"]))
    except OSError:
        break
print("running", len(started), flush=True)
'"""


@pytest.mark.skipif(bool(Cgroups().reason), reason=Cgroups().reason or "")
def test_a_replica_is_held_to_its_memory_and_process_limits(replicas):
    """One replica's leak or fork bomb must not take the machine: its cgroup holds it to what its group asked."""
    backend = replicas.backend(None)
    limits = Limits(memory_bytes=256 * 2**20, cpus=1, pids=32)
    hog = backend.start(seed_job(1, 0, commands=["python3 -c 'b = bytearray(1024 * 2**20); print(\"survived\")'"]),
                        limits=limits)
    forks = backend.start(seed_job(1, 1, commands=[FORKS, "sleep 300"]), limits=limits)
    replicas.started += [(backend, hog), (backend, forks)]
    wait_until(lambda: backend.status(hog).state == "exited", what="the memory hog to end")
    assert backend.status(hog).exit_code != 0 and "survived" not in backend.logs(hog)
    running = wait_until(lambda: re.search(r"running (\d+)", backend.logs(forks)), what="the fork loop")
    assert int(running.group(1)) < 32, backend.logs(forks)
    assert "limits: memory 0.25GB, 1 CPUs, 32 processes (cgroup v" in backend.logs(forks)


def test_image_without_commands_is_refused(tmp_path):
    job = seed_job(1, 0, commands=[], image="vllm/vllm-openai:latest")
    with pytest.raises(UnsupportedJobError, match="cannot run images"):
        LocalBackend(tmp_path, isolation=False).start(job)


def test_exec_timeout(replicas):
    backend = replicas.backend(None)
    inst = replicas.start(backend, seed_job(1, 0, commands=["sleep 300"]))
    code, out = backend.exec(inst, ["sleep", "30"], timeout=0.5)
    assert code == 124 and "timed out" in out


# ---- resources ------------------------------------------------------------------------------------

@pytest.mark.skipif(gpu_count() > 0, reason="this machine has a GPU")
def test_check_resources_refuses_a_gpu(tmp_path):
    backend = LocalBackend(tmp_path, isolation=False)
    with pytest.raises(NoOffersError, match=r"no offers: this machine has no GPU \(requested gpu=A100:1\)"):
        backend.check_resources(ResourcesSpec(gpu="A100:1"))


def test_check_resources_cpu_and_memory(tmp_path):
    backend = LocalBackend(tmp_path, isolation=False)
    backend.check_resources(ResourcesSpec(cpu=1, memory="1GB"))
    backend.check_resources(ResourcesSpec(cpu=1, memory="1GB", gpu="0..1"))  # optional GPU
    with pytest.raises(NoOffersError, match="CPUs"):
        backend.check_resources(ResourcesSpec(cpu=(os.cpu_count() or 1) + 1, memory="1GB"))
    with pytest.raises(NoOffersError, match="memory"):
        backend.check_resources(ResourcesSpec(cpu=1, memory="100TB"))


# ---- the bridge alone, and the models ------------------------------------------------------------

@pytest.fixture
def bridge(tmp_path):
    """The bridge on a Unix socket, forwarding to a 127.0.0.1 port chosen by the test."""
    procs: list[subprocess.Popen] = []

    def run(port: int) -> str:
        sock = str(tmp_path / "b.sock")
        procs.append(subprocess.Popen([sys.executable, "-m", "backends.bridge", "--socket", sock, "--port", str(port)]))
        wait_until(lambda: os.path.exists(sock), what="the bridge socket")
        return sock

    yield run
    for p in procs:
        p.terminate()
        p.wait(timeout=10)


def test_bridge_closes_quickly_when_nothing_listens(bridge):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connects are refused
        sock = bridge(port)
        with socket.socket(socket.AF_UNIX) as c:
            c.settimeout(5)
            t0 = time.monotonic()
            c.connect(sock)
            c.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert c.recv(100) == b""
            assert time.monotonic() - t0 < 2


def test_bridge_forwards_both_ways_and_half_closes(bridge):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        sock = bridge(server.getsockname()[1])
        with socket.socket(socket.AF_UNIX) as c:
            c.settimeout(5)
            c.connect(sock)
            c.sendall(b"ping")
            c.shutdown(socket.SHUT_WR)
            server.settimeout(5)
            conn, _ = server.accept()
            with conn:
                conn.settimeout(5)
                data = b""
                while chunk := conn.recv(100):  # EOF arrives: the half-close was forwarded
                    data += chunk
                conn.sendall(data.upper())
            reply = b""
            while chunk := c.recv(100):
                reply += chunk
            assert reply == b"PING"


def test_models_round_trip():
    job = seed_job(1, 0)
    assert job.replica_id == "replica-groups-test/replica-1/r0-s0"
    inst = LocalInstance(replica_id=job.replica_id, pid=1, start_time=2, work_dir="/w", address="unix:/w/replica.sock",
                         isolated=True, log_path="/w/replica.log")
    assert LocalInstance.model_validate(json.loads(inst.model_dump_json())) == inst
    with pytest.raises(ValueError):
        JobSpec(service="../x", group="g", replica_num=0, submission_num=0, port=80)


# ---- confinement (root with namespaces) -----------------------------------------------------------

ESCAPES = "umount -l {home}; umount {home}; umount -l /tmp; umount /dev/shm; umount -l {code}; " \
          "unshare -Urm sh -c 'umount -l {home}; cat {secret}' ; "


@needs_confinement
def test_confined_replica_cannot_read_the_home_even_after_unmounting(replicas):
    home = replicas.home
    backend = replicas.backend(None)
    assert backend.confined and "confinement on" in backend.confinement_reason
    secret = home / "codec.key"
    secret.write_text("codec-key-material\n")
    secret.chmod(0o644)  # world-readable: only the mounts (and the home's mode) keep it from the replica
    (home / "gateway").mkdir()
    (home / "gateway" / "state.json").write_text('{"hash": "gateway-token-hash"}')
    other = replicas.start(backend, seed_job(2, 1, env={"API_TOKEN": "other-replica-secret"},
                                             commands=["echo other-replica-file > mine.txt", "sleep 300"]))
    wait_until(lambda: (Path(other.work_dir) / "mine.txt").exists(), what="the other replica's file")
    escapes = ESCAPES.format(home=home, code=CODE_DIR, secret=secret)
    reads = (f"cat {secret} {home}/gateway/state.json {other.work_dir}/mine.txt {other.work_dir}/.durastack/launch.json;"
             f" ls -a {home} {home}/replicas")
    inst = replicas.start(backend, seed_job(1, 0, commands=["(" + escapes + reads + ") > seen.txt 2>&1 || true", "sleep 300"]))
    seen = Path(inst.work_dir) / "seen.txt"
    wait_until(lambda: seen.exists() and backend.status(inst).state == "running" and seen.stat().st_size,
               what="the replica's attempts")
    code, out = backend.exec(inst, ["sh", "-c", escapes + reads])  # and through `durastack exec`
    for text in (seen.read_text(), out):
        for leaked in ("codec-key-material", "gateway-token-hash", "other-replica-file", "other-replica-secret"):
            assert leaked not in text, text
        assert "Permission denied" in text or "must be superuser" in text or "not permitted" in text, text
    # the home, as the replica sees it: only the way down to its own work dir
    assert backend.exec(inst, ["ls", "-a", str(home)]) == (0, ".\n..\nreplicas\n")
    assert backend.exec(inst, ["ls", str(home / "replicas" / "replica-groups-test")]) == (0, "replica-1\n")


@needs_confinement
def test_confined_replica_runs_as_non_root_without_capabilities(replicas):
    backend = replicas.backend(None)
    inst = replicas.start(backend, seed_job(1, 0, commands=[
        "id -u > uid.txt", "grep -E '^Cap(Eff|Prm|Bnd)|^NoNewPrivs' /proc/self/status > status.txt", "sleep 300"]))
    wd = Path(inst.work_dir)
    wait_until(lambda: (wd / "status.txt").exists() and (wd / "status.txt").stat().st_size, what="status.txt")
    assert int((wd / "uid.txt").read_text()) != 0
    status = dict(line.split(":\t") for line in (wd / "status.txt").read_text().splitlines())
    assert status == {"CapPrm": "0000000000000000", "CapEff": "0000000000000000", "CapBnd": "0000000000000000",
                      "NoNewPrivs": "1"}
    code, out = backend.exec(inst, ["sh", "-c", "id -u; grep CapEff /proc/self/status"])
    assert code == 0 and out.split() == [(wd / "uid.txt").read_text().strip(), "CapEff:", "0000000000000000"]
    # the process as the host sees it
    uids = {Path(f"/proc/{p}/status").read_text().split("Uid:")[1].split()[0] for p in replica_pids(inst.work_dir)
            if "sleep" in Path(f"/proc/{p}/cmdline").read_text()}
    assert uids and "0" not in uids


@needs_confinement
def test_confined_replica_cannot_write_durastacks_code_but_can_its_own_dirs(replicas):
    backend = replicas.backend(None)
    probe = Path(CODE_DIR) / "activities" / ".confined-write-probe"
    inst = replicas.start(backend, seed_job(1, 0, commands=["sleep 300"]))
    code, out = backend.exec(inst, ["sh", "-c", f"touch {probe} || echo refused; echo x >> {CODE_DIR}/README.md "
                                                f"|| echo refused; touch {sys.prefix}/probe || echo refused"])
    assert out.count("refused") == 3 and not probe.exists(), out
    assert backend.exec(inst, ["sh", "-c", "mkdir -p a/b && echo ok > a/b/f && cat a/b/f && echo t > /tmp/t && "
                                           "cat /tmp/t && echo s > /dev/shm/s && cat /dev/shm/s"]) == (0, "ok\nt\ns\n")
    assert (Path(inst.work_dir) / "a" / "b" / "f").read_text() == "ok\n"


@needs_confinement
def test_confined_replica_cannot_plant_a_link_for_root_to_write_through(replicas, tmp_path):
    backend = replicas.backend(None)
    target = tmp_path / "root-owned.txt"
    target.write_text("untouched\n")
    job = seed_job(1, 0, commands=["rm -f replica.log exit_code", f"ln -s {target} replica.log",
                                   f"ln -s {target} exit_code", "exit 0"])
    inst = replicas.start(backend, job)
    wait_until(lambda: backend.status(inst).state == "exited", what="exit")
    assert "untouched" not in backend.logs(inst)  # `durastack logs` does not read through the link
    backend.stop(inst)
    again = backend.start(job.model_copy(update={"commands": ["echo second"]}))  # the same work dir again
    replicas.started.append((backend, again))
    wait_until(lambda: backend.status(again).state == "exited", what="exit")
    assert target.read_text() == "untouched\n"
    assert not Path(again.log_path).is_symlink() and "second" in backend.logs(again)


@needs_confinement
def test_confined_replica_cannot_swap_roots_meta_dir_for_one_of_its_own(replicas):
    """The replica may write in its work dir, but not rename root's .durastack away and put a directory of its own
    there: root would write exit_code and the scrubbed launch file through the links in it (a file root alone may
    write, e.g. /etc/ld.so.preload, with contents the replica chose), and `exec` would trust its launch file."""
    import shutil
    import tempfile
    backend = replicas.backend(None)
    # Root-only files where both the replica's namespace (a private /tmp, the home hidden) and the host see them.
    victims = Path(tempfile.mkdtemp(prefix="durastack-test-", dir="/var/lib"))
    for name in ("exit", "launch", "again"):
        (victims / name).write_text("untouched\n")
    try:
        _swap_roots_meta_dir(replicas, backend, victims)
    finally:
        shutil.rmtree(victims)


def _swap_roots_meta_dir(replicas, backend, victims: Path) -> None:
    swap = ("mv .durastack .old; mkdir .durastack && cd .durastack && touch ns_ready && "
            f"echo '{{\"env\": {{\"A\": \"x\"}}, \"drop\": []}}' > launch.json && "
            f"ln -s {victims}/exit exit_code.tmp && ln -s {victims}/launch launch.json.tmp; "
            f"cd .. && mv tmp tmp.old; ln -s {victims} tmp; rm -rf replica.log; ln -s {victims}/again replica.log")
    job = seed_job(1, 0, env={"API_TOKEN": "s3cret"}, commands=[f"({swap}) > tried.txt 2>&1 || true", "exit 3"])
    inst = replicas.start(backend, job)
    wait_until(lambda: (Path(inst.work_dir) / "tried.txt").exists() and not replica_pids(inst.work_dir),
               what="the commands to end")
    assert {p.name: p.read_text() for p in victims.iterdir()} == {n: "untouched\n" for n in ("exit", "launch", "again")}
    tried = (Path(inst.work_dir) / "tried.txt").read_text()
    assert "Operation not permitted" in tried or "Permission denied" in tried, tried
    backend.stop(inst, grace_seconds=2)
    again = backend.start(job)  # the same work dir again: root makes .durastack and writes the launch file anew
    replicas.started.append((backend, again))
    wait_until(lambda: backend.status(again).state == "exited", what="exit")
    assert {p.name: p.read_text() for p in victims.iterdir()} == {n: "untouched\n" for n in ("exit", "launch", "again")}
    meta = Path(inst.work_dir) / ".durastack"
    assert not meta.is_symlink() and meta.stat().st_uid == os.geteuid() and backend.status(again).exit_code == 3
    assert json.loads((meta / "launch.json").read_text())["env"] == {}


# ---- working_dir, user -----------------------------------------------------------------------------

@pytest.mark.parametrize("isolation", MODES)
def test_commands_run_in_working_dir(replicas, isolation):
    backend = replicas.backend(isolation)
    inst = replicas.start(backend, seed_job(1, 0, working_dir="src/app", commands=["pwd > where.txt", "sleep 300"]))
    wd = Path(inst.work_dir)
    wait_until(lambda: (wd / "src" / "app" / "where.txt").exists(), what="where.txt")
    assert (wd / "src" / "app" / "where.txt").read_text() == f"{wd}/src/app\n"
    assert backend.exec(inst, ["pwd"]) == (0, f"{wd}/src/app\n")
    absolute = seed_job(2, 1, commands=["pwd"])
    absolute = absolute.model_copy(update={"working_dir": str(backend.work_dir(absolute) / "abs")})
    inst = replicas.start(backend, absolute)
    wait_until(lambda: backend.status(inst).state == "exited", what="exit")
    assert f"{inst.work_dir}/abs\n" in backend.logs(inst)


@pytest.mark.parametrize("where", ["../other", "/etc", "a/../../b"])
def test_working_dir_outside_the_work_dir_is_refused(tmp_path, where):
    with pytest.raises(UnsupportedJobError, match="outside the replica's work dir"):
        LocalBackend(tmp_path, isolation=False).start(seed_job(1, 0, working_dir=where))


@needs_confinement
def test_user_is_honoured_or_refused_when_confined(replicas, monkeypatch):
    backend = replicas.backend(None)
    with pytest.raises(UnsupportedJobError, match="never runs replicas as root"):
        backend.start(seed_job(1, 0, user="root"))
    with pytest.raises(UnsupportedJobError, match="no such user"):
        backend.start(seed_job(1, 0, user="no-such-user-here"))
    with pytest.raises(UnsupportedJobError, match="DURASTACK_LOCAL_USERS"):
        backend.start(seed_job(1, 0, user="nobody"))
    monkeypatch.setenv("DURASTACK_LOCAL_USERS", "nobody")
    inst = replicas.start(backend, seed_job(1, 0, user="nobody", commands=["sleep 300"]))
    assert backend.exec(inst, ["id", "-un"]) == (0, "nobody\n")
    inst = replicas.start(backend, seed_job(2, 1, user=backend.account.name, commands=["sleep 300"]))
    assert backend.exec(inst, ["id", "-u"]) == (0, f"{backend.account.uid}\n")


@needs_confinement
def test_each_service_runs_as_a_uid_of_its_own(replicas):
    import pwd

    backend = replicas.backend(None)
    ids = {}
    for service, group, replica in (("svc-a", 1, 0), ("svc-a", 2, 0), ("svc-b", 1, 0)):
        job = seed_job(group, replica, service=service, commands=["sleep 300"])
        inst = replicas.start(backend, job)
        status, out = backend.exec(inst, ["sh", "-c", "id -u; id -g; echo $USER"])
        assert status == 0, out
        ids[(service, group)] = out.split()
    a, b = ids[("svc-a", 1)], ids[("svc-b", 1)]
    assert ids[("svc-a", 2)] == a and a[0] != b[0] and a[1] != b[1]  # one uid and gid per service
    assert backend.account.uid not in {int(a[0]), int(b[0])}
    for uid in (int(a[0]), int(b[0])):
        with pytest.raises(KeyError):  # no user of the host
            pwd.getpwuid(uid)
    assert a[2] == "durastack-svc-a"
    # Kept for the service's life: a new backend of the home (a worker restart) gives the same.
    assert replicas.backend(None).run_as(seed_job(1, 1, service="svc-a")).uid == int(a[0])


def test_user_is_refused_when_the_backend_cannot_switch_users(replicas):
    import pwd
    backend = replicas.backend(False)
    assert not backend.confined
    with pytest.raises(UnsupportedJobError, match="cannot run the commands as user 'nobody'"):
        backend.start(seed_job(1, 0, user="nobody"))
    me = pwd.getpwuid(os.geteuid()).pw_name
    inst = replicas.start(backend, seed_job(1, 0, user=me, commands=["sleep 300"]))
    assert backend.exec(inst, ["id", "-u"]) == (0, f"{os.geteuid()}\n")


# ---- the service's env reaches the replica alone, never a root process that starts or enters it --------

SERVICE_VAR = "DS_SERVICE_ONLY"


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


@pytest.mark.parametrize("isolation", MODES)
def test_launcher_carries_none_of_the_services_env_the_replica_all_of_it(replicas, isolation):
    from backends.local_host import MARKER, children

    backend = replicas.backend(isolation)
    path = "/service/bin:/usr/bin:/bin"
    inst = replicas.start(backend, seed_job(1, 0, env={SERVICE_VAR: "x", "PATH": path}, commands=["sleep 300"]))
    # unshare and local_init (PID 1 of the namespaces) when isolated; local_init alone when not
    launchers = [inst.pid, *(children(inst.pid) if isolation else [])]
    app = wait_until(lambda: [p for p in replica_pids(inst.work_dir)
                                    if os.path.basename((cmdline(p) or [""])[0]) == "sleep"], what="the app")
    for pid in launchers:
        env = environ(pid)
        assert env[MARKER] == inst.work_dir  # the right process, and its environ readable
        assert SERVICE_VAR not in env and env["PATH"] != path, (cmdline(pid), env)
    env = environ(app[0])
    assert env[SERVICE_VAR] == "x" and env["PATH"].endswith(":" + path) and env["DURASTACK_GROUP"] == "replica-1"


@needs_ns
def test_exec_enters_without_the_services_env_and_runs_with_it(replicas):
    import threading

    backend = replicas.backend(None)
    inst = replicas.start(backend, seed_job(1, 0, env={SERVICE_VAR: "x y'z"}, commands=["sleep 300"]))
    go = Path(inst.work_dir) / "tmp" / "go"  # the replica's /tmp
    result: list = []
    waiting = 'echo "$DS_SERVICE_ONLY"; while [ ! -e /tmp/go ]; do sleep 0.05; done'
    t = threading.Thread(target=lambda: result.append(backend.exec(inst, ["sh", "-c", waiting], timeout=20)))
    t.start()
    try:
        def entering() -> list[int]:
            return [p for p in find_tree(inst.work_dir) if os.path.basename((cmdline(p) or [""])[0]) == "nsenter"]
        nsenter = wait_until(entering, what="exec's nsenter")
        for pid in nsenter:
            assert SERVICE_VAR not in environ(pid), cmdline(pid)
    finally:
        go.touch()
        t.join(timeout=30)
    assert result == [(0, "x y'z\n")]


# ---- secrets on disk, modes ---------------------------------------------------------------------------

@pytest.mark.parametrize("isolation", MODES)
def test_launch_file_loses_the_env_when_the_replica_stops(replicas, isolation):
    backend = replicas.backend(isolation)
    launch = lambda inst: Path(inst.work_dir) / ".durastack" / "launch.json"  # noqa: E731
    stopped = replicas.start(backend, seed_job(1, 0, env={"API_TOKEN": "s3cret-stopped"}, commands=["sleep 300"]))
    assert "s3cret-stopped" in launch(stopped).read_text()  # while it runs: `exec` needs it
    assert backend.exec(stopped, ["sh", "-c", "echo $API_TOKEN"]) == (0, "s3cret-stopped\n")
    backend.stop(stopped, grace_seconds=2)
    ended = replicas.start(backend, seed_job(2, 1, env={"API_TOKEN": "s3cret-ended"}, commands=["true"]))
    wait_until(lambda: backend.status(ended).state == "exited", what="exit")
    for inst, value in ((stopped, "s3cret-stopped"), (ended, "s3cret-ended")):
        text = launch(inst).read_text()
        assert value not in text and json.loads(text)["env"] == {}
        assert not any(value in p.read_text(errors="replace") for p in Path(inst.work_dir).rglob("*")
                       if p.is_file() and p.name != "replica.log")


def test_home_and_replica_files_are_private(replicas):
    replicas.home.mkdir(mode=0o755)
    backend = replicas.backend(None)
    assert replicas.home.stat().st_mode & 0o777 == 0o700
    inst = replicas.start(backend, seed_job(1, 0, env={"API_TOKEN": "x"}, commands=["sleep 300"]))
    meta = Path(inst.work_dir) / ".durastack"
    for path in (Path(inst.log_path), meta / "launch.json", meta / "instance.json"):
        assert path.stat().st_mode & 0o077 == 0, path


def test_server_banner_says_whether_replicas_are_confined(tmp_path):
    from cli.stack import _replicas_line
    from models.settings import Settings
    line = _replicas_line(Settings.from_env({"DURASTACK_HOME": str(tmp_path)}))
    assert line.startswith(f"{isolation_reason()}; {confinement_reason()}; {network_reason()}; ")
    assert line.endswith(Cgroups().reason or "and a process cap")
    assert ("confinement on" in line) == confinement_available()
    off = _replicas_line(Settings.from_env({"DURASTACK_HOME": str(tmp_path), "DURASTACK_LOCAL_REPLICAS": "off"}))
    assert off.startswith("local replicas off")


def test_confinement_reason_says_why_not_when_isolation_is_off(monkeypatch):
    monkeypatch.setenv("DURASTACK_LOCAL_ISOLATION", "off")
    assert not confinement_available()
    assert confinement_reason().startswith("confinement off: replicas run as this user")
