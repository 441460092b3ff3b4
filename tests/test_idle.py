"""The idle-instance rules (rules/idle.py): which idle instance a new replica gets, and when one ends."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from models.loader import load_config_text
from models.backends import CloudInstance
from models.messages import ReplicaUpdate, Step
from models.state import Placement, Replica, ServiceState
from rules import idle, lifecycle
from rules.jobs import placement_key, replica_input
from rules.planner import sync_groups

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
CONFIG = """
type: service
name: {name}
port: 8000
idle_duration: 10m
replicas:
  - name: a
    count: 1
    resources: {{gpu: A10G:1}}
    commands: [serve]
  - name: b
    count: 1
    resources: {{gpu: A10G:1}}
    commands: [serve]
"""


def state(name: str = "svc") -> ServiceState:
    config = load_config_text(CONFIG.format(name=name)).config
    return ServiceState(name=name, config=config, groups=sync_groups(config, {}))


def key(s: ServiceState, group: str, **change) -> str:
    inp = replica_input(s.config, s.name, "wf", group, 0, 0, 0)
    return placement_key(inp.model_copy(update=change))


def leave(s: ServiceState, group: str, num: int, vm: str, at: datetime = NOW, **change) -> str:
    """A running replica of ``group`` that was scaled down and reported its instance kept idle at ``at``."""
    r = Replica(replica_num=num, group=group, submitted_at=at, status="terminating", stop_requested=True,
                placement=Placement(backend="aws", instance_id=vm), placement_key=key(s, group, **change))
    s.replicas.append(r)
    instance = CloudInstance(backend="aws", instance_id=vm, region="us-east-1", instance_type="g5.xlarge", key="k",
                             state="running")
    notes = lifecycle.on_replica_update(s, ReplicaUpdate(replica_num=num, submission_num=0, status="terminated",
                                                         seq=Step.FINISHED, reason="scaled_down", instance=instance,
                                                         idle=True), at)
    return notes[-1].message


def test_a_scaled_down_replica_pools_its_instance_until_idle_duration():
    s = state()
    said = leave(s, "a", 0, "i-1")
    assert [(i.group, i.instance_id, i.until) for i in s.idle] == [("a", "i-1", NOW + timedelta(minutes=10))]
    assert said == "replica 0 terminated: scaled_down; its instance is kept idle for 10m for the group's next replica"
    assert lifecycle.next_due(s, NOW) == NOW + timedelta(minutes=10)


def test_a_finished_report_without_idle_pools_nothing():
    s = state()
    s.replicas.append(Replica(replica_num=0, group="a", submitted_at=NOW, placement=Placement(backend="aws")))
    lifecycle.on_replica_update(s, ReplicaUpdate(replica_num=0, submission_num=0, status="failed",
                                                 seq=Step.FINISHED, reason="exited (1)"), NOW)
    assert s.idle == []


def test_a_new_replica_takes_the_oldest_of_its_group_with_equal_inputs():
    s = state()
    leave(s, "a", 0, "i-1")
    leave(s, "a", 1, "i-2", at=NOW + timedelta(seconds=5))
    got = idle.take(s, "a", key(s, "a"), NOW + timedelta(minutes=1))
    assert got is not None and got.instance_id == "i-1"
    assert [i.instance_id for i in s.idle] == ["i-2"]  # taken out: never given twice


def test_none_across_groups_or_different_inputs():
    s = state()
    leave(s, "a", 0, "i-1")
    assert idle.take(s, "b", key(s, "b"), NOW) is None  # another group, though its inputs are the same
    for change in ({"spot_policy": "spot"}, {"max_price": 1.0}, {"regions": ["us-east-1"]},
                   {"zones": ["us-east-1a"]}, {"instance_types": ["g5.xlarge"]}, {"backends": ["gcp"]}):
        assert idle.take(s, "a", key(s, "a", **change), NOW) is None, change
    assert idle.take(s, "a", "", NOW) is None  # a replica without a key matches none
    assert len(s.idle) == 1


def test_none_across_services():
    one, two = state("one"), state("two")
    leave(one, "a", 0, "i-1")
    assert idle.take(two, "a", key(two, "a"), NOW) is None  # each service's pool is its own state
    assert key(one, "a") == key(two, "a")  # though the inputs are equal


def test_an_instance_too_close_to_its_end_is_not_given():
    s = state()
    leave(s, "a", 0, "i-1")
    late = NOW + timedelta(minutes=10) - idle.MARGIN
    assert idle.take(s, "a", key(s, "a"), late) is None
    assert idle.take(s, "a", key(s, "a"), late - timedelta(seconds=1)) is not None


def test_due_past_idle_duration_of_a_removed_group_or_once_off():
    s = state()
    leave(s, "a", 0, "i-1")
    leave(s, "b", 1, "i-2", at=NOW + timedelta(minutes=5))
    assert idle.due(s, NOW + timedelta(minutes=9)) == []
    assert [i.instance_id for i in idle.due(s, NOW + timedelta(minutes=10))] == ["i-1"]
    assert [i.instance_id for i in s.idle] == ["i-2"]
    s.config = s.config.model_copy(update={"idle_duration": None})
    assert [i.instance_id for i in idle.due(s, NOW)] == ["i-2"]
    s2 = state()
    leave(s2, "b", 0, "i-3")
    s2.config = s2.config.model_copy(update={"groups": s2.config.groups[:1]})
    assert [i.instance_id for i in idle.due(s2, NOW)] == ["i-3"]


def test_settled_once_the_new_replica_is_placed_or_ends():
    s = state()
    leave(s, "a", 0, "i-1")
    leave(s, "a", 1, "i-2")
    new = [Replica(replica_num=n, submission_num=1, group="a", submitted_at=NOW) for n in (0, 1)]
    s.replicas += new
    for r in new:
        r.reuse = idle.take(s, "a", key(s, "a"), NOW)
    assert idle.settled(s) == []  # not placed yet: the replicas that left them still own them
    new[0].placement = Placement(backend="aws", instance_id="i-1")  # placed on it
    new[1].status = "failed"  # ended unplaced: its instance is terminated
    assert [(i.instance_id, taken) for i, taken in idle.settled(s)] == [("i-1", True), ("i-2", False)]
    assert idle.settled(s) == [] and all(r.reuse is None for r in new)
