"""HTTP API of the gateway control app; the state logic lives in :class:`gateway.app.GatewayServer`."""

from __future__ import annotations

import hmac
import re
import secrets
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from aiohttp import web
from pydantic import ValidationError

from gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.nginx import NginxError
from gateway.localhttp import LOOPBACK_NAMES, check_host, check_origin, own_hosts
from gateway.render import HEALTH_SCOPE, INTERNAL_HEADER, activator_scope, scoped_secret
from gateway.upstreams import UpstreamRefused
from models.gateway import (CONTROL_TOKEN_FILE, TOKEN_PREFIX_CHARS, CreateTokenRequest, DuplicateToken, GatewayState, GatewayToken,
                            NewToken, PutServiceRequest, RegisterReplicaRequest, TokenList, UnknownToken,
                            Upstream, hash_token)

OPEN_PATHS = frozenset({"/healthz"})

if TYPE_CHECKING:
    from gateway.app import GatewayServer, Op

_ACTIVATOR_PATH = re.compile(r"/activator/(?P<service>[a-z0-9-]+)/.*")


def nginx_scope(request: web.Request) -> str | None:
    """The scope whose secret nginx may present on this exact path (gateway/render.py): its health probe on
    /healthz, or the activator of the service the path names, the raw path and the routed one agreeing."""
    raw = request.rel_url.raw_path
    if raw == "/healthz":
        return HEALTH_SCOPE
    m = _ACTIVATOR_PATH.fullmatch(raw)
    if m and request.match_info.get("service") == m["service"]:
        return activator_scope(m["service"])
    return None


