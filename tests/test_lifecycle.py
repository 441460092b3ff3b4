"""The pure lifecycle rules: reports by sequence, failures, rollouts that fail, deployments, manual scales."""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import pytest

from models.loader import load_config_text
from models.messages import Down, ReplicaInput, ReplicaUpdate
from models.state import Placement
from tests.test_planner import NOW, replica, state
from rules import lifecycle
from rules.admission import Refused, check_apply
from rules.changes import classify, input_hash, spec_hash
from rules.jobs import replica_input


def update(num: int, status: str, seq: int, sub: int = 0, **kw) -> ReplicaUpdate:
    return ReplicaUpdate(replica_num=num, submission_num=sub, status=status, seq=seq, **kw)


def test_a_report_not_newer_than_the_last_is_dropped():
    st = state(replicas=[replica(0, "a", status="provisioning", ready=False, registered=False)])
    ready = update(0, "running", 3, ready=True, registered=True, placement=Placement(backend="local"))
    assert lifecycle.on_replica_update(st, ready, NOW) == []
    assert st.replicas[0].serves and st.replicas[0].seq == 3
    # A retried launch re-sends its `provisioning` step late: it changes nothing.
    lifecycle.on_replica_update(st, update(0, "provisioning", 1), NOW)
    assert st.replicas[0].status == "running" and st.replicas[0].serves


def test_settled_only_when_no_replica_is_between_steps():
    """What a continue-as-new waits for: reports of a replica launching or stopping could otherwise be lost."""
    st = state(replicas=[replica(0, "a"), replica(1, "a", status="terminated", ready=False, registered=False)])
    assert lifecycle.settled(st)
    for leaving in (dict(status="provisioning", ready=False, registered=False),  # launching
                    dict(status="running", ready=False, registered=False),  # started, not ready yet
                    dict(stop_requested=True)):  # serving, asked to stop: its teardown will report
        assert not lifecycle.settled(state(replicas=[replica(0, "a"), replica(2, "a", **leaving)])), leaving


def test_a_replica_that_fails_on_its_own_counts_once_and_backs_off_the_second_time():
    st = state(replicas=[replica(0, "a"), replica(1, "a")])
    lifecycle.on_replica_update(st, update(0, "terminating", 10, reason="exited (1)"), NOW)
    lifecycle.on_replica_update(st, update(0, "failed", 11, reason="exited (1)"), NOW)
    group = st.groups["a"]
    assert (group.failures, group.retry_after) == (1, None)  # replaced at once
    notes = lifecycle.on_replica_update(st, update(1, "terminating", 10, reason="exited (1)"), NOW)
    assert (group.failures, group.retry_after) == (2, NOW + timedelta(seconds=15))
    assert [n.kind for n in notes] == ["backoff"]


def test_a_stop_the_service_asked_for_is_no_failure():
    st = state(replicas=[replica(0, "a", stop_requested=True)])
    lifecycle.on_replica_update(st, update(0, "terminating", 10), NOW)
    assert st.groups["a"].failures == 0


def test_down_stops_and_counts_once_and_ignores_a_replica_already_leaving():
    st = state(replicas=[replica(0, "a"), replica(1, "a", stop_requested=True)])
    gone, notes = lifecycle.on_down(st, Down(replica_num=0, submission_num=0, reason="exited (137)"), NOW)
    assert gone is st.replicas[0] and gone.stop_requested and not gone.registered
    assert notes[0].message == "replica 0 down: exited (137); unrouted, replacing"
    assert lifecycle.on_down(st, Down(replica_num=0, submission_num=0, reason="again"), NOW) == (None, [])
    assert lifecycle.on_down(st, Down(replica_num=1, submission_num=0, reason="x"), NOW) == (None, [])
    # Its later `terminating` report is not a second failure.
    lifecycle.on_replica_update(st, update(0, "terminating", 10), NOW)
    assert st.groups["a"].failures == 1


