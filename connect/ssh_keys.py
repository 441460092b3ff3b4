"""The SSH keys of the cloud data path, kept in the home (``$DURASTACK_HOME/ssh``, mode 700, files mode 600).

* One client key pair per installation (``id_ed25519``): every instance authorizes its public half only.
* Each instance's host key is made by durastack, not by the instance: derived from the installation's host-key
  seed (``host_seed``) and the instance's provisioning key. The private half goes to the instance in its user
  data; the public half is recomputed here whenever a connection is made, so the first connection is
  already verified (no trust on first use) and nothing per instance has to be stored. Deriving it, rather
  than drawing it at random, keeps the user data of a retried launch identical to the first attempt's (the
  AWS ClientToken refuses other parameters under the same token).

Every worker that connects to instances needs the same two files: in a cluster, mount the same ``ssh``
directory (or point ``DURASTACK_SSH_DIR`` at one).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from connect.files import write_once

SSH_DIR_ENV = "DURASTACK_SSH_DIR"


def ssh_dir(home: Path) -> Path:
    return Path(os.environ.get(SSH_DIR_ENV) or Path(home) / "ssh")


def _openssh_private(key: Ed25519PrivateKey) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                             serialization.NoEncryption()).decode()


def _deterministic_openssh_private(key: Ed25519PrivateKey) -> str:
    """The OpenSSH private key file of ``key``, the same bytes every time: the format's check integers are
    random when a library writes them, and a host key file that changed between two launch attempts would
    change the user data of the second."""
    import base64
    import struct

    def string(b: bytes) -> bytes:
        return struct.pack(">I", len(b)) + b

    raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    pub_blob = string(b"ssh-ed25519") + string(pub)
    check = hashlib.sha256(b"check/" + raw).digest()[:4]
    block = check + check + pub_blob + string(raw + pub) + string(b"")
    block += bytes(range(1, 1 + (-len(block)) % 8))
    body = b"openssh-key-v1\0" + string(b"none") + string(b"none") + string(b"") + struct.pack(">I", 1) + \
        string(pub_blob) + string(block)
    text = base64.b64encode(body).decode()
    lines = [text[i:i + 70] for i in range(0, len(text), 70)]
    return "-----BEGIN OPENSSH PRIVATE KEY-----\n" + "\n".join(lines) + "\n-----END OPENSSH PRIVATE KEY-----\n"


def _openssh_public(key: Ed25519PrivateKey, comment: str = "") -> str:
    text = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    return f"{text} {comment}".strip()


@dataclass(frozen=True)
class HostKey:
    private_openssh: str  # for the instance's /etc/ssh/durastack_host_ed25519_key: only ever in its user data
    public_openssh: str   # ``ssh-ed25519 AAAA…``: what the connection pins


@dataclass(frozen=True)
class SSHKeys:
    directory: Path

    @classmethod
    def of_home(cls, home: Path) -> "SSHKeys":
        """The home's keys (or ``$DURASTACK_SSH_DIR``'s), made on first use."""
        return cls.at(ssh_dir(home))

    @classmethod
    def at(cls, directory: Path) -> "SSHKeys":
        """The keys in ``directory``, made on first use (processes starting together agree on the first written)."""
        d = Path(directory)
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        keys = cls(d)
        write_once(keys.client_key_path, _openssh_private(Ed25519PrivateKey.generate()), mode=0o600)
        write_once(d / "host_seed", os.urandom(32).hex() + "\n", mode=0o600)
        return keys

    @property
    def client_key_path(self) -> Path:
        return self.directory / "id_ed25519"

    def client_key(self) -> Ed25519PrivateKey:
        key = serialization.load_ssh_private_key(self.client_key_path.read_bytes(), password=None)
        assert isinstance(key, Ed25519PrivateKey)
        return key

    def client_public(self) -> str:
        """``ssh-ed25519 AAAA… durastack``: the one key instances authorize."""
        return _openssh_public(self.client_key(), "durastack")

    def host_key(self, provisioning_key: str, after_boot: bool = False) -> HostKey:
        """The instance's host key: the one its boot data carries, or (``after_boot``) the one durastack puts in
        its place over SSH once the instance has booted, which no user data or metadata ever held."""
        seed = bytes.fromhex((self.directory / "host_seed").read_text().strip())
        label = "host-key-after-boot" if after_boot else "host-key"
        private = hmac.new(seed, f"{label}/{provisioning_key}".encode(), hashlib.sha256).digest()
        key = Ed25519PrivateKey.from_private_bytes(private)
        return HostKey(private_openssh=_deterministic_openssh_private(key), public_openssh=_openssh_public(key))


__all__ = ["HostKey", "SSHKeys", "ssh_dir"]
