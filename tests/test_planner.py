"""The pure planner: replica numbering, reuse, removal order, removed groups, back-off, pruning."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from models.loader import load_config_text
from models.state import GroupState, Placement, Replica, ServiceState
from rules.planner import (FAILURE_MEMORY, KEEP_FINISHED, Start, Stop, backoff_until, count_failure, prune,
                               reconcile, removal_order, sync_groups)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)

CONFIG = """
type: service
name: svc
port: 8000
replicas:
  - name: a
    count: {a}
    commands: [x]
  - name: b
    count: {b}
    scaling: {{metric: rps, target: 1}}
    commands: [y]
"""


def state(a="2", b="1..4", replicas=(), desired=None, next_num=0) -> ServiceState:
    config = load_config_text(CONFIG.format(a=a, b=b)).config
    st = ServiceState(name="svc", config=config, replicas=list(replicas), next_replica_num=next_num)
    st.groups = sync_groups(config, {})
    for name, n in (desired or {}).items():
        st.groups[name].desired = n
    return st


def replica(num, group, status="running", sub=0, ready=True, registered=True, deployment=0, **kw) -> Replica:
    return Replica(replica_num=num, submission_num=sub, group=group, status=status, ready=ready,
                   registered=registered, deployment_num=deployment, submitted_at=NOW, **kw)


def test_first_pass_walks_groups_in_order_with_run_global_numbers():
    plan = reconcile(state(), NOW)
    assert plan.start == [Start("a", 0, 0), Start("a", 1, 0), Start("b", 2, 0)]
    assert plan.stop == []


def test_nothing_to_do_when_counts_match():
    st = state(replicas=[replica(0, "a"), replica(1, "a"), replica(2, "b")], next_num=3)
    assert not reconcile(st, NOW)


def test_scale_up_reuses_own_inactive_numbers_then_allocates():
    st = state(replicas=[replica(0, "a"), replica(1, "a"), replica(2, "b"),
                         replica(3, "b", status="terminated"), replica(4, "a", status="terminated")],
               desired={"b": 3}, next_num=5)
    plan = reconcile(st, NOW)
    # Group b reuses its own replica 3 (new submission), never a's replica 4, then takes 5.
    assert plan.start == [Start("b", 3, 1), Start("b", 5, 0)]


def test_scale_down_removes_least_important_then_newest():
    st = state(replicas=[replica(2, "b"), replica(3, "b"), replica(4, "b", status="provisioning"),
                         replica(5, "b", ready=False), replica(0, "a"), replica(1, "a")],
               desired={"b": 2}, next_num=6)
    plan = reconcile(st, NOW)
    assert plan.stop == [Stop(5, 0, "scaled_down"), Stop(4, 0, "scaled_down")]
    st.groups["b"].desired = 1
    # Among the serving ones, the newest goes; replica 2 stays.
    assert {s.replica_num for s in reconcile(st, NOW).stop} == {3, 4, 5}


def test_removal_order_puts_out_of_date_replicas_last():
    old = replica(1, "b", deployment=0)
    new = replica(7, "b", deployment=1, ready=False)
    assert removal_order([old, new], deployment_num=1) == [new, old]


def test_replicas_being_stopped_do_not_count_as_active():
    st = state(replicas=[replica(0, "a"), replica(1, "a", stop_requested=True), replica(2, "b")], next_num=3)
    plan = reconcile(st, NOW)
    assert plan.start == [Start("a", 1, 1)]  # its number is reused by a new submission at once


def test_removed_group_replicas_are_stopped():
    st = state(replicas=[replica(0, "a"), replica(1, "a"), replica(2, "b"), replica(3, "gone")], next_num=4)
    assert reconcile(st, NOW).stop == [Stop(3, 0, "group removed")]


def test_backoff_blocks_resubmission_until_due():
    st = state(replicas=[replica(0, "a"), replica(1, "a", status="failed"), replica(2, "b")], next_num=3)
    st.groups["a"].failures = 2  # the first failure is replaced at once; the second in a row waits
    st.groups["a"].retry_after = backoff_until(st.groups["a"], NOW)
    assert st.groups["a"].retry_after == NOW + timedelta(seconds=15)
    assert not reconcile(st, NOW + timedelta(seconds=10))
    assert reconcile(st, NOW + timedelta(seconds=15)).start == [Start("a", 1, 1)]


def test_backoff_grows_and_caps():
    group = GroupState(name="a", desired=1, failures=9)
    assert backoff_until(group, NOW) == NOW + timedelta(minutes=10)
    assert backoff_until(GroupState(name="a", desired=1), NOW) is None
    assert backoff_until(GroupState(name="a", desired=1, failures=1), NOW) is None


def test_failures_count_in_a_row_only_when_close_together():
    group = GroupState(name="a", desired=1)
    count_failure(group, NOW)
    assert (group.failures, group.retry_after) == (1, None)
    count_failure(group, NOW + timedelta(minutes=1))
    assert (group.failures, group.retry_after) == (2, NOW + timedelta(minutes=1, seconds=15))
    ended = group.retry_after
    count_failure(group, ended + FAILURE_MEMORY)
    assert (group.failures, group.retry_after) == (3, ended + FAILURE_MEMORY + timedelta(seconds=30))
    count_failure(group, group.retry_after + FAILURE_MEMORY + timedelta(seconds=1))
    assert (group.failures, group.retry_after) == (1, None)  # long after its back-off ended: not in a row


def test_sync_groups_keeps_desired_within_new_range_and_adds_new_groups():
    st = state(desired={"b": 4})
    config = load_config_text(CONFIG.format(a="3", b="1..2")).config
    groups = sync_groups(config, st.groups)
    assert groups["a"].desired == 3 and groups["b"].desired == 2


def test_prune_keeps_latest_submission_and_bounds_finished_rows():
    rows = [replica(0, "a", status="terminated", sub=0, finished_at=NOW), replica(0, "a", sub=1)]
    rows += [replica(i, "b", status="terminated", finished_at=NOW + timedelta(seconds=i)) for i in range(1, 80)]
    kept = prune(rows)
    assert replica(0, "a", sub=1) in kept and not any(r.replica_num == 0 and r.submission_num == 0 for r in kept)
    finished = [r for r in kept if r.finished]
    assert len(finished) == KEEP_FINISHED and min(r.replica_num for r in finished) == 80 - KEEP_FINISHED


# --- rolling deployment -----------------------------------------------------------------

def rolling_state(replicas, desired=2, dep=1, failed=""):
    st = state(a="2", b="1..4", replicas=replicas, desired={"a": desired, "b": 1}, next_num=10)
    st.deployment_num = dep
    st.groups["a"].rollout_failed = failed
    return st


def test_roll_surges_one_and_stops_nothing_while_old_replicas_serve():
    st = rolling_state([replica(0, "a", deployment=0), replica(1, "a", deployment=0), replica(2, "b", deployment=1)])
    plan = reconcile(st, NOW)
    assert plan.start == [Start("a", 10, 0)] and plan.stop == []


def test_roll_stops_one_old_replica_once_a_new_one_serves():
    st = rolling_state([replica(0, "a", deployment=0), replica(1, "a", deployment=0),
                        replica(10, "a", deployment=1), replica(2, "b", deployment=1)])
    plan = reconcile(st, NOW)
    assert plan.start == [] and plan.stop == [Stop(1, 0, "replaced")]  # out of date, newest first


def test_roll_waits_while_a_new_replica_is_not_ready():
    st = rolling_state([replica(0, "a", deployment=0), replica(1, "a", deployment=0),
                        replica(10, "a", deployment=1, ready=False), replica(2, "b", deployment=1)])
    assert not reconcile(st, NOW)


def test_roll_counts_terminating_replicas_against_the_surge():
    st = rolling_state([replica(0, "a", deployment=0), replica(1, "a", deployment=0, stop_requested=True),
                        replica(10, "a", deployment=1), replica(2, "b", deployment=1)])
    assert not reconcile(st, NOW)  # 3 unfinished = desired + 1: wait for replica 1 to end


def test_roll_stops_old_replicas_that_serve_nobody_at_once():
    st = rolling_state([replica(0, "a", deployment=0), replica(1, "a", deployment=0, status="provisioning"),
                        replica(2, "b", deployment=1)])
    plan = reconcile(st, NOW)
    assert Stop(1, 0, "replaced") in plan.stop and plan.start == [Start("a", 10, 0)]


def test_failed_rollout_touches_nothing():
    st = rolling_state([replica(0, "a", deployment=0), replica(1, "a", deployment=0), replica(2, "b", deployment=1)],
                       failed="exited (1)")
    assert not reconcile(st, NOW)


def test_groups_roll_independently_and_up_to_date_groups_scale():
    st = rolling_state([replica(0, "a", deployment=0), replica(1, "a", deployment=0), replica(2, "b", deployment=1)])
    st.groups["b"].desired = 2
    plan = reconcile(st, NOW)
    assert Start("a", 10, 0) in plan.start and Start("b", 11, 0) in plan.start


def test_classify_changes_and_spec_hash():
    from rules.changes import classify, spec_hash
    old = load_config_text(CONFIG.format(a="2", b="1..4")).config
    counts = load_config_text(CONFIG.format(a="3", b="1..4")).config
    assert classify(old, counts).in_place == ["groups.a.count"] and not classify(old, counts).rolling
    assert spec_hash(old, "a") == spec_hash(counts, "a")  # a count change restarts nothing
    commands = load_config_text(CONFIG.format(a="2", b="1..4").replace("[x]", "[x2]")).config
    assert spec_hash(old, "a") != spec_hash(commands, "a") and spec_hash(old, "b") == spec_hash(commands, "b")
    assert classify(old, commands).rolling == ["groups.a.commands"]  # names the group that rolls
    fewer = old.model_copy(update={"groups": old.groups[:1]})
    assert classify(old, fewer).in_place == ["groups.b (removed)"] and classify(fewer, old).in_place == [
        "groups.b (added)"]
    auth = old.model_copy(update={"auth": False, "env": {"A": "1"}})
    changes = classify(old, auth)
    assert changes.not_updatable == ["auth"] and changes.rolling == ["env"]


def test_renamed_group_starts_new_replicas_and_drops_the_old_ones():
    st = rolling_state([replica(0, "a", deployment=1), replica(1, "a", deployment=1),
                        replica(2, "old-b", deployment=0)], dep=1)
    plan = reconcile(st, NOW)
    assert Stop(2, 0, "group removed") in plan.stop
    assert plan.start == [Start("b", 10, 0)]  # the renamed group "b" starts at its min


def test_reordering_named_groups_changes_no_replica():
    from rules.changes import spec_hash
    before = load_config_text(CONFIG.format(a="2", b="1..4")).config
    swapped = before.model_copy(update={"groups": list(reversed(before.groups))})
    assert all(spec_hash(before, g) == spec_hash(swapped, g) for g in ("a", "b"))


def test_reapplying_mid_rollout_rolls_toward_the_newest_deployment():
    # Deployment 1 replaced replica 0 with 10; deployment 2 arrives: 1 and 10 are both out of date now.
    st = rolling_state([replica(1, "a", deployment=0), replica(10, "a", deployment=1),
                        replica(2, "b", deployment=2)], dep=2)
    st.next_replica_num = 11
    plan = reconcile(st, NOW)
    assert plan.start == [Start("a", 11, 0)] and plan.stop == []
    st.replicas.append(replica(11, "a", deployment=2))
    st.next_replica_num = 12
    # Both older deployments are out of date alike; among equals the newest number goes first.
    assert reconcile(st, NOW).stop == [Stop(10, 0, "replaced")]


# --- router services and replica addresses ---------------------------------------------------------

PD = """
type: service
name: svc
port: 8000
groups:
  - name: router
    replicas: 1
    router: {type: sglang}
    commands: [route]
  - name: decode
    replicas: 1..3
    scaling: {metric: rps, target: 1}
    commands: ["serve --router ${{ groups[router].replicas[0].IP_ADDRESS }}:${{ groups[0].replicas[0].PORT }}"]