def test_a_new_replica_of_a_rollout_that_fails_stops_the_rollout():
    st = state(replicas=[replica(0, "a"), replica(1, "a"), replica(3, "a", deployment=1, ready=False)])
    st.deployment_num = 1
    notes = lifecycle.on_replica_update(st, update(3, "terminating", 10, reason="exited (2)"), NOW)
    assert st.groups["a"].rollout_failed == "exited (2)"
    assert any(n.kind == "rollout" and "old replicas keep serving" in n.message for n in notes)


ROLL = """
type: service
name: svc
port: 8000
replicas:
  - {{name: a, count: 2, commands: [{a}]}}
  - {{name: b, count: 1, commands: [y]}}
"""


def config(a: str = "x", b_count: Optional[int] = None):
    text = ROLL.format(a=a)
    if b_count is not None:
        text = text.replace("name: b, count: 1", f"name: b, count: {b_count}")
    return load_config_text(text).config


def running():
    """A service running ``config()``: one replica of each group."""
    st = state()
    st.config = config()
    st.groups = lifecycle.sync_groups(st.config, {})
    st.replicas = [replica(0, "a", spec_hash=spec_hash(st.config, "a")),
                   replica(1, "b", spec_hash=spec_hash(st.config, "b"))]
    return st


def test_deploy_rolls_changed_groups_keeps_the_rest_and_forgives_their_back_off():
    st = running()
    st.groups["a"].failures, st.groups["a"].retry_after = 3, NOW + timedelta(minutes=5)
    st.groups["b"].failures, st.groups["b"].retry_after = 2, NOW + timedelta(minutes=5)
    result, notes = lifecycle.deploy(st, config(a="x2"))
    assert result.changed and result.deployment == 1 and result.kept == 1 and result.replacing == 1
    assert st.groups["a"].retry_after is None and st.groups["a"].failures == 0  # the fix starts at once
    assert st.groups["b"].retry_after is not None  # untouched group keeps its back-off
    assert notes[0].kind == "apply"
    again, notes = lifecycle.deploy(st, config(a="x2"))
    assert not again.changed and again.deployment == 1 and notes == []


def test_a_manual_scale_forgives_the_back_off():
    st = state()
    st.groups["b"].failures, st.groups["b"].retry_after = 4, NOW + timedelta(minutes=5)
    notes = lifecycle.rescale(st, "b", 3, NOW)
    assert st.groups["b"].desired == 3 and st.groups["b"].retry_after is None and notes[0].kind == "scale"


def test_expired_back_offs_are_forgotten():
    st = state()
    st.groups["a"].retry_after = NOW
    lifecycle.end_backoffs(st, NOW + timedelta(seconds=1))
    assert st.groups["a"].retry_after is None


class WithANewOptionalField(ReplicaInput):
    """As if a later release added a field to what a replica gets: no replica may restart for it."""

    future: Optional[str] = None


def test_spec_hash_ignores_new_optional_fields_and_sees_real_changes():
    inp = replica_input(config(), "x", "x", "a", 0, 0, 0)
    assert input_hash(WithANewOptionalField(**inp.model_dump())) == input_hash(inp)
    assert spec_hash(config(), "a") == spec_hash(config(), "a")
    assert spec_hash(config(a="x2"), "a") != spec_hash(config(), "a")
    assert spec_hash(config(b_count=3), "b") == spec_hash(config(), "b")  # a count restarts nothing


def test_a_wait_for_an_address_and_a_moved_address_are_noted_once():
    from rules.planner import Plan
    st = state()
    plan = Plan(waits={"b": "groups[a].replicas[0] has no replica yet"})
    assert [n.message for n in lifecycle.remember_waits(st, plan)] == [
        "a replica cannot start yet: groups[a].replicas[0] has no replica yet"]
    assert lifecycle.remember_waits(st, plan) == [] and st.groups["b"].waiting
    moved = Plan(readdressed={"b": "groups[a].replicas[0].IP_ADDRESS 10.0.0.1 → 10.0.0.2"})
    (note,) = lifecycle.remember_waits(st, moved)
    assert note.kind == "rollout" and note.group == "b" and "10.0.0.1 → 10.0.0.2" in note.message
    assert lifecycle.remember_waits(st, Plan()) == [] and st.groups["b"].waiting == st.groups["b"].readdressed == ""


