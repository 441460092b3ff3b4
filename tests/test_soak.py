"""A month in the life of one service, on the time-skipping server (`make test-long`).

One ServiceRunWorkflow with two groups — ``router``, a fixed count that an in-place apply changes now
and then, and ``decode``, autoscaled with the spec's real delays (5 min up, 10 min down) — lives 30
virtual days of a daily traffic curve (busy weekdays, quieter weekends, nights at 0 rps so that decode
scales to zero and back), manual ``scale`` overrides of decode, two rollouts and replica crashes.
Then what must hold after a month: every run stayed under the continue-as-new threshold, the decision
log is whole (seq 1..N, every day) and holds exactly the scaling decisions the autoscaler's pure
functions predict for the curve, no replica was provisioned twice or left running, both rollouts
completed.

Virtual time is cheap only while nothing runs: the fakes poll (tests/fakes/cloud.py), replicas' watches
hourly and the stats watcher at each hourly traffic change, and the safety tick is coarse. Replicas
outlive the service's hops, which leaks the test server's time-skipping locks, and the test server
sometimes half-closes a run whose continue-as-new races a replica's report: ``ChildLocks``
(tests/fakes/timeskip.py) gives those locks back. ``-s`` prints the figures and each step as it is played.
"""

from __future__ import annotations

import heapq
import re
import time
from datetime import datetime, timedelta

import pytest

from cli.control import ask
from models.loader import load_config_text
from models.messages import ApplyRequest, ScaleRequest
from models.state import ServiceState
from models.views import Event, ServiceStatus
from models.service import ServiceConfiguration
from tests.conftest import eventually, last_run_result, run_histories
from tests.fakes.cloud import FakeCloud, fake_cloud_worker
from tests.fakes.timeskip import ChildLocks, sleep_watched
from rules.autoscaler import GroupScaler
from rules.names import REPLICA_CHANGED
from workflows.service import ServiceRunInput, ServiceRunWorkflow, service_workflow_id

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.long]

NAME = "soak"
SERVICE = """
type: service
name: soak
port: 8000
replicas:
  - name: router
    count: {router}
    commands: [serve router {router_v}]
  - name: decode
    count: 0..3
    scaling: {{metric: rps, target: 2}}
    commands: [serve decode {decode_v}]
"""
DAYS = 30
# Requests per second by hour of day on a weekday: nights at 0, a busy day. Weekends get half.
DAILY = [0, 0, 0, 0, 0, 0, 1, 3, 5, 8, 8, 8, 6, 8, 8, 7, 8, 5, 3, 2, 2, 2, 1, 0]
WEEKEND = (5, 6)  # days since the start, modulo 7
HISTORY_LIMIT = 2000
# The continue-as-new check runs when the loop waits; the pass before it and the hop itself (cancel the
# stats watcher, a 1 s wait, drain handlers, the ContinuedAsNew event) add a few events past the limit.
# A run past the limit also waits for its replicas to settle (the last replica report), up to twice the limit.
HOP_SLACK = 100


def at(day: int, hour: int, minute: int = 0) -> timedelta:
    return timedelta(days=day, hours=hour, minutes=minute)


# What happens when (since the start): manual scales of decode, router counts (in-place applies),
# rollouts (new commands: router version, decode version), crashes of one replica of a group.
STEPS: list[tuple[timedelta, str, object]] = [
    (at(1, 10, 20), "scale", 1),       # busy: 3 → 1 by hand; the autoscaler takes it back after the up-delay
    (at(2, 14, 40), "crash", "router"),
    (at(3, 9, 40), "count", 2),
    (at(4, 11, 10), "crash", "decode"),
    (at(6, 3, 20), "scale", 2),        # a weekend night: 0 → 2 by hand, back to 0 after the down-delay
    (at(8, 17, 57), "scale", 1),       # three minutes before traffic drops: the drop is held (a `hold` event)
    (at(10, 14, 30), "rollout", ("v0", "v1")),
    (at(12, 20, 15), "crash", "decode"),
    (at(13, 16, 40), "count", 3),
    (at(15, 8, 30), "crash", "router"),
    (at(20, 11, 30), "rollout", ("v2", "v2")),
    (at(22, 8, 40), "count", 1),
    (at(25, 19, 10), "crash", "decode"),
    (at(27, 10, 5), "crash", "router"),
]


