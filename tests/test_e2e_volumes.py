"""Network volumes from the CLI, on moto's EC2 and on the fake Compute server, as tests/test_e2e_cloud_ssh.py runs
cloud services: `durastack server`, every instance booted as a simulated host (tests/fakes/vpc.py), which shows the
disks attached to its instance as block devices (tests/fakes/blockdev.py).

`durastack apply -f` of a `type: volume` file makes the volume; a service mounting it is placed in its zone, its
replica attaches it, formats it (it is new) and mounts it, and writes a file there; `apply` with a changed env rolls
the service (the old replica stops first: the volume attaches to one instance at a time) and the new replica, on
another instance, reads that file (while what it wrote to an instance volume stayed with the old instance). A volume
attached is not deleted; `stop` detaches it and `durastack volume delete`
deletes it, leaving nothing behind.
"""

from __future__ import annotations

import json
import textwrap

import httpx
import pytest

from tests.e2e import Stack, evidence, until
from tests.fakes import vpc as vpcs
from tests.fakes.ec2_faults import ec2_server, fake_ec2  # noqa: F401  (fixtures)
from tests.fakes.gce import gce  # noqa: F401  (fixture)
from tests.test_e2e_cloud_ssh import _stack, vpc  # noqa: F401  (vpc: a fixture)

pytestmark = [pytest.mark.skipif(vpcs.available() is not None, reason=str(vpcs.available())), pytest.mark.long]

VOLUME = """\
type: volume
name: my-cache
backend: {backend}
region: {region}
availability_zone: {zone}
size: 10GB
"""
# Each replica appends its deployment's MODEL to a file on the volume, then serves the file.
APP = """echo "written by $MODEL" >> /data/log
echo "$MODEL" >> /cache/seen
cat > app.py <<'PY'
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = open("/data/log", "rb").read()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
PY
exec python3 app.py"""
SERVICE = """\
type: service
name: volsvc
port: 8000
backends: [{backend}]
env:
  MODEL: {model}
volumes:
  - my-cache:/data
  - /mnt/cache:/cache
resources:
  cpu: 2
  memory: 8GB
commands:
  - |
{app}
"""


def _ok(result) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _serving(stack: Stack) -> list[dict]:
    return [r for g in stack.ps("volsvc")["groups"] for r in g["replicas"] if r["status"] == "running" and r["ready"]]


def _scenario(tmp_path, stack: Stack, vpc, booter, backend: str, region: str, zone: str, instance_of, attached_to):
    """``instance_of(replica as ps shows it)``: its instance's (id, zone); ``attached_to()``: the volume's holder now,
    or None."""
    (tmp_path / "vol.yml").write_text(VOLUME.format(backend=backend, region=region, zone=zone))
    service = tmp_path / "volsvc.yml"
    headers = lambda: {"Authorization": f"Bearer {stack.token()}"}  # noqa: E731
    read = lambda: httpx.get(f"{stack.gateway}/services/volsvc/", headers=headers(), timeout=10)  # noqa: E731
    try:
        stack.wait_up()
        until(lambda: stack.cli("db", "current", "--check").returncode == 0, 120, 0.5, "the store migrated")
        made = _ok(stack.cli("apply", "-f", str(tmp_path / "vol.yml"), "-y"))
        assert "my-cache" in made and zone in made
        (kept,) = json.loads(_ok(stack.cli("volume", "list", "--json")))
        assert (kept["name"], kept["backend"], kept["zone"], kept["size_gb"]) == ("my-cache", backend, zone, 10)
        assert "exists already" in _ok(stack.cli("apply", "-f", str(tmp_path / "vol.yml"), "-y"))

        service.write_text(SERVICE.format(backend=backend, model="v0", app=textwrap.indent(APP, " " * 6)))
        applied = _ok(stack.cli("apply", "-f", str(service), "-y", timeout=600))
        assert f"volume my-cache at /data: {backend} {zone}" in applied
        try:
            (first,) = until(lambda: _serving(stack), 180, 0.5, "deployment 0 serving")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{evidence(stack, 'volsvc')}") from None
        assert read().text == "written by v0\n"
        old, where = instance_of(first)
        assert where == zone and attached_to() == old
        events = _ok(stack.cli("events", "volsvc"))
        assert f"volume my-cache ({kept['cloud_id']}) attached to {old} and mounted (new: formatted ext4)" in events, \
            events

        refused = stack.cli("volume", "delete", "my-cache", "-y")
        assert refused.returncode == 1 and f"is attached to {old}: stop the service that mounts it first" in \
            refused.stderr, refused.stderr

        service.write_text(SERVICE.format(backend=backend, model="v1", app=textwrap.indent(APP, " " * 6)))
        _ok(stack.cli("apply", "-f", str(service), "-y", timeout=600))
        try:
            (second,) = until(lambda: [r for r in _serving(stack) if r["deployment"] == 1], 240, 0.5,
                              "deployment 1 serving")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{evidence(stack, 'volsvc')}") from None
        new, where = instance_of(second)
        assert new != old and where == zone
        # Deployment 1, on another instance, read what deployment 0 wrote; no new filesystem was made.
        until(lambda: read().text == "written by v0\nwritten by v1\n", 60, 0.5, "the second replica routed")
        assert attached_to() == new
        events = _ok(stack.cli("events", "volsvc"))
        assert f"volume my-cache ({kept['cloud_id']}) attached to {new} and mounted" in events
        assert f"attached to {new} and mounted (new" not in events
        assert (vpc.disks / kept["cloud_id"] / "fs" / "log").read_text() == "written by v0\nwritten by v1\n"
        # The instance volume stayed with each instance.
        assert [(vpc.workdir / i / "mnt/cache/seen").read_text() for i in (old, new)] == ["v0\n", "v1\n"]
        assert not booter.errors, booter.errors

        _ok(stack.cli("stop", "volsvc", "-y", timeout=300))
        until(lambda: attached_to() is None, 60, 0.5, "the volume detached")
        _ok(stack.cli("volume", "delete", "my-cache", "-y"))
        assert json.loads(_ok(stack.cli("volume", "list", "--json"))) == []
    finally:
        stack.stop()