def make_app(gw: GatewayServer) -> web.Application:
    async def body(request: web.Request, model):
        try:
            return model.model_validate_json(await request.read() or b"{}")
        except ValidationError as e:
            raise web.HTTPBadRequest(text=e.json(), content_type="application/json")

    async def change(op: Op) -> GatewayState:
        try:
            return await gw.apply(op)
        except DuplicateToken as e:
            raise web.HTTPConflict(text=str(e))
        except UnknownToken as e:
            raise web.HTTPNotFound(text=str(e))
        except ValueError as e:  # pydantic's ValidationError included
            raise web.HTTPBadRequest(text=str(e))
        except KeyError as e:
            raise web.HTTPNotFound(text=f"unknown service {e}")
        except NginxError as e:
            raise web.HTTPServiceUnavailable(text=f"gateway reload failed: {e}")

    async def put_service(request: web.Request) -> web.Response:
        name, spec = request.match_info["name"], await body(request, PutServiceRequest)
        state = await change(lambda s: s.put_service(name, spec.auth, spec.cold_start_timeout, spec.pass_authorization,
                                                     spec.strip_prefix, spec.rate_limits, spec.unavailable))
        return _json(state.services[name])

    async def delete_service(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        await change(lambda s: s.delete_service(name))
        return web.json_response({"service": name, "deleted": True})

    async def register(request: web.Request) -> web.Response:
        name, rid = request.match_info["name"], request.match_info["replica_id"]
        spec = await body(request, RegisterReplicaRequest)
        try:
            upstream = Upstream(replica_id=rid, group=spec.group, address=spec.address)
        except ValidationError as e:
            raise web.HTTPBadRequest(text=e.json(), content_type="application/json")
        try:
            gw.admit(upstream.address)
        except UpstreamRefused as e:
            raise web.HTTPBadRequest(text=str(e))
        state = await change(lambda s: s.register(name, upstream))
        return _json(state.services[name])

    async def unregister(request: web.Request) -> web.Response:
        name, rid = request.match_info["name"], request.match_info["replica_id"]
        await change(lambda s: s.unregister(name, rid))
        return web.json_response({"service": name, "replica_id": rid, "registered": False})

    async def create_token(request: web.Request) -> web.Response:
        spec = await body(request, CreateTokenRequest)
        token = secrets.token_urlsafe(32)
        record = GatewayToken(name=spec.name, prefix=token[:TOKEN_PREFIX_CHARS], token_sha256=hash_token(token),
                              created_at=datetime.now(timezone.utc),
                              services=tuple(sorted(set(spec.services))) if spec.services else None)
        await change(lambda s: s.add_token(record))  # answered once nginx accepts it
        return _json(NewToken(**record.info().model_dump(), token=token), status=201)

    async def tokens(request: web.Request) -> web.Response:
        return _json(TokenList(tokens=tuple(t.info() for _, t in sorted(gw.state.tokens.items()))))

    async def revoke_token(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        await change(lambda s: s.revoke_token(name))  # answered once no nginx worker accepts it any more
        return web.json_response({"name": name, "revoked": True})

    async def metrics(request: web.Request) -> web.Response:
        gw.collect()  # the access log up to now: a scrape sees every request logged before it
        return web.Response(body=gw.metrics.exposition(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def services(request: web.Request) -> web.Response:
        return _json(gw.state)

    async def stats(request: web.Request) -> web.Response:
        return _json(gw.collect())

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "generation": gw.state.generation})

    async def drained(request: web.Request) -> web.Response:
        # Old nginx workers finish in-flight requests after a reload; none left = drained.
        draining = gw.draining()
        return web.json_response({"drained": draining == 0, "draining_workers": draining})

    def passed_by_nginx(request: web.Request) -> str | None:
        """The scope of the secret nginx sent with this request, or None: honoured only on the path of its scope,
        the health probe's or one service's activator."""
        scope = nginx_scope(request)
        sent = request.headers.get(INTERNAL_HEADER, "").encode()
        if scope is None or not hmac.compare_digest(sent, scoped_secret(gw.internal_secret, scope).encode()):
            return None
        return scope

    async def activator(request: web.Request) -> web.StreamResponse:
        # Checked again where it is used: the secret nginx sent is this very service's.
        if passed_by_nginx(request) != activator_scope(request.match_info["service"]):
            raise web.HTTPForbidden(text="the activator serves only requests that nginx passed on")
        return await gw.activator.handle(request)

    @web.middleware
    async def control_auth(request: web.Request, handler):
        # Every local user reaches a loopback port, so the control API always needs its token: without it one
        # could mint gateway tokens, turn a service's auth off or send its traffic anywhere. Open: /healthz (a
        # generation number; nginx and the supervisor probe it). The activator serves a service's traffic, so
        # only nginx, after the route's own auth, may call it: nginx adds the internal secret.
        from_nginx = passed_by_nginx(request) is not None
        if not from_nginx:  # nginx passes the client's Host on; it checked what it serves itself
            if gw.loopback:  # off loopback (a cluster) names vary, and the token is what guards
                check_host(request, (*LOOPBACK_NAMES, gw.host))
            # No web page is ours: a browser may call this API only from its own origin.
            check_origin(request, {f"http://{h}" for h in own_hosts(request, (*LOOPBACK_NAMES, gw.host))})
        if request.path.startswith("/activator/"):
            if not from_nginx:
                raise web.HTTPForbidden(text="the activator serves only requests that nginx passed on")
        elif request.path not in OPEN_PATHS:
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), gw.control_token.encode()):
                raise web.HTTPUnauthorized(
                    text="the gateway's control API needs its token: DURASTACK_GATEWAY_CONTROL_TOKEN, or the "
                         f"{CONTROL_TOKEN_FILE} file in the gateway's directory ($DURASTACK_HOME/gateway)",
                    headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    app = web.Application(middlewares=[control_auth])
    app.add_routes([
        web.get("/healthz", healthz),
        web.get("/api/services", services),
        web.get("/api/stats", stats),
        web.get("/api/drained", drained),
        web.get("/metrics", metrics),
        web.get("/api/tokens", tokens),
        web.post("/api/tokens", create_token),
        web.delete("/api/tokens/{name}", revoke_token),
        web.put("/api/services/{name}", put_service),
        web.delete("/api/services/{name}", delete_service),
        web.put("/api/services/{name}/replicas/{replica_id:.+}", register),
        web.delete("/api/services/{name}/replicas/{replica_id:.+}", unregister),
        web.route("*", "/activator/{service}/{tail:.*}", activator),
    ])
    return app


def _json(model, status: int = 200) -> web.Response:
    return web.json_response(text=model.model_dump_json(), status=status)
