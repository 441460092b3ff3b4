"""A test replica's HTTP server on a Unix socket or an ephemeral 127.0.0.1 port."""

from __future__ import annotations

from typing import Awaitable, Callable, Optional

from aiohttp import web


async def serve(handle: Callable[[web.Request], Awaitable[web.StreamResponse]],
                unix_path: Optional[str] = None) -> tuple[web.AppRunner, str]:
    """Serve every path with ``handle``; returns the runner (to clean up) and the gateway address."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    if unix_path:
        await web.UnixSite(runner, unix_path).start()
        return runner, f"unix:{unix_path}"
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"127.0.0.1:{runner.addresses[0][1]}"
