"""HTTP clients that reach a replica's address (``unix:/path.sock`` or ``host:port``), over a TCP connection from
here or one made by a ``Connect`` (an SSH tunnel, a network namespace): what probes and engine metrics read with."""

from __future__ import annotations

import asyncio
import functools
import socket
import ssl
from typing import Awaitable, Callable, Optional

import httpcore
import httpx


@functools.cache
def _tls() -> ssl.SSLContext:
    """httpx's default TLS context, made once: a client made without one loads the CA bundle again, 18 ms of CPU
    here, and a readiness poll makes a client each time (every 0.2 s per starting replica: for 16 at once, more
    than a CPU). The same verification, only shared."""
    return httpx.create_ssl_context()


# Makes a connected socket to (host, port): how a worker reaches cloud instances when that is not a plain TCP
# connection from here (``backends.ssh.SocketFactory``: ``DURASTACK_SSH_NETNS``, the tests' simulated VPC).
Connect = Callable[[str, int], Awaitable[socket.socket]]


class _Stream(httpcore.AsyncNetworkStream):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    async def read(self, max_bytes: int, timeout: Optional[float] = None) -> bytes:
        try:
            return await asyncio.wait_for(self.reader.read(max_bytes), timeout)
        except asyncio.TimeoutError as e:
            raise httpcore.ReadTimeout(str(e)) from e
        except OSError as e:
            raise httpcore.ReadError(str(e)) from e

    async def write(self, buffer: bytes, timeout: Optional[float] = None) -> None:
        try:
            self.writer.write(buffer)
            await asyncio.wait_for(self.writer.drain(), timeout)
        except asyncio.TimeoutError as e:
            raise httpcore.WriteTimeout(str(e)) from e
        except OSError as e:
            raise httpcore.WriteError(str(e)) from e

    async def aclose(self) -> None:
        self.writer.close()

    def get_extra_info(self, info: str):
        return self.writer.get_extra_info("socket") if info == "socket" else None


class _ConnectBackend(httpcore.AsyncNetworkBackend):
    """httpcore's TCP connections made by a ``Connect``."""

    def __init__(self, connect: Connect):
        self.connect = connect

    async def connect_tcp(self, host: str, port: int, timeout: Optional[float] = None, local_address=None,
                          socket_options=None) -> httpcore.AsyncNetworkStream:
        try:
            sock = await asyncio.wait_for(self.connect(host, port), timeout)
            return _Stream(*await asyncio.open_connection(sock=sock))
        except asyncio.TimeoutError as e:
            raise httpcore.ConnectTimeout(str(e)) from e
        except OSError as e:
            raise httpcore.ConnectError(str(e)) from e

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def client_for(address: str, timeout: float, connect: Optional[Connect] = None) -> tuple[httpx.AsyncClient, str]:
    """An HTTP client that reaches ``address``, and the base URL to use with it. ``connect``: how a ``host:port``
    is connected to (default: a TCP connection from here)."""
    if address.startswith("unix:"):
        transport = httpx.AsyncHTTPTransport(uds=address[len("unix:"):], verify=_tls())
        return httpx.AsyncClient(transport=transport, timeout=timeout, verify=_tls()), "http://replica"
    if connect is not None:
        transport = httpx.AsyncHTTPTransport(verify=_tls())
        transport._pool = httpcore.AsyncConnectionPool(ssl_context=_tls(), network_backend=_ConnectBackend(connect))
        return httpx.AsyncClient(transport=transport, timeout=timeout, verify=_tls()), f"http://{address}"
    return httpx.AsyncClient(timeout=timeout, verify=_tls()), f"http://{address}"