def traffic(start: datetime):
    def rps_at(t: datetime) -> tuple[float, datetime]:
        hours = int((t - start) // timedelta(hours=1))
        day, hour = divmod(hours, 24)
        return DAILY[hour] * (0.5 if day % 7 in WEEKEND else 1.0), start + timedelta(hours=hours + 1)
    return rps_at


def config(router: int = 1, router_v: str = "v0", decode_v: str = "v0") -> ServiceConfiguration:
    loaded = load_config_text(SERVICE.format(router=router, router_v=router_v, decode_v=decode_v))
    assert loaded.config is not None, loaded.errors
    return loaded.config


def expected_decode_scales(spec: ServiceConfiguration, start: datetime, end: datetime,
                           manual: dict[datetime, int]) -> tuple[list[tuple[datetime, str]], list[datetime]]:
    """The decode group's scaling decisions over the month, from the autoscaler's pure functions, and when a
    reading finds a decision held by a delay (a `hold` event).

    As the workflow sees the world: each hourly change one second after the hour (the fake stats watcher
    looks then), each held decision when its delay ends, and the manual overrides (which reset the delays).
    """
    group = spec.group("decode")
    assert group is not None and group.scaling is not None
    scaler = GroupScaler.of(group)
    rps_at = traffic(start)
    queue: list[tuple[datetime, int, int]] = [(start + timedelta(hours=h, seconds=1), 1, -1) for h in range(DAYS * 24)]
    queue += [(t, 0, count) for t, count in manual.items()]
    heapq.heapify(queue)
    desired, last, rps, span = scaler.lo, None, None, None
    out: list[tuple[datetime, str]] = []
    holds: list[datetime] = []
    while queue and queue[0][0] < end:
        t, kind, count = heapq.heappop(queue)
        if kind == 1:
            rps = rps_at(t)[0]
        elif kind == 0:
            if count != desired:
                out.append((t, f"{desired} → {count} (manual scale)"))
            desired, last, span = count, t, None
        if rps is None:
            continue
        span = scaler.below(span, desired, rps, t)
        d = scaler.decide(desired, rps, last, t, span, steady=True)
        if kind == 1 and "delay" in d.reason:
            holds.append(t)
        if d.new != desired:
            out.append((t, f"{desired} → {d.new}: {d.reason}"))
            desired, last, span = d.new, t, scaler.below(None, d.new, rps, t)
        wait = scaler.next_check(desired, rps, last, span)
        if wait is not None and last is not None and last + timedelta(seconds=wait) > t:
            heapq.heappush(queue, (last + timedelta(seconds=wait), 2, -1))
    return out, holds


@pytest.fixture
async def cloud(ts_env_alone):
    async for fake in fake_cloud_worker(ts_env_alone):
        yield fake


async def status_of(handle) -> ServiceStatus:
    """As the CLI asks: again while a query meets the run's continue-as-new hop."""
    return await ask(handle, ServiceRunWorkflow.status)


def group_of(status: ServiceStatus, name: str):
    return next(g for g in status.groups if g.name == name)


async def settled(handle, group: str, count: int) -> ServiceStatus | None:
    """``count`` replicas of ``group`` serve, all on the current deployment, none rolling or stopping."""
    status = await status_of(handle)
    g = group_of(status, group)
    serving = [r for r in g.replicas if r.ready and r.status == "running"]
    return status if len(serving) == count and not g.rollout and all(
        r.deployment == status.deployment for r in serving) and not any(
        r.status in ("terminating", "submitted", "provisioning") for r in g.replicas) else None


async def test_a_month_of_traffic_rollouts_and_crashes(ts_env_alone, cloud: FakeCloud):
    env, wall = ts_env_alone, time.monotonic()
    start = await env.get_current_time()
    cloud.polling, cloud.poll_every, cloud.clock, cloud.traffic = True, timedelta(hours=1), env.get_current_time, \
        traffic(start)
    handle = await env.client.start_workflow(
        ServiceRunWorkflow.run,
        # Long heartbeat timeouts: skipped virtual time must not time out the fakes' real-time heartbeats.
        ServiceRunInput(state=ServiceState(name=NAME, config=config()), safety_tick_seconds=6 * 3600,
                        history_limit=HISTORY_LIMIT, heartbeat_seconds=86400),
        id=service_workflow_id(NAME), task_queue=cloud.queue)
    # Replicas outlive the service's hops: give back the time-skipping locks the test server leaks for them.
    async with ChildLocks(env, lambda: {f"service/{rid}" for rid, st in cloud.instances.items()
                                        if st == "terminated"}, parents=[handle.id]) as locks:
        manual, crashed = await live_a_month(env, handle, cloud, start, locks)
        await check_month_end(handle, cloud, crashed)
        await handle.signal(ServiceRunWorkflow.stop)
        assert await last_run_result(env.client, handle.id, timeout=120) == "stopped"
    assert locks.error is None, locks.error
    assert cloud.running() == set() and cloud.routed == set()

    # Every run stayed under the continue-as-new threshold, and the service hopped through several.
    runs = await run_histories(env.client, handle.id)
    sizes = [len(history.events) for history in runs]
    assert len(runs) >= 3, sizes
    for history in runs[:-1]:  # the last run ends with the stop, not a hop
        assert len(history.events) <= hop_due(history) + HOP_SLACK, (sizes, hop_due(history))
    log = check_decision_log(cloud, start, manual, crashed)
    print(f"\nsoak: {DAYS} virtual days in {time.monotonic() - wall:.1f} s wall; {len(runs)} runs, events per run "
          f"{sizes} (max {max(sizes)}, limit {HISTORY_LIMIT}); {len(log)} events in the decision log; "
          f"{len(cloud.provisions)} replica submissions, {len(crashed)} crashes; "
          f"{len(locks.given_back)} test-server locks given back")


def hop_due(history) -> int:
    """The event after which a run should have continued as new: past the limit, once no replica was between two
    steps (the last replica report before the hop settled them), and at twice the limit regardless."""
    reports = [i for i, e in enumerate(history.events, 1) if e.HasField("workflow_execution_signaled_event_attributes")
               and e.workflow_execution_signaled_event_attributes.signal_name == REPLICA_CHANGED]
    return min(2 * HISTORY_LIMIT, max([HISTORY_LIMIT, *reports]))


async def live_a_month(env, handle, cloud: FakeCloud, start: datetime,
                      locks: ChildLocks) -> tuple[dict[datetime, int], list[str]]:
    """Play STEPS at their virtual times; returns the manual scales (when → count) and the crashed replicas."""
    versions, manual, crashed = ("v0", "v0"), {}, []
    def open_ids() -> list[str]:
        return [handle.id] + [f"service/{rid}" for rid, st in cloud.instances.items() if st == "running"]

    for offset, kind, value in STEPS:
        await sleep_watched(env, start + offset - await env.get_current_time(), open_ids, locks.unstick)
        print(f"soak: day {offset.days} {offset.seconds // 3600:02}:{offset.seconds // 60 % 60:02} {kind} {value}",
              flush=True)
        if kind == "scale":
            manual[await env.get_current_time()] = value
            assert await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="decode", count=value)) \
                == value
        elif kind == "crash":
            rid = sorted(r for r in cloud.running() if r.split("/")[1] == value)[0]
            crashed.append(rid)
            cloud.crash[rid].set()
        else:
            router = value if kind == "count" else group_of(await status_of(handle), "router").desired
            versions = value if kind == "rollout" else versions
            result = await handle.execute_update(ServiceRunWorkflow.apply,
                                                 ApplyRequest(config=config(router, *versions).model_dump(mode="json")))
            assert (result.replacing > 0) == (kind == "rollout"), result  # a count change restarts nothing
            await eventually(lambda: settled(handle, "router", router))
            decode = group_of(await status_of(handle), "decode").desired
            await eventually(lambda: settled(handle, "decode", decode))
    await sleep_watched(env, start + timedelta(days=DAYS) - await env.get_current_time(), open_ids,
                        locks.unstick)
    return manual, crashed