"""
ROUTER_IP = "groups[router].replicas[0].IP_ADDRESS"
ROUTER_PORT = "groups[router].replicas[0].PORT"


def pd_state(replicas=(), deployment=0, next_num=0) -> ServiceState:
    config = load_config_text(PD).config
    st = ServiceState(name="svc", config=config, replicas=list(replicas), next_replica_num=next_num,
                      deployment_num=deployment)
    st.groups = sync_groups(config, {})
    return st


def placed(ip: str = "", address: str = "unix:/x") -> Placement:
    return Placement(backend="local", address=address, ip=ip)


def worker(num, **kw) -> Replica:
    return replica(num, "decode", registered=False, routed=False, **kw)


def test_a_ready_old_worker_is_kept_while_its_surge_starts_then_stopped_once_the_new_one_is_ready():
    # Workers behind a router are never registered: a ready one still counts as serving.
    old = worker(1, deployment=0)
    st = pd_state([replica(0, "router", deployment=1, placement=placed("10.0.0.1"), refs={}), old],
                  deployment=1, next_num=2)
    st.groups["decode"].desired = 1
    plan = reconcile(st, NOW)
    assert plan.start == [Start("decode", 2, 0)] and plan.stop == []
    st.replicas.append(worker(2, deployment=1, ready=False, status="provisioning"))
    assert not reconcile(st, NOW)  # the new one is not ready: the old one keeps working
    st.replicas[-1] = worker(2, deployment=1)
    assert reconcile(st, NOW).stop == [Stop(1, 0, "replaced")]


def test_an_old_worker_that_is_not_ready_is_stopped_at_once():
    st = pd_state([replica(0, "router", deployment=1, placement=placed("10.0.0.1")),
                   worker(1, deployment=0, ready=False)], deployment=1, next_num=2)
    plan = reconcile(st, NOW)
    assert plan.start == [Start("decode", 2, 0)] and plan.stop == [Stop(1, 0, "replaced")]


def test_a_reference_waits_for_an_address_with_a_reason():
    plan = reconcile(pd_state(), NOW)
    # The router starts; the worker that names it waits: the router has no replica yet.
    assert plan.start == [Start("router", 0, 0)]
    assert plan.waits == {"decode": "groups[router].replicas[0] has no replica yet (group 'router' has 0 active)"}
    st = pd_state([replica(0, "router", status="provisioning", ready=False)], next_num=1)
    assert "waits for replica 0 to have an address (provisioning)" in reconcile(st, NOW).waits["decode"]
    # Isolated without a service network: a placement, but no address other replicas can reach.
    st.replicas[0].placement = placed()
    assert "isolated with no service network" in reconcile(st, NOW).waits["decode"]
    st.replicas[0].placement = placed("10.0.0.7")
    plan = reconcile(st, NOW)
    assert plan.start == [Start("decode", 1, 0)] and plan.waits == {}
    assert plan.refs["decode"] == {ROUTER_IP: "10.0.0.7", ROUTER_PORT: "8000"}


def test_without_isolation_a_reference_is_the_host_and_the_replicas_own_port():
    st = pd_state([replica(0, "router", placement=placed(address="127.0.0.1:41234"))], next_num=1)
    assert reconcile(st, NOW).refs["decode"] == {ROUTER_IP: "127.0.0.1", ROUTER_PORT: "41234"}


def test_substitution_into_the_job():
    from rules.jobs import replica_input
    st = pd_state()
    inp = replica_input(st.config, "svc", "service/svc", "decode", 3, 0, 0, {ROUTER_IP: "10.0.0.7",
                                                                            ROUTER_PORT: "8000"})
    assert inp.job.commands == ["serve --router 10.0.0.7:8000"] and inp.route is False
    assert inp.job.env["DURASTACK_GROUP"] == "decode" and inp.job.env["DURASTACK_REPLICA"] == "3"
    assert replica_input(st.config, "svc", "service/svc", "router", 0, 0, 0).route is True


def test_workers_roll_when_the_replica_they_reference_moves():
    refs = {ROUTER_IP: "10.0.0.1", ROUTER_PORT: "8000"}
    st = pd_state([replica(0, "router", status="failed"), replica(0, "router", sub=1, placement=placed("10.0.0.9")),
                   worker(1, refs=refs)], next_num=2)
    plan = reconcile(st, NOW)
    assert plan.readdressed == {"decode": f"{ROUTER_IP} 10.0.0.1 → 10.0.0.9"}
    assert plan.start == [Start("decode", 2, 0)] and plan.stop == []  # surge; the old one keeps working
    st.replicas.append(worker(2, refs={ROUTER_IP: "10.0.0.9", ROUTER_PORT: "8000"}))
    assert reconcile(st, NOW).stop == [Stop(1, 0, "replaced")]


def test_a_moved_reference_does_not_roll_before_the_new_address_is_known():
    st = pd_state([replica(0, "router", status="failed"), replica(0, "router", sub=1, status="provisioning"),
                   worker(1, refs={ROUTER_IP: "10.0.0.1"})], next_num=2)
    plan = reconcile(st, NOW)
    assert not plan and plan.readdressed == {}


def test_moving_adding_or_retyping_the_router_is_not_updatable():
    from rules.changes import classify
    old = load_config_text(PD).config
    for text in (PD.replace("router: {type: sglang}", "router: {type: dynamo}"),
                 PD.replace("    router: {type: sglang}\n", "")):
        assert "router" in classify(old, load_config_text(text).config).not_updatable
    assert classify(old, load_config_text(PD.replace("[route]", "[route2]")).config).not_updatable == []


def test_a_group_that_fails_at_every_attempt_stays_in_one_row():
    """Waiting on a back-off is no quiet time: the back-off stays at its cap instead of starting again (and
    replacing at once) after each 10-minute wait, and `retry.duration` counts from the first failure."""
    group, now = GroupState(name="a", desired=1), NOW
    for _ in range(10):  # each replacement fails 30 s after its back-off ends
        count_failure(group, now)
        now = (group.retry_after or now) + timedelta(seconds=30)
    assert group.failures == 10
    assert group.retry_after == group.last_failed_at + timedelta(minutes=10)
    assert group.failing_since == NOW
    quiet = group.last_failed_at + FAILURE_MEMORY + timedelta(minutes=10, seconds=1)  # past its back-off, too
    count_failure(group, quiet)
    assert group.failing_since == quiet


def test_ps_and_the_web_ui_say_which_group_routes():
    from workflows import views
    view = views.status_view(pd_state([replica(0, "router", placement=placed("10.0.0.1")), worker(1)], next_num=2))
    assert [g.role for g in view.groups] == ["router", "worker"]
    text = views.details(view)
    assert "group=router (router: the gateway routes here)" in text
    assert "group=decode (worker behind the router)" in text


DYNAMO = """
type: service
name: svc
port: 8000
groups:
  - name: router
    replicas: 1
    router: {type: dynamo}
    commands: [frontend]
  - name: decode
    replicas: 1
    commands: [worker]
