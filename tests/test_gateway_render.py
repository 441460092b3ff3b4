"""Gateway models and nginx config rendering: pure, no nginx process."""

import pytest
from multidict import CIMultiDict
from pydantic import ValidationError

from gateway.activator import end_to_end, rotate
from gateway.render import render_config
from datetime import datetime, timezone

from models.gateway import (DuplicateToken, GatewayState, GatewayToken, PutServiceRequest, ServiceRoute, ServiceStats,
                            UnknownToken, Upstream, hash_token)

KW = dict(listen_port=8080, runtime_dir="/run/gw", access_log="/run/gw/access.log", control_port=9090)


def up(rid: str, addr: str, group: str = "0") -> Upstream:
    return Upstream(replica_id=rid, group=group, address=addr)


def token(name: str, plain: str) -> GatewayToken:
    return GatewayToken(name=name, prefix=plain[:6], token_sha256=hash_token(plain),
                        created_at=datetime(2026, 11, 29, tzinfo=timezone.utc))


def state_with(*routes: ServiceRoute, generation: int = 7, tokens: tuple[GatewayToken, ...] = ()) -> GatewayState:
    return GatewayState(services={r.name: r for r in routes}, tokens={t.name: t for t in tokens}, generation=generation)


@pytest.mark.parametrize("addr", ["unix:/tmp/r.sock", "127.0.0.1:8000", "10.0.0.5:1"])
def test_upstream_accepts_socket_and_ipv4(addr):
    assert up("svc/0/r3-s0", addr).address == addr


@pytest.mark.parametrize("addr", [
    "unix:relative.sock", "localhost:8000", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000",
    "127.0.0.1:80; evil", "unix:/tmp/a b.sock", "unix:/" + "x" * 200, "http://127.0.0.1:80"])
def test_upstream_rejects_bad_addresses(addr):
    with pytest.raises(ValidationError):
        up("r", addr)


@pytest.mark.parametrize("name", ["Svc", "1svc", "svc_1", "svc.x", "", "a" * 64])
def test_service_name_must_be_a_dns_label(name):
    with pytest.raises(ValidationError):
        ServiceRoute(name=name)


def test_tokens_are_global_hashed_and_named():
    s1 = GatewayState().put_service("svc", True).add_token(token("ci", "s3cret-value"))
    assert s1.generation == 2 and "s3cret-value" not in s1.model_dump_json()
    assert s1.tokens["ci"].info().model_dump() == {"name": "ci", "prefix": "s3cret", "services": None,
                                                   "created_at": datetime(2026, 11, 29, tzinfo=timezone.utc)}
    with pytest.raises(DuplicateToken):  # a name is never reused silently
        s1.add_token(token("ci", "another"))
    s2 = s1.revoke_token("ci")
    assert s2.tokens == {} and s2.generation == 3 and s2.services == s1.services
    with pytest.raises(UnknownToken):
        s2.revoke_token("ci")
    for bad in dict(name="has space"), dict(name="-x"), dict(prefix="too-long"), dict(token_sha256="plain"):
        with pytest.raises(ValidationError):
            GatewayToken(**{**token("ok", "abcdefgh").model_dump(), **bad})
    with pytest.raises(ValidationError):  # routes no longer take tokens of their own
        PutServiceRequest.model_validate_json('{"auth": true, "tokens": ["t"]}')


def test_state_transitions_bump_generation_and_are_idempotent():
    s0 = GatewayState()
    s1 = s0.put_service("svc", True)
    s2 = s1.register("svc", up("svc/0/r0-s0", "127.0.0.1:8000"))
    assert (s1.generation, s2.generation) == (1, 2)
    assert s2.register("svc", up("svc/0/r0-s0", "127.0.0.1:8000")) is s2  # same registration: no change
    s3 = s2.register("svc", up("svc/0/r0-s0", "127.0.0.1:8001"))  # re-registration replaces the address
    assert [u.address for u in s3.services["svc"].upstreams] == ["127.0.0.1:8001"]
    assert s3.unregister("svc", "nope") is s3 and s3.unregister("other", "x") is s3
    s4 = s3.put_service("svc", False)  # route settings change, replicas stay
    assert s4.services["svc"].upstreams == s3.services["svc"].upstreams and not s4.services["svc"].auth
    assert s4.delete_service("svc").services == {} and s4.delete_service("nope") is s4
    with pytest.raises(KeyError):
        s0.register("svc", up("r", "127.0.0.1:1"))


