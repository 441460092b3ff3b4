"""Typed async client of the gateway control app, for activities and the CLI.

Each change call returns once the gateway serves it (the app answers only after the nginx reload).
"""

from __future__ import annotations

from typing import Optional, Sequence
from urllib.parse import quote

import httpx

from models.gateway import GatewayState, NewToken, RouteRateLimit, ServiceRoute, StatsReport, TokenInfo, TokenList


class GatewayError(RuntimeError):
    """The gateway answered with an error status."""

    def __init__(self, status: int, text: str):
        super().__init__(f"gateway answered {status}: {text}")
        self.status = status


class GatewayClient:
    """``async with GatewayClient("http://127.0.0.1:<control_port>") as gw: await gw.register(...)``"""

    def __init__(self, base_url: str, *, token: Optional[str] = None, timeout: float = 60.0,
                 transport: Optional[httpx.AsyncBaseTransport] = None):
        """``token``: the control API's bearer token, which every call but /healthz needs: ``Settings.control_token``
        (DURASTACK_GATEWAY_CONTROL_TOKEN, else the gateway's ``control.token`` in the home)."""
        # A reload waits for nginx (bounded on the gateway side); the timeout only needs to exceed that.
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout, transport=transport,
                                       headers=headers)

    async def __aenter__(self) -> "GatewayClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, json: Optional[dict] = None) -> httpx.Response:
        resp = await self._http.request(method, path, json=json)
        if resp.status_code >= 400:
            raise GatewayError(resp.status_code, resp.text)
        return resp

    async def put_service(self, name: str, auth: bool = True, cold_start_timeout: int | None = None,
                          pass_authorization: bool = False, strip_prefix: bool = True,
                          rate_limits: Sequence[RouteRateLimit] = (), unavailable: str = "") -> ServiceRoute:
        """Create or update a route; with ``auth`` it accepts the gateway's tokens. ``cold_start_timeout``
        (seconds a request may wait for a first replica, 0: 503 at once): None keeps the route's current
        value (300 for a new route). ``pass_authorization``: with auth, the replica receives the client's
        Authorization header (the gateway token); by default it is dropped. ``strip_prefix``: false passes
        /services/<name> on to the replica. ``rate_limits``: nginx answers 429 past a limit's burst. ``unavailable``:
        why the service cannot serve; while it has no replica, the gateway answers 503 with it at once."""
        body: dict = {"auth": auth}
        # Only what differs from the defaults, so an older gateway still takes the common route.
        if pass_authorization:
            body["pass_authorization"] = True
        if not strip_prefix:
            body["strip_prefix"] = False
        if rate_limits:
            body["rate_limits"] = [limit.model_dump(mode="json") for limit in rate_limits]
        if unavailable:
            body["unavailable"] = unavailable
        if cold_start_timeout is not None:
            body["cold_start_timeout"] = cold_start_timeout
        resp = await self._call("PUT", f"/api/services/{_seg(name)}", body)
        return ServiceRoute.model_validate_json(resp.content)

    async def delete_service(self, name: str) -> None:
        await self._call("DELETE", f"/api/services/{_seg(name)}")

    async def register(self, service: str, replica_id: str, group: str, address: str) -> ServiceRoute:
        resp = await self._call("PUT", f"/api/services/{_seg(service)}/replicas/{_seg(replica_id)}",
                                {"group": group, "address": address})
        return ServiceRoute.model_validate_json(resp.content)

    async def unregister(self, service: str, replica_id: str) -> None:
        await self._call("DELETE", f"/api/services/{_seg(service)}/replicas/{_seg(replica_id)}")

    async def drained(self) -> bool:
        """True once no nginx worker of an earlier configuration is still serving requests."""
        return bool((await self._call("GET", "/api/drained")).json()["drained"])

    async def services(self) -> GatewayState:
        return GatewayState.model_validate_json((await self._call("GET", "/api/services")).content)

    async def stats(self) -> StatsReport:
        return StatsReport.model_validate_json((await self._call("GET", "/api/stats")).content)

    async def create_token(self, name: str, services: Optional[list[str]] = None) -> NewToken:
        """A new token, accepted by every route with auth (of ``services`` only, if given) once this returns; only its
        hash is kept. A name in use answers 409."""
        body = {"name": name, **({"services": services} if services else {})}
        return NewToken.model_validate_json((await self._call("POST", "/api/tokens", body)).content)

    async def tokens(self) -> tuple[TokenInfo, ...]:
        return TokenList.model_validate_json((await self._call("GET", "/api/tokens")).content).tokens

    async def revoke_token(self, name: str) -> None:
        """Once this returns, no nginx worker accepts the token any more. An unknown name answers 404."""
        await self._call("DELETE", f"/api/tokens/{_seg(name)}")

    async def metrics(self) -> str:
        """The Prometheus text exposition of GET /metrics."""
        return (await self._call("GET", "/metrics")).text


def _seg(value: str) -> str:
    return quote(value, safe="")  # replica ids contain "/"