"""


def test_workers_behind_a_dynamo_router_wait_for_it_then_get_its_address_in_their_env():
    from rules.jobs import job_spec
    config = load_config_text(DYNAMO).config
    st = ServiceState(name="svc", config=config)
    st.groups = sync_groups(config, {})
    plan = reconcile(st, NOW)
    assert plan.start == [Start("router", 0, 0)] and "groups[router].replicas[0]" in plan.waits["decode"]
    router = replica(0, "router", placement=Placement(backend="local", address="unix:/r.sock", ip="10.9.0.2"))
    st = ServiceState(name="svc", config=config, replicas=[router], next_replica_num=1, groups=st.groups)
    plan = reconcile(st, NOW)
    assert plan.start == [Start("decode", 1, 0)]
    refs = plan.refs["decode"]
    env = job_spec(config, "svc", "decode", 1, 0, refs).env
    assert env["DSTACK_ROUTER_INTERNAL_IP"] == env["DURASTACK_ROUTER_INTERNAL_IP"] == "10.9.0.2"
    assert "DSTACK_ROUTER_INTERNAL_IP" not in job_spec(config, "svc", "router", 0, 0, {}).env


BOUND = """
type: service
name: svc
port: 8000
groups:
  - name: s
    replicas: 1..3
    scaling: {metric: rps, target: 10}
    commands: [serve]
  - name: w
    replicas: 1
    commands: ["work --peer ${{ groups[s].replicas[0].IP_ADDRESS }}"]
