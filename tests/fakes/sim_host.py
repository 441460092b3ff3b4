"""The SSH server of a simulated cloud host (asyncssh's), run inside the host's own network namespace.

It presents the host keys its sshd configuration names (``HostKey``, as the instance's boot script set it; read again
on SIGHUP, as sshd's reload does) and accepts only the
keys in the authorized_keys that script wrote — the installation's. Commands run as they would as root on
the instance: by bash, with ``docker`` the stand-in of tests/fakes/fake_docker.py and ``DURASTACK_DIR`` the
host's state dir. Only direct TCP forwarding to the host's loopback is allowed (sshd's
``AllowTcpForwarding local`` and the container published on 127.0.0.1).

``python -m tests.fakes.sim_host --root DIR --listen IP [--listen IP…]`` (prints ``ready`` once listening).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

import asyncssh


class _Server(asyncssh.SSHServer):
    def connection_requested(self, dest_host: str, dest_port: int, orig_host: str, orig_port: int):
        return dest_host in ("127.0.0.1", "localhost")

    def server_requested(self, listen_host: str, listen_port: int):
        return False  # no remote forwarding

    def unix_connection_requested(self, dest_path: str):
        return False


def host_keys(root: Path) -> list[str]:
    """The host keys sshd serves: the ``HostKey`` lines of its configuration, else its default key."""
    named = [line.split(None, 1)[1].strip() for conf in sorted((root / "etc/ssh/sshd_config.d").glob("*.conf"))
             for line in conf.read_text().splitlines() if line.split(None, 1)[:1] == ["HostKey"]]
    return [str(root / p.lstrip("/")) for p in named] or [str(root / "etc/ssh/ssh_host_ed25519_key")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True, help="the host's files: etc/, home/, opt/, bin/docker")
    parser.add_argument("--listen", required=True, action="append", help="an address of the host's (repeatable)")
    parser.add_argument("--port", type=int, default=22)
    args = parser.parse_args()
    root = Path(args.root)
    env = {"PATH": f"{root / 'bin'}:/usr/local/bin:/usr/bin:/bin", "HOME": str(root / "home"),
           "DURASTACK_DIR": str(root / "opt"), "DURASTACK_ETC": str(root / "etc"),
           "FAKE_DOCKER_DIR": str(root / "containers"), "LANG": "C.UTF-8",
           # Its devices (tests/fakes/blockdev.py), and where the host's own paths are (fake docker's -v sources).
           "DURASTACK_DEV": str(root / "dev"), "FAKE_HOST_ROOT": str(root)}

    async def handle(process: asyncssh.SSHServerProcess) -> None:
        proc = await asyncio.create_subprocess_exec(
            "/bin/bash", "-c", process.command or "true", env=env, cwd=str(root / "home"),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True)
        try:
            await process.redirect(stdin=proc.stdin, stdout=proc.stdout, stderr=proc.stderr)
            code = await proc.wait()
            await process.stdout.drain()
            process.exit(code)
        except (asyncssh.Error, OSError, BrokenPipeError):
            if proc.returncode is None:
                proc.kill()
            process.exit(255)

    async def serve() -> None:
        server = await asyncssh.create_server(
            _Server, args.listen, args.port,
            server_host_keys=host_keys(root),
            authorized_client_keys=str(root / "home/.ssh/authorized_keys"),
            process_factory=handle, encoding=None, password_auth=False, kbdint_auth=False,
            allow_scp=False, sftp_factory=None, agent_forwarding=False, x11_forwarding=False)
        (root / "sshd.pid").write_text(f"{os.getpid()}\n")
        print("ready", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # sshd's reload (``systemctl reload ssh``, the stand-in in bin/): new connections get the keys its
        # configuration names now; open ones go on.
        loop.add_signal_handler(signal.SIGHUP, lambda: server.update(server_host_keys=host_keys(root)))
        await stop.wait()
        server.close()

    asyncio.run(serve())


if __name__ == "__main__":
    os.umask(0o077)
    sys.exit(main())
