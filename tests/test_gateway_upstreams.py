"""The gateway accepts only upstream addresses its backends create (gateway/upstreams.py)."""

import json
import os

import pytest

from gateway.app import GatewayServer
from gateway.client import GatewayClient, GatewayError
from gateway.upstreams import ENV_DIRS, ENV_NETS, UpstreamPolicy, UpstreamRefused



def _refused(policy: UpstreamPolicy, address: str) -> str:
    with pytest.raises(UpstreamRefused) as e:
        policy.check(address)
    return str(e.value)


def test_default_policy_takes_the_local_backends_sockets_and_cloud_ips_only(tmp_path):
    home = tmp_path / "home"
    (home / "replicas" / "svc" / "0" / "r0-s0").mkdir(parents=True)
    (home / "run").mkdir()
    policy = UpstreamPolicy.default(home / "gateway", loopback=True, environ={},
                                    own=[("127.0.0.1", 8000), ("127.0.0.1", 8001)])
    for ok in (f"unix:{home}/replicas/svc/0/r0-s0/replica.sock", f"unix:{home}/run/0123abcd.sock",
               "127.0.0.1:40123", "10.0.3.4:8000", "54.12.1.9:8000"):
        policy.check(ok)
    assert "replica sockets live under" in _refused(policy, "unix:/var/run/docker.sock")
    assert ENV_DIRS in _refused(policy, "unix:/run/systemd/private")  # a root-only socket
    assert "link-local" in _refused(policy, "169.254.169.254:80")  # the cloud metadata service
    assert "gateway itself" in _refused(policy, "127.0.0.1:8001")
    for bad in (f"unix:{home}/replicas/../../x.sock", f"unix:{tmp_path}/elsewhere.sock", "0.0.0.0:80",
                "224.0.0.1:80"):
        _refused(policy, bad)
    # A link inside an allowed directory that leads out of it: what nginx would reach is what counts.
    (home / "run" / "evil.sock").symlink_to("/var/run/docker.sock")
    _refused(policy, f"unix:{home}/run/evil.sock")

    cluster = UpstreamPolicy.default(home / "gateway", loopback=False, environ={})
    assert ENV_NETS in _refused(cluster, "127.0.0.1:40123")  # off loopback, the host's own ports are not replicas
    cluster.check("10.0.3.4:8000")
    vpc = UpstreamPolicy.default(home / "gateway", loopback=False,
                                 environ={ENV_NETS: "10.0.0.0/16", ENV_DIRS: str(tmp_path / "socks")})
    vpc.check("10.0.3.4:8000")
    vpc.check(f"unix:{tmp_path}/socks/a.sock")
    for bad in ("10.1.0.1:8000", "54.12.1.9:8000", f"unix:{home}/run/x.sock"):
        _refused(vpc, bad)
    with pytest.raises(ValueError, match=ENV_NETS):
        UpstreamPolicy.default(home / "gateway", loopback=False, environ={ENV_NETS: "not-a-net"})


@pytest.mark.asyncio(loop_scope="session")
async def test_register_refuses_other_addresses_with_400(tmpdir_short):
    home = tmpdir_short
    gw = GatewayServer(os.path.join(home, "gateway"))
    await gw.start()
    try:
        async with GatewayClient(gw.control_url, token=gw.control_token) as c:
            await c.put_service("svc")
            for address in ("unix:/var/run/docker.sock", "169.254.169.254:80", f"unix:{home}/x.sock",
                            f"127.0.0.1:{gw.control_port}", f"127.0.0.1:{gw.listen_port}"):
                with pytest.raises(GatewayError) as e:
                    await c.register("svc", "svc/0/r0-s0", "0", address)
                assert e.value.status == 400 and "refused" in str(e.value), address
            await c.register("svc", "svc/0/r0-s0", "0", f"unix:{home}/replicas/svc/0/r0-s0/replica.sock")
            assert [u.address for u in (await c.services()).services["svc"].upstreams] == \
                [f"unix:{home}/replicas/svc/0/r0-s0/replica.sock"]
        port = gw.listen_port
    finally:
        await gw.stop()
    # A saved state naming a refused address (written by hand, or before the policy) loses it at start.
    saved = json.loads(gw.state_path.read_text())
    saved["services"]["svc"]["upstreams"].append({"replica_id": "svc/0/r9-s0", "group": "0",
                                                  "address": "unix:/var/run/docker.sock"})
    gw.state_path.write_text(json.dumps(saved))
    again = GatewayServer(os.path.join(home, "gateway"), listen_port=port)
    await again.start()
    try:
        assert [u.replica_id for u in again.state.services["svc"].upstreams] == ["svc/0/r0-s0"]
        assert "docker.sock" not in again._nginx.conf_path.read_text()
    finally:
        await again.stop()