"""


def _placed(num, group, ip, sub=0, **kw):
    return replica(num, group, sub=sub, placement=Placement(backend="local", address=f"unix:/{num}.sock", ip=ip),
                   **kw)


def test_a_reference_is_bound_to_its_replica_not_its_index():
    config = load_config_text(BOUND).config
    worker = _placed(5, "w", "10.0.0.9", refs={"groups[s].replicas[0].IP_ADDRESS": "10.0.0.3"})

    def plan(*servers):
        st = ServiceState(name="svc", config=config, replicas=[*servers, worker], next_replica_num=9)
        st.groups = sync_groups(config, {})
        st.groups["s"].desired = len(servers)
        return reconcile(st, NOW)
    # A scale step gave the group a replica with a lower number: index 0 is now it, but the worker's server still
    # runs where it was: nobody rolls.
    p = plan(_placed(0, "s", "10.0.0.4"), _placed(2, "s", "10.0.0.3"))
    assert not p and not p.readdressed
    # The server it named was replaced (a new submission, a new address): the worker rolls, and says why.
    p = plan(_placed(2, "s", "10.0.0.5", sub=1))
    assert p.readdressed["w"] == "groups[s].replicas[0].IP_ADDRESS 10.0.0.3 → 10.0.0.5"
    assert [s.group for s in p.start] == ["w"]


def test_one_place_the_first_replica_is_placed_before_the_others_start_and_they_follow_it():
    from rules import lifecycle
    from models.messages import ReplicaUpdate
    config = load_config_text(DYNAMO.replace("type: dynamo", "type: sglang")).config
    st = ServiceState(name="svc", config=config, one_place=True)
    st.groups = sync_groups(config, {})
    plan = reconcile(st, NOW)
    assert plan.start == [Start("router", 0, 0)] and "first replica to be placed" in plan.waits["decode"]
    st.replicas.append(replica(0, "router", status="submitted", ready=False))
    st.next_replica_num = 1
    assert not reconcile(st, NOW).start  # still placing
    notes = lifecycle.on_replica_update(st, ReplicaUpdate(
        replica_num=0, submission_num=0, status="running", seq=2,
        placement=Placement(backend="aws", region="us-east-1", address="unix:/t.sock", ip="10.1.0.5")), NOW)
    assert st.place == "aws/us-east-1" and [n.kind for n in notes] == ["place"]
    assert reconcile(st, NOW).start == [Start("decode", 1, 0)]
    # Without the patch (a run recorded before it) every group starts at once, as before.
    st = ServiceState(name="svc", config=config)
    st.groups = sync_groups(config, {})
    assert [s.group for s in reconcile(st, NOW).start] == ["router", "decode"]
