"""HTTP readiness probes against a replica's address: ``unix:/path.sock`` or ``host:port``."""

from __future__ import annotations

import asyncio
import functools
import socket
import ssl
import time
from typing import Awaitable, Callable, Optional

import httpcore
import httpx

from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from models.failures import NOT_READY_YET
from models.service import ProbeSpec


@functools.cache
def _tls() -> ssl.SSLContext:
    """httpx's default TLS context, made once: a client made without one loads the CA bundle again, 18 ms of CPU
    here, and a readiness poll makes a client each time (every 0.2 s per starting replica: for 16 at once, more
    than a CPU). The same verification, only shared."""
    return httpx.create_ssl_context()


# Makes a connected socket to (host, port): how a worker reaches cloud instances when that is not a plain TCP
# connection from here (``activities.ssh.SocketFactory``: ``DURASTACK_SSH_NETNS``, the tests' simulated VPC).
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


async def run_probe(address: str, probe: ProbeSpec, connect: Optional[Connect] = None) -> bool:
    """One probe run: True on a 2xx answer."""
    client, base = client_for(address, probe.timeout, connect)
    async with client:
        try:
            response = await client.request(
                probe.method.upper(), base + probe.url, headers={h.name: h.value for h in probe.headers},
                content=probe.body.encode() if probe.body is not None else None)
        except httpx.HTTPError:
            return False
    return 200 <= response.status_code < 300


async def answers_http(address: str, timeout: float = 2.0, connect: Optional[Connect] = None) -> Optional[int]:
    """The status of ``GET /``, or None when nothing answers HTTP yet.

    A replica without probes is ready once its app answers HTTP at all (any status): the spec's
    "ready when running" would send the first requests to an app that is still starting.
    """
    client, base = client_for(address, timeout, connect)
    async with client:
        try:
            return (await client.get(base + "/")).status_code
        except httpx.HTTPError:
            return None


# Until a probe first passes, it runs again this soon, doubling up to its interval: an app that was not up yet at
# the first probe is seen about when it comes up, not a whole interval (15 s by default) later.
FIRST_RETRY_SECONDS = 0.1


class ProbeStreaks:
    """Success streaks of a replica's probes; ready when every streak reaches its ``ready_after``."""

    def __init__(self, probes: list[ProbeSpec]):
        self.probes = probes
        self.streaks = [0] * len(probes)
        self.due = [0.0] * len(probes)  # monotonic time each probe runs next
        self.retry: list[Optional[float]] = [FIRST_RETRY_SECONDS] * len(probes)  # None once it has passed

    def ready(self) -> bool:
        return all(s >= p.ready_after for s, p in zip(self.streaks, self.probes))

    async def run_due(self, address: str, now: float, connect: Optional[Connect] = None) -> None:
        for i, probe in enumerate(self.probes):
            if now >= self.due[i]:
                ok = await (run_probe(address, probe, connect) if connect else run_probe(address, probe))
                self.streaks[i] = self.streaks[i] + 1 if ok else 0
                retry = self.retry[i]
                if ok or retry is None:
                    self.retry[i], self.due[i] = None, now + probe.interval
                else:
                    self.retry[i], self.due[i] = retry * 2, now + min(retry, probe.interval)

    def end_attempt_past(self, until: Optional[float]) -> None:
        """Raise ``not_yet`` once the monotonic clock is past ``until`` (None: never) and no streak is under way: a
        readiness attempt may end there and a later one start again without losing one."""
        if until is not None and time.monotonic() >= until and \
                not any(s and s < p.ready_after for s, p in zip(self.streaks, self.probes)):
            raise self.not_yet()

    def said(self) -> str:
        """How far readiness is, for people (`ps -v`, the Web UI's pending activity)."""
        return f"not ready: probes {self.summary()}" if self.probes else "not ready: no HTTP answer yet"

    def not_yet(self) -> ApplicationError:
        """The end of one readiness attempt: retried by the workflow's policy, within the group's
        `startup_timeout`. Benign: a model that loads for an hour is no warning each minute."""
        return ApplicationError(self.said(), type=NOT_READY_YET, category=ApplicationErrorCategory.BENIGN)

    def summary(self) -> str:
        return " ".join("✓" if s >= p.ready_after else ("~" if s else "×")
                        for s, p in zip(self.streaks, self.probes))
