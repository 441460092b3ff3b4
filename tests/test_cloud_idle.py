"""`idle_duration` on real cloud APIs' stand-ins: moto's EC2 and the fake Compute server, each instance a simulated
host reached over SSH. A replica's teardown keeps its instance idle (container and job files gone, image kept); the
group's next replica is placed on it by retagging it (no new instance, no boot wait, no download); the replica
that left it then terminates it only if its tags still name it. Never across services."""

from __future__ import annotations

import boto3
import pytest

from backends.aws import AWSBackend
from backends.gcp import GCPBackend
from backends.runtime import runtime_of
from models.backends import AWSConfig, BackendsConfig, GCPConfig
from models.messages import LaunchInput, LaunchStep, ReplicaInput, TeardownInput
from tests.fakes import vpc as vpcs
from tests.fakes.activity_env import FakeClient, activity_env
from tests.fakes.ec2_faults import ec2_server, fake_ec2  # noqa: F401  (fixtures)
from tests.fakes.gce import gce  # noqa: F401  (fixture)
from tests.test_cloud_ssh import CPU, _cloud, _get, job, ledger, vpc  # noqa: F401  (fixtures)

pytestmark = pytest.mark.skipif(vpcs.available() is not None, reason=str(vpcs.available()))


def _input(j) -> ReplicaInput:
    return ReplicaInput(service_workflow_id=f"service/{j.service}", job=j, resources=CPU)


async def _launch(acts, env, backend: str, inp: ReplicaInput):
    placed = await env.run(acts.place, LaunchInput(backend=backend, replica=inp))
    step = LaunchStep(replica=inp, backend=backend, launched=placed)
    started = await env.run(acts.start, step)
    await env.run(acts.ready, step.model_copy(update={"launched": started}))
    return started


def _teardown(j, backend: str, instance, **kw) -> TeardownInput:
    return TeardownInput(service_workflow_id=f"service/{j.service}", job=j, backend=backend, instance=instance,
                         reason="scaled_down", drain_seconds=0, **kw)


async def _reuse_then_release(acts, backend: str, vpc, client, instances) -> None:
    env = activity_env(client)
    first, second = job(0), job(0).model_copy(update={"submission_num": 1})
    old = await _launch(acts, env, backend, _input(first))
    host = vpc.hosts[old.instance.instance_id]
    assert await env.run(acts.teardown, _teardown(first, backend, old.instance, keep=True)) is True
    assert host.container_pid() is None and not (host.root / "opt" / "job").exists()  # its env is gone
    assert acts.gateway.routed == {} and acts.cloud.tunnels == {}
    ended = [u for _, name, u in client.signals if name != "record_event" and u.submission_num == 0][-1]
    assert (ended.status, ended.idle, ended.instance.instance_id) == ("terminated", True, old.instance.instance_id)

    inp = _input(second).model_copy(update={"reuse": old.instance})
    placed = await env.run(acts.place, LaunchInput(backend=backend, replica=inp))
    assert placed.instance.instance_id == old.instance.instance_id and placed.instance.owner[2] == "r0-s1"
    assert [i.owner[2] for i in instances()] == ["r0-s1"]  # retagged: no second instance
    # A retried place adopts it again.
    again = await env.run(acts.place, LaunchInput(backend=backend, replica=inp))
    assert again.instance.instance_id == placed.instance.instance_id and len(instances()) == 1
    started = await env.run(acts.start, LaunchStep(replica=inp, backend=backend, launched=placed))
    await env.run(acts.ready, LaunchStep(replica=inp, backend=backend, launched=started))
    assert (await _get(started.placement.address)).status_code == 200
    image = runtime_of(first).image
    assert (host.root / "containers" / "pulls").read_text().splitlines() == [image, image]
    assert (host.root / "containers" / "downloads").read_text().splitlines() == [image]  # one download

    # The replica that left it is released: its instance runs the next one now, so it is left alone.
    await env.run(acts.teardown, _teardown(first, backend, old.instance, idle=True))
    assert [i.instance_id for i in instances()] == [old.instance.instance_id]
    await env.run(acts.teardown, _teardown(second, backend, started.instance))
    assert instances() == []


async def test_aws_keeps_an_idle_instance_for_the_groups_next_replica(fake_ec2, vpc, ledger, tmp_path):
    fake_ec2.seed_amis("us-east-1")
    config = AWSConfig(regions=["us-east-1"], ami_owners=["self"], public_ip=False)
    backend = AWSBackend(config)
    acts = _cloud("aws", backend, BackendsConfig(aws=config), ledger, vpc, tmp_path / "home")
    with vpcs.Booter(vpc, vpcs.moto_instances) as booter:
        await _reuse_then_release(acts, "aws", vpc, FakeClient(), lambda: backend.list_tagged())
    assert not booter.errors, booter.errors


async def test_gcp_keeps_an_idle_instance_for_the_groups_next_replica(gce, vpc, ledger, tmp_path):
    config = GCPConfig(project_id="proj", regions=["us-central1"], endpoint=gce.url, public_ip=False)
    backend = GCPBackend(config)
    acts = _cloud("gcp", backend, BackendsConfig(gcp=config), ledger, vpc, tmp_path / "home")
    with vpcs.Booter(vpc, lambda: vpcs.gce_instances(gce)) as booter:
        await _reuse_then_release(acts, "gcp", vpc, FakeClient(), lambda: backend.list_tagged())
    assert not booter.errors, booter.errors


async def test_an_idle_instance_is_never_another_services_and_a_gone_one_is_replaced(fake_ec2, vpc, ledger,
                                                                                    tmp_path):
    fake_ec2.seed_amis("us-east-1")
    config = AWSConfig(regions=["us-east-1"], ami_owners=["self"], public_ip=False)
    backend = AWSBackend(config)
    acts = _cloud("aws", backend, BackendsConfig(aws=config), ledger, vpc, tmp_path / "home")
    env = activity_env(FakeClient())
    other = job(0).model_copy(update={"service": "other"})
    with vpcs.Booter(vpc, vpcs.moto_instances):
        old = await env.run(acts.place, LaunchInput(backend="aws", replica=_input(job(0))))
        # Given, by a bug, to another service's replica: never placed there.
        placed = await env.run(acts.place, LaunchInput(backend="aws", replica=_input(other).model_copy(
            update={"reuse": old.instance})))
        assert placed.instance.instance_id != old.instance.instance_id
        assert {i.owner[0] for i in backend.list_tagged()} == {"svc", "other"}
        # An idle instance gone meanwhile: a new one, as without reuse.
        boto3.client("ec2", region_name="us-east-1").terminate_instances(InstanceIds=[old.instance.instance_id])
        second = job(0).model_copy(update={"submission_num": 1})
        fresh = await env.run(acts.place, LaunchInput(backend="aws", replica=_input(second).model_copy(
            update={"reuse": old.instance})))
        assert fresh.instance.instance_id not in (old.instance.instance_id, placed.instance.instance_id)
    for j, launched in ((other, placed), (second, fresh)):
        await env.run(acts.teardown, _teardown(j, "aws", launched.instance))
    assert backend.list_tagged() == []
