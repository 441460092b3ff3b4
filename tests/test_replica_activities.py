"""A replica's activities on the local backend, with real processes, a fake gateway and a fake Temporal client.

launch (place once, ready, registered; reports seq 1, 2, 3), teardown (unregister, stop; reports 10, 11),
monitor (a dead process or a closed workflow is returned, already unrouted), PlacementRefusal's typed details.
Every replica started here runs in shared mode (its own PORT on 127.0.0.1) and is stopped in teardown.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path
from datetime import datetime, timedelta, timezone

import pytest
from temporalio.client import WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError

from activities import replica as replica_activities
from activities.replica import LocalReplicas, ReplicaActivities
from activities.report import unless_quick
from backends.local import LocalBackend
from models.failures import NOT_READY_YET
from models.loader import load_config_text
from models.replica import LocalInstance
from models.failures import NOT_READY_YET
from models.messages import (Down, LaunchInput, LaunchStep, MonitorInput, PlacementRefusal, ReplicaInput, Step, TeardownInput,
    Watched)
from tests.conftest import eventually
from tests.fakes.activity_env import FakeClient, FakeGateway, activity_env as _env, refusal_of
from rules.jobs import replica_input, replica_workflow_id

CONFIG = """
type: service
name: svc
port: 8000
commands: [python3 -m http.server $PORT --bind 127.0.0.1]
"""


@pytest.fixture
def local(tmp_path):
    backend = LocalBackend(tmp_path / "home", isolation=False)
    yield backend
    backend.stop_all(grace_seconds=2)


def _input(replica: int = 0, config: str = CONFIG) -> ReplicaInput:
    parsed = load_config_text(config).config
    return replica_input(parsed, "svc", "service/svc", "0", replica, 0, 1)


def _watched(inp: ReplicaInput, instance: LocalInstance) -> Watched:
    job = inp.job
    return Watched(replica_num=job.replica_num, submission_num=job.submission_num, group=job.group,
                   workflow_id=replica_workflow_id("svc", job.group, job.replica_num, job.submission_num),
                   replica_id=job.replica_id, instance=instance)


async def _launch(acts: ReplicaActivities, client: FakeClient, inp: ReplicaInput):
    return await _env(client).run(acts.launch, LaunchInput(replica=inp, backend="local"))


# --- launch and teardown ----------------------------------------------------------------------------

@pytest.mark.parametrize("quick_seconds", [0, 60])
async def test_launch_places_once_waits_until_ready_registers_and_reports_each_step(local, quick_seconds):
    """Every step is reported, except `provisioning` and `running, not ready` when their step took less than
    ``quick_seconds``."""
    gateway, client = FakeGateway(), FakeClient()
    acts = ReplicaActivities(local, gateway, quick_seconds=quick_seconds)
    inp = _input()
    launched = await _launch(acts, client, inp)
    assert launched.placement.backend == "local" and launched.instance.kind == "local"
    assert local.status(launched.instance).state == "running"
    assert gateway.routed == {inp.job.replica_id: launched.placement.address}
    every = [(1, "provisioning", False, False), (2, "running", False, False), (3, "running", True, True)]
    assert client.reports() == (every if quick_seconds == 0 else every[-1:])
    assert {wf for wf, _, _ in client.signals} == {"service/svc"}
    assert {name for _, name, _ in client.signals} == {"replica_changed"}
    assert client.signals[-1][2].instance == launched.instance  # the service can tear it down itself

    await _env(client).run(acts.teardown, TeardownInput(
        service_workflow_id="service/svc", job=inp.job, backend="local", instance=launched.instance,
        reason="scaled_down"))
    assert gateway.routed == {} and local.status(launched.instance).state != "running"
    assert [(u.seq, u.status, u.reason) for _, _, u in client.signals if u.seq >= 10] == [
        (10, "terminating", "scaled_down"), (11, "terminated", "scaled_down")]


async def test_a_lost_placed_report_is_sent_again_until_the_service_has_it(local):
    """Reports are signals, and a signal can be lost on the way (the service's worker or the server away). The
    `placed` one was sent once: the service then knew nothing of where the replica is for as long as it loaded.
    It is sent again, asked after with the service's `addresses` query, until the service has it."""
    config = CONFIG.replace("commands: [python3 -m http.server $PORT --bind 127.0.0.1]",
                            "commands: [sleep 1, python3 -m http.server $PORT --bind 127.0.0.1]")
    client = FakeClient()
    client.lose_placed = 2
    launched = await _launch(ReplicaActivities(local, FakeGateway(), quick_seconds=0), client, _input(config=config))
    assert client.lose_placed == 0
    assert client.reports() == [(1, "provisioning", False, False), (2, "running", False, False),
                                (3, "running", True, True)]
    assert client.signals[1][2].placement == launched.placement  # told before the app answered


async def test_a_poll_that_gets_no_answer_at_all_is_made_again_soon_its_timeout_doubling(local, monkeypatch):
    asked: list[float] = []

    async def answers(address: str, timeout: float):
        asked.append(timeout)
        if len(asked) == 2:  # nothing answers (a SYN lost while the replica's link came up)
            await asyncio.sleep(timeout)
        return 200 if len(asked) == 3 else None  # the first: refused at once, the app not listening yet

    async def running(instances):
        return [None for _ in instances]

    monkeypatch.setattr(replica_activities, "answers_http", answers)
    replicas = LocalReplicas(local)
    monkeypatch.setattr(replicas, "down", running)
    instance = LocalInstance(replica_id="svc/0/r0-s0", pid=1, start_time=0, work_dir="/x", address="unix:/x.sock",
                             isolated=False, log_path="/x/log")
    await _env(FakeClient()).run(replicas.wait_ready, instance, [])
    first = replica_activities.FIRST_ANSWER_TIMEOUT_SECONDS
    assert asked == [first, first, 2 * first]


async def test_a_retried_launch_reuses_what_an_earlier_attempt_started(local):
    inp = _input()
    earlier = await asyncio.to_thread(local.start, inp.job)  # that attempt's worker died before it returned
    launched = await _launch(ReplicaActivities(local, FakeGateway()), FakeClient(), inp)
    assert launched.instance == earlier
    assert [i.pid for i in local.instances()] == [earlier.pid]


async def test_a_failed_report_never_fails_the_launch(local):
    client = FakeClient()
    client.signals_fail = True  # the service run is gone
    launched = await _launch(ReplicaActivities(local, FakeGateway()), client, _input())
    assert launched.placement.backend == "local"


async def test_an_app_that_exits_before_it_is_ready_fails_the_launch_for_good(local):
    """With its last lines, the env's values masked: what `events` shows of a command that died."""
    config = CONFIG.replace("commands: [python3 -m http.server $PORT --bind 127.0.0.1]",
                            "env: {HF_TOKEN: hf_abcdef}\ncommands: ['echo loading', 'echo \"bad token $HF_TOKEN\" >&2',"
                            " 'exit 3']")
    with pytest.raises(ApplicationError) as failed:
        await _launch(ReplicaActivities(local, FakeGateway()), FakeClient(), _input(config=config))
    assert failed.value.type == "ReplicaExited" and failed.value.non_retryable
    assert failed.value.message == "exited (3); last output: loading | bad token ***"


async def test_an_app_never_ready_within_its_startup_timeout_fails_the_launch_for_good(local):
    """A hung load (the app runs, never answers) fails the replica, with why, once its `startup_timeout` is up,
    instead of the launch being retried on and on."""
    config = CONFIG.replace("commands: [python3 -m http.server $PORT --bind 127.0.0.1]",
                            "startup_timeout: 1s\ncommands: [sleep 60]")
    inp = _input(config=config)
    assert inp.startup_timeout == 1
    with pytest.raises(ApplicationError) as failed:
        await asyncio.wait_for(_launch(ReplicaActivities(local, FakeGateway()), FakeClient(), inp), 30)
    assert failed.value.type == "NotReady" and failed.value.non_retryable
    assert failed.value.message == "not ready within 1s (startup_timeout): its probes never passed"


async def test_a_local_launch_is_one_step_unless_its_app_loads_for_longer_than_an_attempt(local, tmp_path,
                                                                                          monkeypatch):
    """The place step of a local replica starts it and makes a first readiness attempt (a process tree starts in
    milliseconds: one activity, not three). An app still loading after that attempt (here 0.3 s) leaves it
    `started`; the readiness step's attempt then ends with a retryable NotReadyYet saying how far it is, and a
    later one, once the app answers, serves it. The process is started once."""
    monkeypatch.setattr(replica_activities, "READY_ATTEMPT_SECONDS", 0.3)
    gate = tmp_path / "loaded"
    config = CONFIG.replace("commands: [python3 -m http.server $PORT --bind 127.0.0.1]",
                            f"commands: [\"while [ ! -e {gate} ]; do sleep 0.05; done\", "
                            "python3 -m http.server $PORT --bind 127.0.0.1]")
    gateway, client = FakeGateway(), FakeClient()
    acts, inp = ReplicaActivities(local, gateway), _input(config=config)
    env = _env(client)
    placed = await env.run(acts.place, LaunchInput(replica=inp, backend="local"))
    assert placed.done == "started" and gateway.routed == {}
    step = LaunchStep(replica=inp, backend="local", launched=placed)
    with pytest.raises(ApplicationError) as loading:
        await env.run(acts.ready, step)
    assert loading.value.type == NOT_READY_YET and not loading.value.non_retryable
    assert loading.value.message == "not ready: no HTTP answer yet" and gateway.routed == {}
    gate.touch()
    await env.run(acts.ready, step)
    assert gateway.routed == {inp.job.replica_id: placed.placement.address}
    assert local.find(inp.job).pid == placed.instance.pid  # started once
    assert client.reports()[-1] == (Step.SERVING, "running", True, True)
    # An app that answers at once: the place step serves it.
    quick = await env.run(acts.place, LaunchInput(replica=_input(replica=1), backend="local"))
    assert quick.done == "serving" and _input(replica=1).job.replica_id in gateway.routed


async def test_teardown_without_an_instance_stops_what_a_dead_launch_started(local):
    gateway, client = FakeGateway(), FakeClient()
    inp = _input()
    started = await asyncio.to_thread(local.start, inp.job)
    teardown = TeardownInput(service_workflow_id="service/svc", job=inp.job, backend="local", instance=None,
                             reason="exited (1)", final="failed")
    for _ in range(2):  # idempotent: the workflow retries it until it succeeds
        await _env(client).run(ReplicaActivities(local, gateway).teardown, teardown)
    assert local.status(started).state != "running"
    assert [(u.seq, u.status) for _, _, u in client.signals] == [(10, "terminating"), (11, "failed")] * 2
    assert [c[0] for c in gateway.calls] == ["unregister", "unregister"]


async def test_a_step_is_reported_only_once_it_outlasts_the_quick_delay():
    sent = asyncio.Event()

    async def send() -> None:
        sent.set()

    await unless_quick(60, send)()  # the step ended at once: nothing sent, nothing left pending
    assert not sent.is_set()
    settle = unless_quick(0.01, send)
    await asyncio.wait_for(sent.wait(), 10)  # the step goes on: its report goes out meanwhile
    await settle()


# --- PlacementRefusal -------------------------------------------------------------------------------------

async def test_a_machine_that_does_not_fit_raises_no_capacity_with_typed_details(local):
    client = FakeClient()
    inp = _input(config=CONFIG + "resources:\n  cpu: 100000\n")
    with pytest.raises(ApplicationError) as refused:
        await _launch(ReplicaActivities(local, FakeGateway(), quick_seconds=0), client, inp)
    details = refusal_of(refused.value)
    assert details.backend == "local" and not details.tried
    assert len(details.reasons) == 1 and "this machine does not fit" in details.reasons[0]
    assert local.find(inp.job) is None  # nothing was started
    assert client.reports() == [(1, "provisioning", False, False)]


async def test_a_worker_without_local_replicas_never_starts_one(local):
    acts = ReplicaActivities(local, FakeGateway(), local_replicas=False)
    with pytest.raises(ApplicationError) as refused:
        await _launch(acts, FakeClient(), _input())
    assert "DURASTACK_LOCAL_REPLICAS=off" in refusal_of(refused.value).reasons[0]
    assert local.find(_input().job) is None


async def test_a_backend_this_worker_does_not_serve_is_no_capacity_too(local):
    with pytest.raises(ApplicationError) as refused:
        await _env(FakeClient()).run(ReplicaActivities(local, FakeGateway()).launch,
                                     LaunchInput(replica=_input(), backend="aws"))
    assert refusal_of(refused.value) == PlacementRefusal(backend="aws", tried=False,
                                                     reasons=["backend aws is not served by this worker"])


# --- monitor ----------------------------------------------------------------------------------------

async def test_a_killed_replica_is_down_and_unrouted_within_a_second(local):
    gateway, client = FakeGateway(), FakeClient()
    acts = ReplicaActivities(local, gateway)
    inputs = [_input(n) for n in range(2)]
    launched = [await _launch(acts, client, inp) for inp in inputs]
    watched = [_watched(inp, li.instance) for inp, li in zip(inputs, launched)]
    monitor = asyncio.ensure_future(_env(client).run(acts.monitor, MonitorInput(
        service="svc", backend="local", replicas=watched, poll_seconds=0.2)))
    await asyncio.sleep(0.5)
    assert not monitor.done()  # both serve: it keeps watching
    killed = time.monotonic()
    os.kill(launched[1].instance.pid, signal.SIGKILL)
    down = await asyncio.wait_for(monitor, 10)
    returned = time.monotonic()
    assert [(d.replica_num, d.workflow_closed) for d in down] == [(1, False)]
    assert returned - killed < 1.5, returned - killed
    unrouted = [c for c in gateway.calls if c[0] == "unregister"]
    assert [c[1] for c in unrouted] == [inputs[1].job.replica_id] and unrouted[0][2] <= returned
    assert list(gateway.routed) == [inputs[0].job.replica_id]


async def test_a_closed_replica_workflow_is_down_with_workflow_closed(local):
    gateway, client = FakeGateway(), FakeClient()
    acts = ReplicaActivities(local, gateway)
    inputs = [_input(n) for n in range(3)]
    launched = [await _launch(acts, client, inp) for inp in inputs]
    watched = [_watched(inp, li.instance) for inp, li in zip(inputs, launched)]
    client.statuses[watched[0].workflow_id] = WorkflowExecutionStatus.TERMINATED
    client.statuses[watched[2].workflow_id] = None  # not found at all
    down = await asyncio.wait_for(_env(client).run(acts.monitor, MonitorInput(
        service="svc", backend="local", replicas=watched, poll_seconds=0.2, workflow_check_seconds=0.2)), 10)
    assert down == [Down(replica_num=0, submission_num=0, reason="replica workflow terminated", workflow_closed=True),
                    Down(replica_num=2, submission_num=0, reason="replica workflow not found", workflow_closed=True)]
    assert list(gateway.routed) == [inputs[1].job.replica_id]
    assert all(local.status(li.instance).state == "running" for li in launched)  # the service tears them down


async def test_a_cancelled_monitor_ends_cleanly(local):
    client = FakeClient()
    acts = ReplicaActivities(local, FakeGateway())
    inp = _input()
    launched = await _launch(acts, client, inp)
    env = _env(client)
    monitor = asyncio.ensure_future(env.run(acts.monitor, MonitorInput(
        service="svc", backend="local", replicas=[_watched(inp, launched.instance)], poll_seconds=0.1)))
    await asyncio.sleep(0.3)
    env.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(monitor, 5)


async def test_a_retried_launch_whose_app_exited_fails_rather_than_start_it_again(local):
    inp = _input(config=CONFIG.replace("python3 -m http.server $PORT --bind 127.0.0.1", "exit 4"))
    earlier = await asyncio.to_thread(local.start, inp.job)
    await eventually(lambda: _exited(local, earlier), timeout=10)
    with pytest.raises(ApplicationError) as failed:
        await _launch(ReplicaActivities(local, FakeGateway()), FakeClient(), inp)
    assert failed.value.type == "ReplicaExited" and failed.value.message.startswith("exited (4)")
    assert local.find(inp.job) == earlier  # not started a second time


async def test_a_record_left_by_an_earlier_service_of_the_same_name_is_not_this_launch(local):
    inp = _input()
    stale = await asyncio.to_thread(local.start, inp.job)
    await asyncio.to_thread(local.stop, stale, 2)  # that service was stopped; its work dir stays, for its logs
    env = _env(FakeClient())
    # This launch was first scheduled after that record was made (beyond the tolerated clock skew).
    env.info = dataclasses.replace(env.info, scheduled_time=datetime.now(timezone.utc) + timedelta(seconds=60))
    launched = await env.run(ReplicaActivities(local, FakeGateway()).launch, LaunchInput(replica=inp, backend="local"))
    assert launched.instance.pid != stale.pid and local.status(launched.instance).state == "running"


async def _exited(local: LocalBackend, instance: LocalInstance) -> bool:
    return local.status(instance).state != "running"


async def test_a_monitor_heartbeats_every_third_of_its_heartbeat_timeout_not_every_poll(local):
    client = FakeClient()
    acts = ReplicaActivities(local, FakeGateway())
    inp = _input()
    launched = await _launch(acts, client, inp)
    env, beats = _env(client, heartbeat_timeout=0.6), []
    env.on_heartbeat = lambda *details: beats.append(details)
    monitor = asyncio.ensure_future(env.run(acts.monitor, MonitorInput(
        service="svc", backend="local", replicas=[_watched(inp, launched.instance)], poll_seconds=0.02,
        workflow_check_seconds=0.02)))
    await asyncio.sleep(1.0)  # 50 polls, about 5 heartbeats
    env.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(monitor, 5)
    assert 3 <= len(beats) <= 8, beats


async def test_a_retried_launch_starts_again_a_replica_whose_setup_never_finished(tmp_path):
    """A worker killed between spawning an isolated replica and linking it into its service's network left it to
    give up (exit 125) before the retry came: its commands never ran, so the retry starts it again rather than
    fail the replica (seen in a rolling update whose worker was killed, under load)."""
    from backends.local import isolation_available
    from backends.local_cgroup import Limits
    if not isolation_available():
        pytest.skip("replicas are not isolated on this machine (not root)")
    local = LocalBackend(tmp_path / "home")
    try:
        inp = _input()
        earlier = await asyncio.to_thread(local.start, inp.job)
        await asyncio.to_thread(local.stop, earlier)
        (Path(earlier.work_dir) / ".durastack" / "ns_ready").unlink(missing_ok=True)  # as if never set up
        assert local.never_ran(earlier)
        replicas = ReplicaActivities(local, FakeGateway()).local  # a retry of the launch that recorded `earlier`
        again = await asyncio.to_thread(replicas._start_once, inp.job, 0.0, False, Limits())
        assert again.pid != earlier.pid and local.status(again).state == "running"
    finally:
        local.stop_all(grace_seconds=2)


async def test_a_retried_launch_finishes_the_setup_of_a_replica_still_running(tmp_path):
    """A worker killed after spawning a replica but before linking it to the gateway left it running, unreachable:
    the retry adopts it (the same process, its commands not run twice) and finishes its setup, rather than wait
    for it to answer forever (seen in a rolling update whose worker was killed, under load)."""
    from backends.local_cgroup import Limits
    local = LocalBackend(tmp_path / "home")
    try:
        inp = _input()
        earlier = await asyncio.to_thread(local.start, inp.job)
        setups = []
        start = local.start
        local.start = lambda *a: setups.append(a) or start(*a)
        replicas = ReplicaActivities(local, FakeGateway()).local  # a retry of the launch that recorded `earlier`
        again = await asyncio.to_thread(replicas._start_once, inp.job, 0.0, False, Limits())
        assert again.pid == earlier.pid and local.status(again).state == "running"
        assert len(setups) == 1
        await asyncio.to_thread(local.stop, earlier)
        again = await asyncio.to_thread(replicas._start_once, inp.job, 0.0, False, Limits())
        assert again.pid == earlier.pid and len(setups) == 1  # exited after it ran: reported, not run twice
    finally:
        local.stop_all(grace_seconds=2)

