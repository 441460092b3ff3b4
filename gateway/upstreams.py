"""Which upstream addresses the gateway accepts: only those its backends create.

A registration names where nginx connects; whoever could register anything would turn the gateway into a
proxy to any socket this machine can reach (the Docker socket, a root-only socket, the cloud metadata
service at 169.254.169.254, the gateway's own control port). So the set is explicit:

* ``unix:`` paths inside the backends' socket directories: ``<home>/replicas`` (each local replica's
  ``replica.sock``), ``<home>/run`` (the short links to them) and ``<home>/tunnels`` (the local ends of the SSH
  tunnels to cloud replicas), ``home`` being the parent of the gateway's runtime dir as ``durastack server``
  lays it out; ``DURASTACK_GATEWAY_UPSTREAM_DIRS`` (comma separated)
  replaces them;
* ``IPV4:PORT`` in the allowed networks: on a loopback gateway 127.0.0.0/8 (a local replica without
  namespaces binds a 127.0.0.1 port) and every unicast address (cloud replicas are reached by their public
  or private IP); ``DURASTACK_GATEWAY_UPSTREAM_NETS`` (comma separated CIDRs, e.g. a cluster's VPC range)
  replaces them. When nginx runs in the home's gateway namespace (``python -m gateway --netns``), the default is
  the local backend's service networks (10.0.0.0/8), all it can reach there. A loopback address passes only where
  a listed network names it (0.0.0.0/0 does not). Link-local (the metadata service), multicast, reserved and 0.0.0.0/8 addresses and the
  gateway's own ports are refused whatever the setting.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Iterable, Mapping, Optional

ENV_DIRS = "DURASTACK_GATEWAY_UPSTREAM_DIRS"
ENV_NETS = "DURASTACK_GATEWAY_UPSTREAM_NETS"
NEVER = tuple(ipaddress.IPv4Network(n) for n in ("0.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4"))


class UpstreamRefused(ValueError):
    """An address outside what the backends create; the control API answers 400 with this message."""


class UpstreamPolicy:
    def __init__(self, unix_dirs: Iterable[str | os.PathLike], nets: Iterable[str],
                 own: Iterable[tuple[str, int]] = ()):
        """``own``: (host, port) pairs the gateway itself listens on, never an upstream."""
        self.unix_dirs = tuple(Path(os.path.realpath(d)) for d in unix_dirs)
        self.nets = tuple(ipaddress.IPv4Network(n, strict=False) for n in nets)
        self.own = set(own)

    @classmethod
    def default(cls, runtime_dir: Path, *, loopback: bool, environ: Optional[Mapping[str, str]] = None,
                own: Iterable[tuple[str, int]] = (), service_networks: Optional[str] = None) -> "UpstreamPolicy":
        """``service_networks``: the range of the local backend's service networks, when nginx runs in the home's
        gateway namespace: the only addresses it can reach there."""
        env = os.environ if environ is None else environ
        home = Path(runtime_dir).absolute().parent
        dirs = _split(env.get(ENV_DIRS)) or [home / "replicas", home / "run", home / "tunnels"]
        nets = _split(env.get(ENV_NETS)) or ([service_networks] if service_networks else
                                             (["127.0.0.0/8"] if loopback else []) + ["0.0.0.0/0"])
        try:
            return cls(dirs, nets, own)
        except ValueError as e:
            raise ValueError(f"{ENV_NETS}: {e}") from None

    def describe(self) -> str:
        return (f"unix sockets under {', '.join(map(str, self.unix_dirs)) or 'nowhere'} ({ENV_DIRS}); "
                f"IPv4 in {', '.join(map(str, self.nets)) or 'nothing'} ({ENV_NETS})")

    def check(self, address: str) -> None:
        """Raise :class:`UpstreamRefused` unless ``address`` (already syntax-checked by ``Upstream``) is allowed."""
        if address.startswith("unix:"):
            path = address[len("unix:"):]
            # The real path: a link in an allowed directory must not lead out of it (connect follows links).
            real = Path(os.path.realpath(path))
            if ".." in Path(path).parts or not any(real.is_relative_to(d) for d in self.unix_dirs):
                raise UpstreamRefused(f"upstream {address!r} refused: replica sockets live under "
                                      f"{', '.join(map(str, self.unix_dirs))} (set {ENV_DIRS} to change)")
            return
        host, _, port = address.rpartition(":")
        ip = ipaddress.IPv4Address(host)
        if any(ip in n for n in NEVER):
            raise UpstreamRefused(f"upstream {address!r} refused: {ip} is link-local, multicast or reserved, "
                                  "never a replica")
        if (host, int(port)) in self.own or (ip.is_loopback and ("127.0.0.1", int(port)) in self.own):
            raise UpstreamRefused(f"upstream {address!r} refused: that is the gateway itself")
        # Loopback only where a listed network names it: 0.0.0.0/0 (every cloud address) does not open the
        # gateway's own host.
        if not any(ip in n for n in self.nets if not (ip.is_loopback and n.prefixlen == 0)):
            raise UpstreamRefused(f"upstream {address!r} refused: replicas are reached in "
                                  f"{', '.join(map(str, self.nets)) or 'no network'} (set {ENV_NETS} to change)")


def _split(value: Optional[str]) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]
