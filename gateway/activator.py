"""The activator: scale from zero without failed requests.

While a service has no ready replica, nginx proxies its requests (auth passed, prefix stripped) to
the control app at ``/activator/<service>/<path>``. There each request is **held** until a replica
of the service is registered — a per-service :class:`asyncio.Condition`, notified by the gateway
once nginx serves the registration — and then forwarded by the activator itself to one of the
registered upstreams (round-robin over the upstreams at that moment), its response streamed back
chunk by chunk. Requests already routed by nginx at that point stay on this path; new ones go
straight to the replica.

A route that says why the service cannot serve (``unavailable``: its replicas crash-loop, or it failed) is
answered 503 at once with that reason (JSON ``reason`` and the ``X-Durastack-Unavailable`` header), and requests
held when it is set are answered so too: waiting for a replica that keeps failing only delays the error.

A request still held after the route's ``cold_start_timeout`` gets 503 with ``Retry-After: 5``.
At most ``max_held`` requests wait per service; beyond that, 503 at once. A client that goes away
while held is released (the gateway runs aiohttp with handler cancellation on).

Every request reaching the activator counts as a replica hit in the rate windows **when it
arrives** (nginx logs it only when it completes, with hit ``2``, and the collector skips those
lines): so held requests are what lets the autoscaler scale the service up from zero.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from backends import local_net
from gateway.render import INTERNAL_HEADER
from gateway.stats import StatsCollector
from models.gateway import GatewayState, ServiceRoute, Upstream

log = logging.getLogger("durastack.gateway.activator")

MAX_HELD = 1000  # per service
RETRY_AFTER = "5"
UNAVAILABLE_HEADER = "X-Durastack-Unavailable"
CONNECT_TIMEOUT = 10.0  # as nginx's proxy_connect_timeout
CHUNK = 1 << 16
# RFC 9110 7.6.1, plus Proxy-Connection; the tokens a Connection header lists go too.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                        "proxy-authorization", "te", "trailer", "trailers", "transfer-encoding", "upgrade"})
# The client must not add what the original request did not carry.
_SKIP_AUTO = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")


def end_to_end(headers) -> CIMultiDict:
    """``headers`` without hop-by-hop ones, nor nginx's secret to the activator (a replica that learnt it could
    reach every service through the activator); repeated headers (Set-Cookie) are kept."""
    drop = set(HOP_BY_HOP) | {INTERNAL_HEADER.lower()}
    for value in headers.getall("Connection", ()):
        drop.update(t.strip().lower() for t in value.split(","))
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in drop)


def rotate(upstreams: tuple[Upstream, ...], start: int) -> list[Upstream]:
    """The upstreams in the order to try them: round-robin ``start``, then the others in turn."""
    n = len(upstreams)
    return [upstreams[(start + i) % n] for i in range(n)]


def _error(status: int, service: str, message: str, retry: bool = False) -> web.Response:
    headers = {"Retry-After": RETRY_AFTER} if retry else None
    return web.json_response({"error": message, "service": service}, status=status, headers=headers)


def _unavailable(service: str, reason: str) -> web.Response:
    """503 with why the service cannot serve; the header carries it in printable ASCII (a header takes no more)."""
    header = "".join(c if " " <= c <= "~" else "?" for c in reason)
    return web.json_response({"error": f"service {service} cannot serve now", "service": service, "reason": reason},
                             status=503, headers={"Retry-After": RETRY_AFTER, UNAVAILABLE_HEADER: header})


class Activator:
    """Holds and forwards requests of services without a ready replica; its ``handle`` is the route."""

    def __init__(self, state: Callable[[], GatewayState], collector: StatsCollector, *, max_held: int = MAX_HELD,
                 netns: Path | None = None):
        """``netns``: the gateway namespace nginx runs in, whose local replicas are reached from there."""
        self._state = state
        self.collector = collector
        self.max_held = max_held
        self.held: Counter[str] = Counter()  # waiting right now
        self.held_total: Counter[str] = Counter()  # ever held since start
        self._ready: dict[str, asyncio.Condition] = {}  # only while someone waits
        self._rr: Counter[str] = Counter()
        self._stopping = False
        self.netns = netns

    async def notify(self) -> None:
        """Wake the held requests: the state nginx serves has changed (or the gateway stops)."""
        for cond in list(self._ready.values()):
            async with cond:
                cond.notify_all()

    def forget(self, routed: Iterable[str]) -> None:
        """A deleted service's count goes with it; applied again, it starts from 0."""
        for name in set(self.held_total) - set(routed) - set(self.held):
            del self.held_total[name]
        for name in set(self._rr) - set(routed):
            del self._rr[name]

    async def stop(self) -> None:
        """Answer every held request 503 now, so nginx can quit without waiting for them."""
        self._stopping = True
        await self.notify()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["service"]
        if name not in self._state().services:
            return _error(404, name, f"service {name} is not routed")
        arrived, started = time.time(), time.monotonic()
        self.collector.count(name, arrived)  # counted at arrival: held requests drive scale-up
        try:
            return await self._serve(request, name)
        finally:
            self.collector.add_request_time(name, arrived, time.monotonic() - started)

    async def _serve(self, request: web.Request, name: str) -> web.StreamResponse:
        route = self._state().services[name]
        if not route.upstreams:
            timeout = route.cold_start_timeout
            if route.unavailable:
                return _unavailable(name, route.unavailable)
            if self._stopping:
                return _error(503, name, "gateway stopping", retry=True)
            if timeout <= 0:
                return _error(503, name, f"service {name} has no ready replica, retry", retry=True)
            if self.held[name] >= self.max_held:
                return _error(503, name, f"service {name} has no ready replica and {self.held[name]} "
                                         "requests already waiting, retry", retry=True)
            route = await self._hold(name, timeout)
            if route is None:
                return _error(404, name, f"service {name} was deleted while the request waited")
            if not route.upstreams and route.unavailable:
                return _unavailable(name, route.unavailable)
            if not route.upstreams:
                why = "gateway stopping" if self._stopping else f"no ready replica within {timeout}s"
                return _error(503, name, f"service {name}: {why}, retry", retry=True)
        return await self._forward(request, name, route.upstreams)

    async def _hold(self, name: str, timeout: float) -> ServiceRoute | None:
        """Wait until the service has an upstream, is deleted, cannot serve, the gateway stops, or ``timeout``."""
        def route() -> ServiceRoute | None:
            return self._state().services.get(name)

        self.held[name] += 1
        self.held_total[name] += 1
        cond = self._ready.setdefault(name, asyncio.Condition())
        try:
            async with asyncio.timeout(timeout):
                async with cond:
                    await cond.wait_for(lambda: self._stopping or (r := route()) is None or bool(r.upstreams)
                                        or bool(r.unavailable))
        except TimeoutError:
            pass
        finally:  # also when the client went away (cancelled)
            self.held[name] -= 1
            if not self.held[name]:
                del self.held[name]
                self._ready.pop(name, None)  # nobody else uses it: each waiter counts in held
        return route()

    async def _forward(self, request: web.Request, name: str, upstreams: tuple[Upstream, ...]) -> web.StreamResponse:
        start = self._rr[name]
        self._rr[name] += 1
        prefix = f"/activator/{name}"
        tail = request.rel_url.raw_path[len(prefix):] or "/"  # nginx already stripped the service prefix
        query = request.rel_url.raw_query_string
        target = tail + (f"?{query}" if query else "")
        for upstream in rotate(upstreams, start):
            try:
                return await self._proxy(request, upstream, target)
            except aiohttp.ClientConnectorError as e:  # nothing sent yet: the next one may take it
                log.warning("activator: %s unreachable for %s: %s", upstream.address, name, e)
        return _error(502, name, f"no replica of {name} accepted the connection")

    async def _proxy(self, request: web.Request, upstream: Upstream, target: str) -> web.StreamResponse:
        if upstream.address.startswith("unix:"):
            connector, host = aiohttp.UnixConnector(path=upstream.address[len("unix:"):]), "localhost"
        elif self.netns is not None:  # local replicas are reached from the gateway namespace, as nginx reaches them
            connector = aiohttp.TCPConnector(socket_factory=lambda info: local_net.socket_in(self.netns, info[0]))
            host = upstream.address
        else:
            connector, host = aiohttp.TCPConnector(), upstream.address
        url = URL(f"http://{host}{target}", encoded=True)
        headers = end_to_end(request.headers)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT)
        # One session per forwarded request: this path only serves cold starts, and nothing is
        # left open to a replica that goes away. No decompression: bytes pass as they are.
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                         skip_auto_headers=_SKIP_AUTO, cookie_jar=aiohttp.DummyCookieJar()) as http:
            if request.headers.get("Upgrade", "").lower() == "websocket":
                return await self._websocket(request, http, url, headers)
            data = request.content.iter_chunked(CHUNK) if request.body_exists else None
            async with http.request(request.method, url, headers=headers, data=data,
                                    allow_redirects=False) as up:
                resp = web.StreamResponse(status=up.status, reason=up.reason, headers=end_to_end(up.headers))
                await resp.prepare(request)
                try:
                    async for chunk in up.content.iter_any():  # as it comes: SSE and chunked streams pass
                        await resp.write(chunk)
                except aiohttp.ClientError:
                    # The replica broke off mid-body: end the connection, do not let it look complete.
                    if request.transport is not None:
                        request.transport.abort()
                    raise
                await resp.write_eof()
                return resp

    async def _websocket(self, request: web.Request, http: aiohttp.ClientSession, url: URL,
                         headers: CIMultiDict) -> web.StreamResponse:
        """Bridge a websocket: connect to the replica first, then accept the client's upgrade."""
        protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        headers = CIMultiDict((k, v) for k, v in headers.items() if not k.lower().startswith("sec-websocket-"))
        async with http.ws_connect(url, headers=headers, protocols=protocols, autoping=True) as up:
            ws = web.WebSocketResponse(protocols=(up.protocol,) if up.protocol else ())
            await ws.prepare(request)

            async def pump(src, dst) -> None:
                async for msg in src:
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        await dst.send_str(msg.data)
                    elif msg.type == aiohttp.WSMsgType.BINARY:
                        await dst.send_bytes(msg.data)
                    else:
                        break
                await dst.close(code=src.close_code or aiohttp.WSCloseCode.OK)

            tasks = [asyncio.create_task(pump(ws, up)), asyncio.create_task(pump(up, ws))]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            await ws.close()
            return ws
