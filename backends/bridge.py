"""Unix-socket → TCP forwarder that runs inside a replica's network namespace.

Filesystem sockets cross network namespaces, so nginx and probes on the host reach the app (which
listens on 127.0.0.1:<port> inside its own namespace) through ``<work_dir>/.durastack/replica.sock``.

Stdlib only: the local backend runs it by path with ``python -I``, outside durastack's venv
assumptions. Also runnable as ``python -m backends.bridge --socket PATH --port N``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys

CONNECT_TIMEOUT = 2.0
# A refused connect usually means the app is still starting; retry briefly, then close the client
# promptly so that probes and nginx see a fast failure instead of a hang.
CONNECT_ATTEMPTS = 3
RETRY_DELAY = 0.05
CHUNK = 64 * 1024
DRAIN_TIMEOUT = 30.0  # on SIGTERM, how long open connections may finish (the backend SIGKILLs sooner)


async def _try_connect(port: int):
    last: Exception | None = None
    for attempt in range(CONNECT_ATTEMPTS):
        for host in ("127.0.0.1", "::1"):  # apps bound to ::1 only are reachable too
            try:
                return await asyncio.open_connection(host, port)
            except OSError as e:
                last = e
        if attempt + 1 < CONNECT_ATTEMPTS:
            await asyncio.sleep(RETRY_DELAY)
    raise last or OSError("no attempt")


async def _connect_upstream(port: int):
    try:
        # One budget for all attempts: with lo down, connects hang rather than fail.
        return await asyncio.wait_for(_try_connect(port), CONNECT_TIMEOUT)
    except (OSError, asyncio.TimeoutError) as e:
        print(f"bridge: upstream 127.0.0.1:{port} unreachable: {e!r}", file=sys.stderr, flush=True)
        return None


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF, then half-close so the peer still gets its response (HTTP/1.0 clients)."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, asyncio.IncompleteReadError):
        writer.close()  # a reset on one side ends the other direction too


async def _handle(port: int, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
    upstream = await _connect_upstream(port)
    if upstream is None:
        c_writer.close()
        with contextlib.suppress(OSError):
            await c_writer.wait_closed()
        return
    u_reader, u_writer = upstream
    try:
        await asyncio.gather(_pump(c_reader, u_writer), _pump(u_reader, c_writer))
    finally:
        for w in (u_writer, c_writer):
            w.close()
            with contextlib.suppress(OSError):
                await w.wait_closed()


async def serve(sock_path: str, port: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock_path)  # left over from an earlier run of the same replica
    active: set[asyncio.Task] = set()

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        active.add(task)
        try:
            await _handle(port, reader, writer)
        finally:
            active.discard(task)

    server = await asyncio.start_unix_server(client, path=sock_path)
    # Same reach as a 127.0.0.1 port: any local user (e.g. nginx workers) may connect.
    os.chmod(sock_path, 0o666)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Stopping: refuse new connections, let in-flight ones finish while the app drains them.
    server.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock_path)
    if active:
        await asyncio.wait(set(active), timeout=DRAIN_TIMEOUT)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--socket", required=True, help="Unix socket path to listen on (relative to cwd is fine).")
    p.add_argument("--port", type=int, required=True, help="TCP port of the app on the loopback.")
    args = p.parse_args(argv)
    # Binding a relative path sidesteps the 108-byte sun_path limit for deep work dirs.
    asyncio.run(serve(args.socket, args.port))


if __name__ == "__main__":
    main()