def test_new_replicas_carry_their_addresses_and_whether_they_are_routed():
    from tests.test_planner import ROUTER_IP, ROUTER_PORT, pd_state
    from rules.planner import Plan, Start
    st = pd_state()
    plan = Plan(start=[Start("router", 0, 0), Start("decode", 1, 0)],
                refs={"decode": {ROUTER_IP: "10.0.0.7", ROUTER_PORT: "8000"}})
    added, notes = lifecycle.add_replicas(st, plan, NOW)
    assert [(r.group, r.routed, r.refs) for r in added] == [
        ("router", True, {}), ("decode", False, {ROUTER_IP: "10.0.0.7", ROUTER_PORT: "8000"})]
    assert st.next_replica_num == 2 and len(st.replicas) == 2
    assert [n.message for n in notes] == [f"replica 1 starts with {ROUTER_IP} = 10.0.0.7, {ROUTER_PORT} = 8000"]


# --- retry and max_duration -------------------------------------------------------------------------

def retrying(retry: str, max_duration: str = "off", replicas=()):
    """ROLL's service (groups `a` and `b`), submitted at NOW, with the given `retry` and `max_duration`."""
    from models.state import ServiceState
    text = ROLL.format(a="x") + f"retry: {retry}\nmax_duration: {max_duration}\n"
    st = ServiceState(name="svc", config=load_config_text(text).config, replicas=list(replicas), submitted_at=NOW)
    st.groups = lifecycle.sync_groups(st.config, {})
    return st


def test_retry_event_classifies_the_reasons_durastack_builds():
    from models.failures import FailureKind, retry_event
    from models.messages import PlacementRefusal
    from workflows.replica import no_capacity_reason
    nothing_fits = PlacementRefusal(backend="local", tried=False, reasons=["this machine does not fit"])
    all_failed = PlacementRefusal(backend="aws", tried=True, reasons=["aws g5.xlarge: InsufficientInstanceCapacity"])
    for refusals in ([nothing_fits], [nothing_fits, all_failed], []):
        assert retry_event(no_capacity_reason(refusals)) == "no-capacity"
    assert retry_event(f"{FailureKind.SPOT_INTERRUPTION} (instance terminated)") == "interruption"
    for reason in ("exited (1)", "instance terminated", "container exited", "replica workflow terminated",
                   "could not start: already started", "failed", "", "exited (1): no offers in the log"):
        assert retry_event(reason) == "error", reason


def test_without_retry_every_failure_is_replaced():
    st = state(replicas=[replica(0, "a")])
    assert st.config.retry is None
    gone, notes = lifecycle.on_down(st, Down(replica_num=0, submission_num=0, reason="exited (1)"), NOW)
    assert gone is not None and not st.stopping and st.failure == ""
    assert notes[0].message == "replica 0 down: exited (1); unrouted, replacing"


def test_a_failure_not_in_on_events_fails_the_service():
    st = retrying("{on_events: [no-capacity]}", replicas=[replica(0, "a"), replica(1, "a"), replica(2, "b")])
    # No capacity is retried: the replica is replaced as without `retry`.
    lifecycle.on_replica_update(st, update(0, "terminating", 10, reason="no offers: this machine does not fit"), NOW)
    assert not st.stopping and st.groups["a"].failures == 1
    gone, notes = lifecycle.on_down(st, Down(replica_num=1, submission_num=0, reason="exited (1)"), NOW)
    assert gone is st.replicas[1] and st.stopping
    assert st.failure == "replica 1 exited (1); not retried: 'error' is not in retry.on_events"
    assert [(n.kind, n.message) for n in notes] == [
        ("replica", "replica 1 down: exited (1); unrouted, not replaced"),
        ("stop", "service failed: replica 1 exited (1); not retried: 'error' is not in retry.on_events")]
    # Another failure while it stops changes nothing: the first reason stays.
    lifecycle.on_down(st, Down(replica_num=2, submission_num=0, reason="spot interruption (instance terminated)"), NOW)
    assert st.failure.startswith("replica 1 exited (1)")