async def check_month_end(handle, cloud: FakeCloud, crashed: list[str]) -> None:
    """What runs is what the service wants, each replica submission provisioned once, on the last deployment."""
    status = await eventually(lambda: _all_settled(handle))
    running = cloud.running()
    for g in status.groups:
        mine = {r for r in running if r.split("/")[1] == g.name}
        assert len(mine) == g.desired, (g.name, mine)
        assert {f"{NAME}/{g.name}/r{r.replica}-s{r.submission}" for r in g.replicas if r.status == "running"} == mine
        assert all(cloud.commands[rid] == [f"serve {g.name} v2"] for rid in mine)
    assert cloud.routed == running
    assert all(n == 1 for n in cloud.provisions.values()), "a replica submission was provisioned twice"
    for rid in crashed:  # each crashed replica was torn down, then replaced in its group
        gone = cloud.log.index(("terminate", rid))
        group = rid.split("/")[1]
        assert any(op == "provision" and r.split("/")[1] == group for op, r in cloud.log[gone:]), rid


def check_decision_log(cloud: FakeCloud, start: datetime, manual: dict[datetime, int], crashed: list[str]) -> list[Event]:
    """The store's decision log: whole (seq 1..N), every day, exactly the decisions the autoscaler predicts."""
    log: list[Event] = [cloud.log_by_seq[seq] for seq in sorted(cloud.log_by_seq)]
    assert [e.seq for e in log] == list(range(1, len(log) + 1))
    assert [e.at for e in log] == sorted(e.at for e in log)
    assert {int((e.at - start) // timedelta(days=1)) for e in log} == set(range(DAYS + 1))
    assert log[-1].message == "service stopped"
    expected, holds = expected_decode_scales(config(), start, start + timedelta(days=DAYS), manual)
    seen = [(e.at, e.message.split(";")[0]) for e in log if e.kind == "scale" and e.group == "decode"]
    assert [m for _, m in seen] == [m for _, m in expected]
    late = [(s, x) for s, x in zip(seen, expected) if abs(s[0] - x[0]) > timedelta(seconds=10)]
    assert not late, late[:5]
    assert any(m.endswith(": from zero") for _, m in seen) and any(m.startswith("1 → 0") for _, m in seen)
    # A hold is logged only where a reading finds a delay running: a manual override's, or a drop in traffic that
    # must last the down-delay; the one on day 8 is the traffic drop at 18:00, 3 minutes after a manual scale.
    held = [e.at for e in log if e.kind == "hold" and e.group == "decode"]
    assert all(any(abs(h - t) < timedelta(seconds=10) for t in holds) for h in held), held
    assert any(abs(h - (start + at(8, 18) + timedelta(seconds=1))) < timedelta(seconds=10) for h in held), held
    # The router's counts and the rollouts (one apply each, after the submission), and the crashes.
    applies = [e for e in log if e.kind == "apply"]
    assert len(applies) == 1 + sum(1 for _, kind, _ in STEPS if kind in ("count", "rollout"))
    failures = [e for e in log if e.kind == "replica" and re.search(r"replica \d+ failed: exited \(1\)", e.message)]
    assert len(failures) == len(crashed)
    return log


async def _all_settled(handle) -> ServiceStatus | None:
    status = await status_of(handle)
    for g in status.groups:
        if await settled(handle, g.name, g.desired) is None:
            return None
    return status
