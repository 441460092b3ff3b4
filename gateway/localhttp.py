"""Checks every loopback HTTP API makes before anything else (the gateway's control API, the codec endpoint).

A port on 127.0.0.1 is reachable from any web page the user opens: by DNS rebinding (a name of the attacker's
that first resolves to their server, then to 127.0.0.1, so the page's requests go to our port with their Host)
and by plain cross-site requests (CSRF, which the browser sends with the page's Origin). So a request must name
our own address in Host, and a browser request must come from an origin we serve.
"""

from __future__ import annotations

from typing import Iterable, Optional

from aiohttp import web

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def local_port(request: web.Request) -> Optional[int]:
    """The port the request arrived on (that of our listening socket)."""
    sock = request.transport.get_extra_info("sockname") if request.transport else None
    return sock[1] if sock else None


def own_hosts(request: web.Request, names: Iterable[str] = LOOPBACK_NAMES) -> set[str]:
    """Host header values naming this listener: a loopback name with the port the request came to."""
    port = local_port(request)
    return {f"{n}:{port}" for n in names}


def check_host(request: web.Request, names: Iterable[str] = LOOPBACK_NAMES) -> None:
    """403 unless Host names this loopback listener, port included (a rebound name fails here)."""
    host = request.headers.get("Host", "").lower()
    if host not in own_hosts(request, names):
        raise web.HTTPForbidden(text=f"Host {host!r} is not this server's address: only "
                                     f"{', '.join(sorted(own_hosts(request, names)))} (DNS rebinding guard)")


def check_origin(request: web.Request, allowed: Iterable[str], required: bool = False) -> None:
    """403 for a browser request from an origin not in ``allowed``; ``required``: a request without Origin too."""
    origin = request.headers.get("Origin")
    if origin is None and not required:
        return  # not from a browser page (curl, our clients); they pass the other checks or not
    if origin not in set(allowed):
        raise web.HTTPForbidden(text=f"requests from origin {origin!r} are not accepted here")