def test_retry_false_fails_the_service_at_the_first_failure():
    st = retrying("false", replicas=[replica(0, "a")])
    notes = lifecycle.on_replica_update(st, update(0, "failed", 11, reason="no offers: nothing fits"), NOW)
    assert st.stopping and st.failure == "replica 0 no offers: nothing fits; not retried: 'no-capacity' is not in " \
                                         "retry.on_events"
    assert [n.kind for n in notes] == ["stop", "replica"]  # no back-off is announced for a service that gave up


def test_a_stop_requested_before_a_failure_is_not_turned_into_a_failure():
    st = retrying("false", replicas=[replica(0, "a")])
    st.stopping = True
    lifecycle.on_down(st, Down(replica_num=0, submission_num=0, reason="exited (1)"), NOW)
    assert st.failure == ""


def test_retry_duration_fails_a_group_that_keeps_failing_for_longer():
    replicas = [replica(n, "a") for n in range(10)]
    st = retrying("{on_events: [error], duration: 1h}", replicas=replicas)
    def crash(n: int):
        return lifecycle.on_down(st, Down(replica_num=n, submission_num=0, reason="exited (1)"),
                                 NOW + n * timedelta(minutes=8))[1]
    for n in range(8):  # a failure every 8 minutes: one row, failing since NOW; the 8th at 56 minutes
        crash(n)
    assert not st.stopping and st.groups["a"].failing_since == NOW
    notes = crash(8)  # at 64 minutes
    assert st.stopping and st.failure == "replica 8 exited (1); not retried: failing for longer than retry.duration 1h"
    assert notes[-1].message == f"service failed: {st.failure}"


def test_retry_duration_counts_afresh_after_a_quiet_stretch_and_after_a_new_deployment():
    st = retrying("{duration: 30m}", replicas=[replica(n, "a") for n in range(4)])
    lifecycle.on_down(st, Down(replica_num=0, submission_num=0, reason="exited (1)"), NOW)
    later = NOW + timedelta(minutes=40)  # no failure for 40 minutes: a new row
    lifecycle.on_down(st, Down(replica_num=1, submission_num=0, reason="exited (1)"), later)
    assert not st.stopping and st.groups["a"].failing_since == later
    lifecycle.rescale(st, "a", 2, later)  # a manual scale (or a deployment of the group) forgives the row
    assert st.groups["a"].failing_since is None
    lifecycle.on_down(st, Down(replica_num=2, submission_num=0, reason="exited (1)"), later + timedelta(minutes=5))
    assert not st.stopping and st.groups["a"].failing_since == later + timedelta(minutes=5)


def test_a_rollouts_new_replica_never_fails_the_service():
    st = retrying("false", replicas=[replica(0, "a"), replica(1, "a"), replica(3, "a", deployment=1, ready=False)])
    st.deployment_num = 1
    notes = lifecycle.on_replica_update(st, update(3, "terminating", 10, reason="exited (2)"), NOW)
    assert not st.stopping and st.groups["a"].rollout_failed == "exited (2)"
    assert any(n.kind == "rollout" and "old replicas keep serving" in n.message for n in notes)
    # An old replica failing is an ordinary failure: `retry: false` fails the service.
    lifecycle.on_down(st, Down(replica_num=0, submission_num=0, reason="exited (1)"), NOW)
    assert st.stopping and st.failure.startswith("replica 0 exited (1)")


def test_max_duration_wakes_the_loop_and_stops_the_service():
    from workflows.views import status_view
    st = retrying("true", max_duration="2h", replicas=[replica(0, "a")])
    assert lifecycle.next_due(st, NOW) == NOW + timedelta(hours=2)
    assert lifecycle.expire(st, NOW + timedelta(minutes=119)) == [] and not st.stopping
    (note,) = lifecycle.expire(st, NOW + timedelta(hours=2))
    assert (note.kind, note.message) == ("stop", "max_duration 2h reached: stopping the service")
    assert st.stopping and st.failure == "" and status_view(st).status == "terminating"
    assert lifecycle.expire(st, NOW + timedelta(hours=3)) == []  # once
    st.replicas[0].status = "terminated"
    assert status_view(st).status == "terminated"


