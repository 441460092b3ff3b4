"""The Temporal client every CLI command uses: same data converter as the worker, bounded waits.

A control plane that is not there must end a command quickly with exit 2 (``ControlPlaneDown``),
never with a hang or a traceback.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Optional, TypeVar

from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from connect.codec import CodecKeyError
from connect.connection import TemporalConfigError, client_options, connect_failure, uses_tls
from models.settings import Settings

CONNECT_TIMEOUT = 5.0
RPC_TIMEOUT = 10.0
EXIT_CONTROL_PLANE_DOWN = 2
# Transport-level failures: the server is unreachable or too slow. Other statuses (NOT_FOUND,
# INVALID_ARGUMENT, ...) are answers from a live server and belong to the calling command.
_DOWN_STATUSES = {RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED}

T = TypeVar("T")


class ControlPlaneDown(RuntimeError):
    """Temporal cannot be reached; the CLI prints the message and exits 2."""

    def __init__(self, message: str, address: Optional[str] = None):
        super().__init__(message)
        self.address = address


def down_message(address: str) -> str:
    return f"control plane not running at {address}; start it with `durastack server`"


def refused_message(settings: Settings) -> str:
    if settings.temporal_address is None:
        return (f"the Temporal at {settings.address} refused this client: it takes the key of the durastack home that "
                f"runs it, and {settings.home} is not that home (or this user cannot read its codec.key)")
    return f"the Temporal at {settings.address} refused this client: check DURASTACK_TEMPORAL_API_KEY"


async def connect(settings: Settings, timeout: float = CONNECT_TIMEOUT) -> Client:
    """A connected client (connect.connection: codec, TLS), or ControlPlaneDown within ``timeout``."""
    options = client_options(settings)  # TemporalConfigError: a user error, see run()
    try:
        return await asyncio.wait_for(Client.connect(**options), timeout)
    # The SDK reports a refused/failed connection as a plain RuntimeError("Failed client connect: ...").
    except (asyncio.TimeoutError, RuntimeError, OSError) as e:
        if "Unauthenticated" in str(e):
            raise ControlPlaneDown(refused_message(settings), settings.address) from e
        if uses_tls(settings):  # a handshake or certificate problem is likelier than "down"
            raise ControlPlaneDown(connect_failure(settings, e), settings.address) from e
        raise ControlPlaneDown(down_message(settings.address), settings.address) from e


async def rpc(call: Awaitable[T], settings: Settings, timeout: float = RPC_TIMEOUT) -> T:
    """Await ``call`` for at most ``timeout``; unreachable/timed-out becomes ControlPlaneDown."""
    try:
        return await asyncio.wait_for(call, timeout)
    except asyncio.TimeoutError as e:
        raise ControlPlaneDown(f"control plane at {settings.address} did not answer within {timeout:g}s; "
                               "is `durastack server` running?", settings.address) from e
    except RPCError as e:
        if e.status in _DOWN_STATUSES:
            raise ControlPlaneDown(down_message(settings.address), settings.address) from e
        raise


def run(main: Awaitable[T]) -> T:
    """Run a command's coroutine; ControlPlaneDown → message on stderr and exit 2."""
    import typer
    from rich.console import Console

    try:
        return asyncio.run(main)  # type: ignore[arg-type]
    except ControlPlaneDown as e:
        Console(stderr=True, highlight=False, soft_wrap=True).print(str(e), style="red", markup=False)
        raise typer.Exit(EXIT_CONTROL_PLANE_DOWN)
    except (TemporalConfigError, CodecKeyError) as e:  # settings to fix: a user error
        Console(stderr=True, highlight=False, soft_wrap=True).print(str(e), style="red", markup=False)
        raise typer.Exit(1)