def test_state_round_trips_through_json():
    s = GatewayState().put_service("a", True).register("a", up("a/0/r0-s0", "unix:/s.sock"))
    s = s.add_token(token("t", "xyz"))
    assert GatewayState.model_validate_json(s.model_dump_json()) == s


def test_render_routes_upstreams_and_auth():
    route = ServiceRoute(name="my-svc", upstreams=(
        up("my-svc/0/r0-s0", "unix:/run/r0.sock"), up("my-svc/1/r1-s0", "127.0.0.1:8001", "1")))
    conf = render_config(state_with(route, tokens=(token("a", "a"), token("b", "b"))), **KW)
    # one round-robin upstream block mixing a socket and a TCP replica, with keepalive
    block = conf.split("upstream ds_svc_my_svc {")[1].split("}")[0]
    assert "server unix:/run/r0.sock;" in block and "server 127.0.0.1:8001;" in block and "keepalive" in block
    assert "listen 127.0.0.1:8080 default_server;" in conf and "server_name my-svc.localhost;" in conf
    assert "location /services/my-svc/ {" in conf
    assert conf.count("proxy_pass http://ds_svc_my_svc/;") == 2  # path route strips the prefix; host route too
    # auth: the gateway's two digests accepted, a missing header is 401 and another token 403, before the hit flag
    accepted = ["default", "unknown;", f'"{hash_token("a")}"', "ok;", "#", "a", f'"{hash_token("b")}"', "ok;", "#", "b"]
    fresh = conf.split("map $ds_token_sha256 $ds_fresh_token {")[1].split("}")[0]
    cached = conf.split("map $ds_cached_sha256 $ds_cached_token {")[1].split("}")[0]
    assert fresh.split() == accepted and cached.split() == ['""', "miss;", *accepted]  # a revoked digest: unknown
    body = conf.split("location /services/my-svc/ {")[1].split("}\n        }")[0]
    assert body.index("return 401") < body.index("return 403") < body.index("set $ds_hit 1")
    # the digest cache: njs hashes only on a miss, and a header's digest is stored only once it passed
    assert body.index("if ($ds_token = miss) { set $ds_token $ds_fresh_token; }") < body.index("return 403") < \
        body.index("set $ds_cached_sha256 $ds_token_sha256;")
    assert "keyval $http_authorization $ds_cached_sha256 zone=ds_token_digests;" in conf and "state=" not in conf
    for directive in ("proxy_buffering off;", "proxy_request_buffering off;", "proxy_http_version 1.1;",
                      "proxy_set_header Connection $ds_connection;", "proxy_set_header Upgrade $http_upgrade;",
                      "daemon off;", "pid /run/gw/nginx.pid;", "proxy_temp_path /run/gw/tmp/proxy;",
                      "access_log /run/gw/access.log ds_stat buffer=64k flush=500ms;", 'return 200 "7";'):
        assert directive in conf, directive


def test_render_without_auth_or_replicas_uses_activator():
    conf = render_config(state_with(ServiceRoute(name="idle", auth=False)), **KW)
    assert "return 401" not in conf and "upstream ds_svc_idle" not in conf
    assert conf.count("proxy_pass http://ds_control/activator/idle/;") == 2
    assert "upstream ds_control { server 127.0.0.1:9090;" in conf


def test_activator_location_allows_the_hold_and_streams():
    route = ServiceRoute(name="idle", cold_start_timeout=120)
    conf = render_config(state_with(route), **KW)
    body = conf.split("location /services/idle/ {")[1].split("}\n        }")[0]
    # hold (cold start) plus what a replica may take, like a direct request; hit "2": the activator counts it
    for directive in ("set $ds_hit 2;", "proxy_read_timeout 3720s;", "proxy_send_timeout 3720s;",
                      "proxy_buffering off;", "proxy_pass http://ds_control/activator/idle/;"):
        assert directive in body and conf.count(" " * 12 + directive) == 2, directive
    assert body.index("return 403") < body.index("set $ds_hit 2")
    # with a replica: the plain location, a replica hit, global timeouts
    conf = render_config(state_with(route.model_copy(update={"upstreams": (up("idle/0/r0", "127.0.0.1:1"),)})), **KW)
    assert "set $ds_hit 1;" in conf and "set $ds_hit 2;" not in conf and "3720s" not in conf
    assert "    proxy_read_timeout 3600s;" in conf