def test_without_max_duration_nothing_is_due_and_nothing_expires():
    st = retrying("true", replicas=[replica(0, "a")])
    assert lifecycle.next_due(st, NOW) is None
    assert lifecycle.expire(st, NOW + timedelta(days=365)) == [] and not st.stopping


def test_a_failed_service_shows_terminating_then_failed():
    from workflows.views import status_view
    st = retrying("false", replicas=[replica(0, "a")])
    lifecycle.on_down(st, Down(replica_num=0, submission_num=0, reason="exited (1)"), NOW)
    assert status_view(st).status == "terminating"
    lifecycle.on_replica_update(st, update(0, "failed", 11, reason="exited (1)"), NOW)
    assert status_view(st).status == "failed"


def test_retry_and_max_duration_change_in_place_and_restart_nothing():
    from rules.admission import check_apply
    st = retrying("true", replicas=[replica(0, "a"), replica(1, "b")])
    for r in st.replicas:
        r.spec_hash = spec_hash(st.config, r.group)
    new = retrying("{on_events: [no-capacity], duration: 1h}", max_duration="1h").config
    check_apply("svc", st.config, False, new)  # not refused as "cannot be updated in place"
    assert all(spec_hash(new, g) == spec_hash(st.config, g) for g in ("a", "b"))
    result, _ = lifecycle.deploy(st, new)
    assert (result.in_place, result.rolling, result.kept, result.replacing) == (["max_duration", "retry"], [], 2, 0)
    assert lifecycle.next_due(st, NOW) == NOW + timedelta(hours=1)  # counted from the submission


# --- unavailable: when the gateway answers 503 at once instead of holding --------------------------

def _starting(num, group, **kw):
    return replica(num, group, status="provisioning", ready=False, registered=False, **kw)


def test_a_crash_looping_router_makes_the_service_unavailable_with_why_and_when():
    from tests.test_planner import pd_state, worker
    st = pd_state([_starting(0, "router"), worker(1)], next_num=2)
    assert lifecycle.unavailable(st) == ""  # a first start in progress: held
    # Its last output goes to `events`, never to the gateway's clients.
    notes = lifecycle.on_replica_update(st, update(0, "failed", 11, reason="exited (1); last output: at /srv/x"), NOW)
    assert any("exited (1); last output: at /srv/x" in n.message for n in notes)
    assert lifecycle.unavailable(st) == "router group 'router': replica 0 exited (1); a new replica is starting"
    st.replicas.append(_starting(2, "router"))
    lifecycle.on_replica_update(st, update(2, "failed", 11, reason="exited (1)"), NOW + timedelta(seconds=5))
    assert lifecycle.unavailable(st) == ("router group 'router': replica 2 exited (1); next attempt at "
                                         "12:00:20 UTC")
    assert lifecycle.route(st, say_unavailable=True).unavailable == lifecycle.unavailable(st)
    assert lifecycle.route(st).unavailable == ""  # runs without the patch put the route they always put
    # A replica of it serves: the workers behind it do not matter, it is routed again.
    st.replicas.append(_starting(3, "router"))
    lifecycle.on_replica_update(st, update(3, "running", 3, ready=True, registered=True), NOW + timedelta(minutes=1))
    assert lifecycle.unavailable(st) == "" and st.groups["router"].failed_start == ""


def test_a_router_that_served_and_died_is_a_cold_start_not_a_crash_loop():
    from tests.test_planner import pd_state, worker
    st = pd_state([replica(0, "router"), worker(1)], next_num=2)
    lifecycle.on_down(st, Down(replica_num=0, submission_num=0, reason="exited (137)"), NOW)
    assert st.groups["router"].failures == 1 and lifecycle.unavailable(st) == ""


