"""`idle_duration` from the CLI, on moto's EC2 with simulated hosts, the real worker and gateway: a rolling
deployment (`apply` with a changed env) starts a replica of the new deployment on the instance an old one left
idle, with no new VM and no second image download; `stop` leaves no instance, idle ones included."""

from __future__ import annotations

import textwrap

import boto3
import httpx
import pytest

from backends.runtime import DEFAULT_IMAGE
from tests.e2e import until
from tests.fakes import vpc as vpcs
from tests.fakes.ec2_faults import ec2_server, fake_ec2  # noqa: F401  (fixtures)
from tests.test_e2e_cloud_ssh import _apply, _stack, vpc  # noqa: F401  (fixture)
from tests.test_ssh_path import APP

pytestmark = [pytest.mark.skipif(vpcs.available() is not None, reason=str(vpcs.available())), pytest.mark.long]

SERVICE = """\
type: service
name: idlesvc
port: 8000
backends: [aws]
idle_duration: 10m
env:
  MODEL: {model}
resources:
  cpu: 2
  memory: 8GB
replicas: 2
commands:
  - |
{app}
"""


def test_a_rolling_deployment_reuses_an_idle_instance(tmp_path, monkeypatch, fake_ec2, vpc):
    fake_ec2.seed_amis("us-east-1")
    stack = _stack(tmp_path, monkeypatch, vpc, "backends:\n  aws:\n    regions: [us-east-1]\n"
                                               "    ami_owners: [self]\n    public_ip: false\n")
    path = tmp_path / "idlesvc.yml"
    ec2 = boto3.client("ec2", region_name="us-east-1")

    def deploy(model: str) -> None:
        path.write_text(SERVICE.format(model=model, app=textwrap.indent(APP, " " * 4)))
        _apply(stack, path)

    def serving(deployment: int) -> list[dict]:
        status = stack.ps("idlesvc")
        ready = [r for g in status["groups"] for r in g["replicas"] if r["status"] == "running" and r["ready"]]
        active = [r for g in status["groups"] for r in g["replicas"] if r["status"] in ("submitted", "provisioning",
                                                                                       "running")]
        return ready if len(ready) == 2 == len(active) and {r["deployment"] for r in ready} == {deployment} \
            else None

    def instances(*states: str) -> list[dict]:
        res = ec2.describe_instances(Filters=[{"Name": "instance-state-name", "Values": list(states)}])
        return [i for r in res["Reservations"] for i in r["Instances"]]

    with vpcs.Booter(vpc, vpcs.moto_instances) as booter:
        try:
            deploy("tiny")
            until(lambda: serving(0), 180, 0.5, "deployment 0 ready")
            assert len(instances("pending", "running")) == 2
            deploy("small")
            new = until(lambda: serving(1), 300, 0.5, "deployment 1 ready")
            headers = {"Authorization": f"Bearer {stack.token()}"}
            answers = {httpx.get(f"{stack.gateway}/services/idlesvc/", headers=headers, timeout=10).text
                       for _ in range(6)}
            assert answers == {"small 0"}
            # Two replicas of deployment 1 on three instances: one is new, one was deployment 0's (its tags now
            # name the new replica), and the third, the last old replica's, waits idle.
            assert len(instances("pending", "running", "shutting-down", "terminated", "stopped")) == 3
            image = DEFAULT_IMAGE  # what a job without `image` or `python` runs
            pulls = {iid: (h.root / "containers" / "pulls").read_text().splitlines() for iid, h in vpc.hosts.items()}
            downloads = {iid: (h.root / "containers" / "downloads").read_text().splitlines()
                         for iid, h in vpc.hosts.items()}
            (reused,) = [iid for iid, p in pulls.items() if len(p) == 2]
            assert downloads[reused] == [image]  # pulled twice, downloaded once
            tags = {t["Key"]: t["Value"] for i in instances("running") if i["InstanceId"] == reused
                    for t in i["Tags"]}
            assert tags["durastack:replica"] in {f"r{r['replica']}-s{r['submission']}" for r in new}
            events = stack.cli("events", "idlesvc").stdout
            assert "kept idle for 10m" in events, events
            assert not booter.errors, booter.errors

            result = stack.cli("stop", "idlesvc", "-y", timeout=300)
            assert result.returncode == 0, result.stdout + result.stderr
        finally:
            stack.stop()
    assert instances("pending", "running") == []
