"""A private image on a cloud replica, from the CLI: `registry_auth` as dstack files write it (`${{ env.NAME }}` of an
entry taken from the caller's environment), with moto's EC2 and simulated hosts whose registry refuses the image
without its credentials (tests/fakes/fake_docker.py).

The replica pulls and serves; the token is nowhere in history, user data, the worker's and server's logs, or the
instance once the pull is over. Wrong credentials fail the replica once, in the registry's words, naming
`registry_auth`, instead of pulling again and again.
"""

from __future__ import annotations

import json
import textwrap

import boto3
import pytest

from tests.e2e import until
from tests.fakes import vpc as vpcs
from tests.fakes.ec2_faults import ec2_server, fake_ec2  # noqa: F401  (fixtures)
from tests.test_e2e_cloud_ssh import _apply, _history_has, _live_instances, _replicas, _requests, _stack, \
    vpc  # noqa: F401
from tests.test_ssh_path import APP

pytestmark = pytest.mark.skipif(vpcs.available() is not None, reason=str(vpcs.available()))

IMAGE = "registry.example.com/team/llm:1"
TOKEN = "glpat-e2e-registry-token-9012"
SERVICE = """\
type: service
name: {name}
port: 8000
backends: [aws]
image: {image}
env:
  - REGISTRY_TOKEN
  - MODEL=tiny
registry_auth:
  username: deploy-bot
  password: ${{{{ env.REGISTRY_TOKEN }}}}
{retry}resources:
  cpu: 2
  memory: 8GB
replicas: 1
commands:
  - |
{app}
"""


def _service(tmp_path, name: str, retry: str = ""):
    path = tmp_path / f"{name}.yml"
    path.write_text(SERVICE.format(name=name, image=IMAGE, retry=retry, app=textwrap.indent(APP, " " * 4)))
    return path


def test_aws_private_image_with_registry_auth_from_the_cli(tmp_path, monkeypatch, fake_ec2, vpc):
    fake_ec2.seed_amis("us-east-1")
    vpc.registry.parent.mkdir(parents=True, exist_ok=True)
    vpc.registry.write_text(json.dumps({IMAGE.rsplit(":", 1)[0]: f"deploy-bot:{TOKEN}"}))
    stack = _stack(tmp_path, monkeypatch, vpc, "backends:\n  aws:\n    regions: [us-east-1]\n"
                                               "    ami_owners: [self]\n    public_ip: false\n")
    stack.env["REGISTRY_TOKEN"] = TOKEN  # the CLI's environment only: `apply` reads the bare entry from there
    with vpcs.Booter(vpc, vpcs.moto_instances) as booter:
        try:
            _apply(stack, _service(tmp_path, "cloudsvc"))
            until(lambda: len(_replicas(stack)) == 1, 120, 0.5, "the private image's replica ready")
            assert set(_requests(stack, 4)) == {200}
            (host,) = vpc.hosts.values()
            assert (host.root / "containers" / "pulls").read_text().splitlines() == [IMAGE]
            assert not (host.root / "opt" / "job" / "docker").exists(), "the credentials outlived the pull"
            assert json.loads((host.root / "containers" / "durastack-job" / "spec.json").read_text())["image"] == IMAGE

            # The same credentials, but a wrong token: refused by the registry, the replica fails once, said so.
            stack.env["REGISTRY_TOKEN"] = "not-the-token"
            result = stack.cli("apply", "-f", str(_service(tmp_path, "wrongsvc", retry="retry: false\n")), "-y",
                               timeout=600)
            # Its follow may end before it shows the reason (a replica that fails in seconds): events keep it.
            assert result.returncode == 1 and "wrongsvc ended" in result.stderr, result.stdout + result.stderr
            events = stack.cli("events", "wrongsvc").stdout
            assert "unauthorized: authentication required" in events and "registry_auth" in events, events
            assert len(booter.user_data) == 2  # one instance each: the refused pull was not retried elsewhere

            assert not _history_has(stack, TOKEN) and not _history_has(stack, "not-the-token")
            assert not any(TOKEN in text for text in booter.user_data.values())
            logs = [p for p in stack.home.rglob("*.log")] + [stack.home / "server.out"]
            assert logs and not any(TOKEN in p.read_text(errors="replace") for p in logs if p.is_file())
            result = stack.cli("stop", "cloudsvc", "-y", timeout=300)
            assert result.returncode == 0, result.stdout + result.stderr
        finally:
            stack.stop()
    assert not booter.errors, booter.errors
    # The failed replica's instance went with it.
    assert _live_instances(boto3.client("ec2", region_name="us-east-1")) == []