def test_a_group_at_zero_is_held_and_a_group_that_may_serve_keeps_the_service_available():
    st = state(a="1", b="0..4", desired={"b": 0},
               replicas=[_starting(0, "a")], next_num=1)
    lifecycle.on_replica_update(st, update(0, "failed", 11, reason="no offers"), NOW)
    # Without a router every group is routed: `b` at zero may yet scale from zero on the held requests.
    assert lifecycle.unavailable(st) == ""
    st.groups["b"].desired = 1  # `b` should serve, and its first start is in progress: held
    st.replicas.append(_starting(1, "b"))
    assert lifecycle.unavailable(st) == ""
    lifecycle.on_replica_update(st, update(1, "failed", 11, reason="exited (2)"), NOW)
    assert lifecycle.unavailable(st) == ("group 'a': replica 0 no offers; a new replica is starting; "
                                         "group 'b': replica 1 exited (2); a new replica is starting")
    st.groups["a"].desired = st.groups["b"].desired = 0
    assert lifecycle.unavailable(st) == ""  # at zero: scale from zero holds
    st.groups["a"].desired = st.groups["b"].desired = 1
    lifecycle.rescale(st, "a", 1, NOW)  # a manual scale forgives: the next start is a first start again
    assert lifecycle.unavailable(st) == ""


def test_a_failed_service_is_unavailable_and_a_long_reason_is_bounded():
    st = state(replicas=[replica(0, "a")])
    st.failure = "replica 0 exited (1); not retried: " + "x" * 1000
    why = lifecycle.unavailable(st)
    assert why.startswith("service failed: replica 0 exited (1)") and len(why) == lifecycle.MAX_UNAVAILABLE


def test_ps_shows_why_the_service_cannot_serve():
    from workflows.views import details, status_view
    from tests.test_planner import pd_state
    st = pd_state([_starting(0, "router")], next_num=1)
    assert status_view(st).unavailable == ""
    lifecycle.on_replica_update(st, update(0, "failed", 11, reason="exited (1)"), NOW)
    view = status_view(st)
    assert view.unavailable == "router group 'router': replica 0 exited (1); a new replica is starting"
    assert f"cannot serve: {view.unavailable}" in details(view)


def test_a_serving_replica_that_reports_its_own_failure_is_no_failed_start():
    from tests.test_planner import pd_state, worker
    st = pd_state([replica(0, "router"), worker(1)], next_num=2)
    lifecycle.on_replica_update(st, update(0, "terminating", 10, reason="exited (1)"), NOW)
    assert st.groups["router"].failures == 1 and st.groups["router"].failed_start == ""
    assert lifecycle.unavailable(st) == ""


def test_a_replicas_last_output_is_one_bounded_line_with_its_env_masked():
    from models.failures import LAST_OUTPUT_CHARS, with_output, without_output
    said = with_output("exited (1)", "\nloading hf_abc123xyz\n\n  Traceback\nKeyError: 'hf_abc123'\n",
                       hide=["hf_abc123", "hf_abc123xyz", "1"])
    assert said == "exited (1); last output: loading *** | Traceback | KeyError: '***'"  # longest value first
    assert without_output(said) == "exited (1)" and with_output("exited (1)", "\n \n") == "exited (1)"
    long = with_output("exited (2)", "x" * 1000 + "\nthe end")
    assert long.endswith("the end") and len(long) == len("exited (2); last output: ") + LAST_OUTPUT_CHARS


def test_a_groups_new_reservation_rolls_that_group_and_the_services_is_not_updatable_in_place():
    st = running()
    reserved = load_config_text(ROLL.format(a="x").replace("count: 2,", "count: 2, reservation: cr-0123456789abcdef0,")
                                ).config
    # dstack redeploys the jobs whose requirements change: group a's replicas go into the reservation one at a
    # time, group b's stay where they are.
    result, _ = lifecycle.deploy(st, reserved)
    assert result.rolling == ["groups.a.reservation"] and (result.replacing, result.kept) == (1, 1)
    assert replica_input(reserved, "svc", "w", "a", 0, 0, 1).reservation == "cr-0123456789abcdef0"
    assert replica_input(reserved, "svc", "w", "b", 0, 0, 1).reservation is None

    # The service's own reservation is a profile field dstack does not update in place: stop and apply again.
    text = "type: service\nname: svc\nport: 8000\ncommands: [x]\nreservation: {}\n"
    before, after = (load_config_text(text.format(r)).config for r in ("cr-0123456789abcdef0", "gpu-pool"))
    assert classify(before, after).not_updatable == ["reservation"]
    with pytest.raises(Refused, match="cannot be updated in place: reservation; stop the service"):
        check_apply("svc", before, False, after)