def test_cold_start_timeout_defaults_validates_and_is_kept():
    assert ServiceRoute(name="a").cold_start_timeout == 300
    old_json = ('{"services": {"a": {"name": "a", "auth": false, "token_sha256": ["%s"], "upstreams": []}}, '
                '"generation": 3}' % hash_token("t"))
    old = GatewayState.model_validate_json(old_json)  # an older state.json: per-route tokens are dropped
    assert old.services["a"].cold_start_timeout == 300 and "token_sha256" not in old.services["a"].model_dump()
    assert old.tokens == {}
    assert PutServiceRequest.model_validate_json('{"auth": true}').cold_start_timeout is None
    for bad in (-1, 86401, "soon"):
        with pytest.raises(ValidationError):
            PutServiceRequest(cold_start_timeout=bad)
    s = GatewayState().put_service("a", True, cold_start_timeout=5)
    assert s.put_service("a", False).services["a"].cold_start_timeout == 5  # omitted: kept
    assert s.put_service("a", True, 0).services["a"].cold_start_timeout == 0
    assert s.put_service("a", True, 5) is s  # same settings: no new generation


def test_service_stats_held_fields_default_to_zero():
    old = '{"service": "a", "windows": {"30": {"requests": 1, "request_time": 0.1}}, "per_group": null}'
    stats = ServiceStats.model_validate_json(old)
    assert (stats.held, stats.held_total) == (0, 0)
    assert ServiceStats.model_json_schema()["properties"]["held"]["description"]


def test_round_robin_order_and_hop_by_hop_headers():
    ups = tuple(up(f"s/0/r{i}", f"127.0.0.1:{8000 + i}") for i in range(3))
    assert [u.replica_id for u in rotate(ups, 4)] == ["s/0/r1", "s/0/r2", "s/0/r0"]
    assert [rotate(ups, k)[0].replica_id for k in range(4)] == ["s/0/r0", "s/0/r1", "s/0/r2", "s/0/r0"]
    h = CIMultiDict([("Connection", "keep-alive, X-Private"), ("Keep-Alive", "5"), ("X-Private", "1"),
                     ("Transfer-Encoding", "chunked"), ("Upgrade", "h2c"), ("TE", "trailers"),
                     ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2"), ("Content-Length", "3")])
    assert list(end_to_end(h).items()) == [("Set-Cookie", "a=1"), ("Set-Cookie", "b=2"), ("Content-Length", "3")]


def test_render_empty_state_has_control_locations_and_404():
    conf = render_config(GatewayState(), **KW)
    assert "location = /healthz" in conf and "/api/" not in conf
    assert "location / { return 404; }" in conf and 'return 200 "0";' in conf


def test_every_location_to_the_control_app_fixes_its_path_and_carries_its_own_secret():
    """proxy_pass without a URI passes the client's raw path on (dot segments nginx resolved to this location):
    every location that reaches the control app names its path, and sends the secret of that path's scope."""
    import re

    from gateway.render import HEALTH_SCOPE, activator_scope, scoped_secret
    from models.gateway import RouteRateLimit

    routes = (ServiceRoute(name="idle", auth=True, rate_limits=(RouteRateLimit(prefix="/v1", rps=1),)),
              ServiceRoute(name="keep", auth=False, strip_prefix=False))
    conf = render_config(state_with(*routes), **KW, internal_secret="base")
    passes = re.findall(r"proxy_pass (http://ds_control\S*);", conf)
    assert len(passes) == 1 + 2 * 2 + 2 and all(p.startswith("http://ds_control/") for p in passes), passes
    assert "proxy_pass http://ds_control/healthz;" in conf and '"^/healthz([?]|$)") { return 404; }' in conf
    secrets = set(re.findall(r'set \$ds_internal "(\w*)";', conf))
    assert secrets == {"", *(scoped_secret("base", s) for s in (HEALTH_SCOPE, activator_scope("idle"),
                                                                  activator_scope("keep")))}
    for block in re.findall(r"location [^{]*\{(?:[^{}]|\{[^{}]*\})*\}", conf):
        for target in re.findall(r"proxy_pass http://ds_control/activator/([a-z0-9-]+)/", block):
            assert f'"{scoped_secret("base", activator_scope(target))}"' in block, block
