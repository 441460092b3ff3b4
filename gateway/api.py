"""HTTP API of the gateway control app; the state logic lives in :class:`gateway.app.GatewayServer`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web
from pydantic import ValidationError

from gateway.nginx import NginxError
from models.gateway import GatewayState, PutServiceRequest, RegisterReplicaRequest, Upstream

if TYPE_CHECKING:
    from gateway.app import GatewayServer, Op


def make_app(gw: GatewayServer) -> web.Application:
    async def body(request: web.Request, model):
        try:
            return model.model_validate_json(await request.read() or b"{}")
        except ValidationError as e:
            raise web.HTTPBadRequest(text=e.json(), content_type="application/json")

    async def change(op: Op) -> GatewayState:
        try:
            return await gw.apply(op)
        except ValueError as e:  # pydantic's ValidationError included
            raise web.HTTPBadRequest(text=str(e))
        except KeyError as e:
            raise web.HTTPNotFound(text=f"unknown service {e}")
        except NginxError as e:
            raise web.HTTPServiceUnavailable(text=f"gateway reload failed: {e}")

    async def put_service(request: web.Request) -> web.Response:
        name, spec = request.match_info["name"], await body(request, PutServiceRequest)
        state = await change(lambda s: s.put_service(name, spec.auth, spec.hashes(), spec.cold_start_timeout))
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
        state = await change(lambda s: s.register(name, upstream))
        return _json(state.services[name])

    async def unregister(request: web.Request) -> web.Response:
        name, rid = request.match_info["name"], request.match_info["replica_id"]
        await change(lambda s: s.unregister(name, rid))
        return web.json_response({"service": name, "replica_id": rid, "registered": False})

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

    app = web.Application()
    app.add_routes([
        web.get("/healthz", healthz),
        web.get("/api/services", services),
        web.get("/api/stats", stats),
        web.get("/api/drained", drained),
        web.put("/api/services/{name}", put_service),
        web.delete("/api/services/{name}", delete_service),
        web.put("/api/services/{name}/replicas/{replica_id:.+}", register),
        web.delete("/api/services/{name}/replicas/{replica_id:.+}", unregister),
        web.route("*", "/activator/{service}/{tail:.*}", gw.activator.handle),
    ])
    return app


def _json(model) -> web.Response:
    return web.json_response(text=model.model_dump_json())