def test_aws_a_volume_outlives_a_rollout(tmp_path, monkeypatch, fake_ec2, vpc):
    import boto3

    fake_ec2.seed_amis("us-east-1")
    stack = _stack(tmp_path, monkeypatch, vpc, "backends:\n  aws:\n    regions: [us-east-1]\n"
                                               "    ami_owners: [self]\n    public_ip: false\n")
    ec2 = boto3.client("ec2", region_name="us-east-1")

    def instance_of(replica: dict) -> tuple[str, str]:
        found = ec2.describe_instances(Filters=[
            {"Name": "tag:durastack:service", "Values": ["volsvc"]},
            {"Name": "tag:durastack:replica", "Values": [f"r{replica['replica']}-s{replica['submission']}"]}])
        (raw,) = [i for r in found["Reservations"] for i in r["Instances"]]
        return raw["InstanceId"], raw["Placement"]["AvailabilityZone"]

    def holder():
        volumes = ec2.describe_volumes(Filters=[{"Name": "tag:durastack:volume", "Values": ["my-cache"]}])["Volumes"]
        return next((a["InstanceId"] for v in volumes for a in v["Attachments"]), None)

    with vpcs.Booter(vpc, vpcs.moto_instances, list_disks=vpcs.moto_disks) as booter:
        _scenario(tmp_path, stack, vpc, booter, "aws", "us-east-1", "us-east-1b", instance_of, holder)
    live = ec2.describe_instances(Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}])
    assert [i for r in live["Reservations"] for i in r["Instances"]] == []
    assert ec2.describe_volumes(Filters=[{"Name": "tag:durastack:volume", "Values": ["my-cache"]}])["Volumes"] == []


def test_gcp_a_volume_outlives_a_rollout(tmp_path, monkeypatch, gce, vpc):
    stack = _stack(tmp_path, monkeypatch, vpc, f"backends:\n  gcp:\n    project_id: proj\n"
                                               f"    regions: [us-central1]\n    endpoint: {gce.url}\n"
                                               f"    public_ip: false\n")

    def instance_of(replica: dict) -> tuple[str, str]:
        label = f"r{replica['replica']}-s{replica['submission']}"
        (instance,) = [i for i in gce.all_instances() if i["labels"].get("durastack-replica") == label]
        return instance["name"], instance["zone"].rsplit("/", 1)[-1]

    def holder():
        users = [u for d in gce.all_disks() for u in d["users"]]
        return users[0].rsplit("/", 1)[-1] if users else None

    with vpcs.Booter(vpc, lambda: vpcs.gce_instances(gce), list_disks=lambda: vpcs.gce_disks(gce)) as booter:
        _scenario(tmp_path, stack, vpc, booter, "gcp", "us-central1", "us-central1-c", instance_of, holder)
    assert gce.all_instances() == [] and gce.all_disks() == []
