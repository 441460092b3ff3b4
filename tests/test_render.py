"""`durastack ps` rendering: what a person reads about groups and replicas."""

from __future__ import annotations

from datetime import datetime, timezone

from rich.console import Console

from cli.render import ps_table, status_json
from models.views import GroupView, ReplicaView, ServiceStatus

AT = datetime(2026, 12, 1, 1, 30, tzinfo=timezone.utc)


def status(retry_after=None) -> ServiceStatus:
    replica = ReplicaView(replica=0, submission=3, deployment=1, group="web", status="failed", ready=False,
                          submitted_at=AT, reason="exited (1)")
    return ServiceStatus(name="svc", status="pending", deployment=1, auth=True, submitted_at=AT, groups=[
        GroupView(name="web", desired=1, min=1, max=1, retry_after=retry_after, replicas=[replica])])


def rendered(s: ServiceStatus) -> str:
    console = Console(record=True, width=200)
    console.print(ps_table([s]))
    return console.export_text()


def test_a_group_waiting_on_a_back_off_says_until_when():
    waiting = datetime(2026, 12, 1, 1, 40, 5, tzinfo=timezone.utc)
    assert "group=web waits on a back-off until 01:40:05 UTC" in rendered(status(waiting))
    assert "back-off" not in rendered(status())
    assert status_json(status(waiting), "u")["groups"][0]["retry_after"] == "2026-12-01T01:40:05+00:00"


def test_a_group_with_idle_instances_says_which_until_when():
    s = status()
    assert "keeps idle" not in rendered(s)
    s.groups[0].idle = ["i-0abc until 01:40:05 UTC"]
    assert "group=web keeps idle for its next replica: i-0abc until 01:40:05 UTC" in rendered(s)
    assert status_json(s, "u")["groups"][0]["idle"] == ["i-0abc until 01:40:05 UTC"]


def test_a_router_service_says_which_group_routes_and_what_a_worker_waits_for():
    s = status()
    s.groups = [s.groups[0].model_copy(update={"name": "router", "role": "router"}),
                GroupView(name="decode", desired=1, min=1, max=2, role="worker", replicas=[],
                          waiting="groups[router].replicas[0] waits for replica 0 to have an address")]
    text = rendered(s)
    assert "group=router (router) replica=0" in text and "group=decode (worker) (no replicas)" in text
    assert "group=decode (worker) waits: groups[router].replicas[0] waits for replica 0" in text
    assert [g["role"] for g in status_json(s, "u")["groups"]] == ["router", "worker"]


def test_a_cloud_gpu_replica_shows_its_offers_gpus():
    """The GPU column: the offer's GPUs (name×count), from the placement the backend reported through the view."""
    from activities.cloud import placement_of
    from models.backends import CloudInstance
    from models.offers import InstanceOffer
    from models.state import Replica
    from workflows.views import _replica_view

    offer = InstanceOffer(backend="aws", instance_type="g5.12xlarge", region="us-east-1", zones=["us-east-1a"],
                          cpus=48, memory_gb=192.0, gpu_vendor="nvidia", gpu_name="A10G", gpu_memory_gb=24.0,
                          gpu_count=4, price=5.672)
    instance = CloudInstance(backend="aws", instance_id="i-0abc", region="us-east-1", instance_type="g5.12xlarge",
                             key="k", state="running", private_ip="10.0.1.17")
    cpu = offer.model_copy(update={"instance_type": "m5.large", "gpu_vendor": None, "gpu_name": None,
                                   "gpu_memory_gb": 0.0, "gpu_count": 0, "price": 0.096})
    views = [_replica_view(Replica(replica_num=n, group="web", status="running", ready=True, submitted_at=AT,
                                   placement=placement_of(o, instance))) for n, o in enumerate((offer, cpu))]
    assert [v.gpu for v in views] == ["A10G×4", ""]
    s = status()
    s.groups = [GroupView(name="web", desired=2, min=2, max=2, replicas=views)]
    rows = [line for line in rendered(s).splitlines() if "replica=" in line]
    assert "replica=0" in rows[0] and "  A10G×4  " in rows[0]
    assert "replica=1" in rows[1] and "  -  " in rows[1] and "A10G" not in rows[1]
    assert [r["gpu"] for r in status_json(s, "u")["groups"][0]["replicas"]] == ["A10G×4", ""]
