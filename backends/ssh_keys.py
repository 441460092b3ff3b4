"""The SSH keys of the cloud data path, kept in the home (``$DURASTACK_HOME/ssh``, mode 700, files mode 600).

* One client key pair per installation (``id_ed25519``): every instance authorizes its public half only.
* Each instance's host key is made by durastack, not by the instance: derived from the installation's host-key
  seed (``host_seed``) and the instance's provisioning key. The private half goes to the instance in its user
  data; the public half is recomputed here whenever a connection is made, so the first connection is
  already verified (no trust on first use) and nothing per instance has to be stored. Deriving it, rather
  than drawing it at random, keeps the user data of a retried launch identical to the first attempt's (the
  AWS ClientToken refuses other parameters under the same token).

Every worker that connects to instances needs the same two files: in a cluster, mount the same ``ssh``
directory (or point ``DURASTACK_SSH_DIR`` at one). A directory that holds both is only read, so it may be
read-only (a Kubernetes Secret): ``durastack ssh-keys DIR`` makes them ahead.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from connect.files import write_once

SSH_DIR_ENV = "DURASTACK_SSH_DIR"
CLIENT_KEY, HOST_SEED = "id_ed25519", "host_seed"  # what a Secret for DURASTACK_SSH_DIR holds


class SSHKeysError(RuntimeError):
    """The keys cannot be read, or are missing where they cannot be made (e.g. a read-only Secret without them)."""


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


def _make(d: Path) -> None:
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    write_once(d / CLIENT_KEY, _openssh_private(Ed25519PrivateKey.generate()), mode=0o600)
    write_once(d / HOST_SEED, os.urandom(32).hex() + "\n", mode=0o600)


def _unusable(d: Path, error: OSError) -> str:
    missing = [name for name in (CLIENT_KEY, HOST_SEED) if not (d / name).is_file()]
    if missing:
        return (f"SSH keys ({SSH_DIR_ENV}): {d} has no {' and '.join(missing)}, and they cannot be made there "
                f"({error.strerror}): make them with `durastack ssh-keys DIR` and put DIR's files there "
                "(Kubernetes: the Secret durastack-ssh)")
    return (f"SSH keys ({SSH_DIR_ENV}): {error.filename}: {error.strerror}: this user must be able to read them "
            "(Kubernetes: the pod's fsGroup)")


@dataclass(frozen=True)
class SSHKeys:
    directory: Path

    @classmethod
    def of_home(cls, home: Path) -> "SSHKeys":
        """The home's keys (or ``$DURASTACK_SSH_DIR``'s), made on first use."""
        return cls.at(ssh_dir(home))

    @classmethod
    def at(cls, directory: Path) -> "SSHKeys":
        """The keys in ``directory``, made on first use (processes starting together agree on the first written).
        A directory holding both files is only read: it may be read-only, and not ours to chmod."""
        keys = cls(Path(directory))
        try:
            if not all((keys.directory / name).is_file() for name in (CLIENT_KEY, HOST_SEED)):
                _make(keys.directory)
            keys.client_key()  # both readable and well-formed: say so now, not at the first connection
            keys._seed()
        except OSError as e:
            raise SSHKeysError(_unusable(keys.directory, e)) from None
        except ValueError as e:
            raise SSHKeysError(f"SSH keys ({SSH_DIR_ENV}): {keys.directory}: {e}; make them with "
                               "`durastack ssh-keys DIR`") from None
        return keys

    @property
    def client_key_path(self) -> Path:
        return self.directory / CLIENT_KEY

    def client_key(self) -> Ed25519PrivateKey:
        try:
            key = serialization.load_ssh_private_key(self.client_key_path.read_bytes(), password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as e:  # not OpenSSH's format, encrypted, another type
            raise ValueError(f"{CLIENT_KEY} is not an unencrypted OpenSSH private key ({e})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{CLIENT_KEY} is not an ed25519 key")
        return key

    def client_public(self) -> str:
        """``ssh-ed25519 AAAA… durastack``: the one key instances authorize."""
        return _openssh_public(self.client_key(), "durastack")

    def host_key(self, provisioning_key: str, after_boot: bool = False) -> HostKey:
        """The instance's host key: the one its boot data carries, or (``after_boot``) the one durastack puts in
        its place over SSH once the instance has booted, which no user data or metadata ever held."""
        seed = self._seed()
        label = "host-key-after-boot" if after_boot else "host-key"
        private = hmac.new(seed, f"{label}/{provisioning_key}".encode(), hashlib.sha256).digest()
        key = Ed25519PrivateKey.from_private_bytes(private)
        return HostKey(private_openssh=_deterministic_openssh_private(key), public_openssh=_openssh_public(key))

    def _seed(self) -> bytes:
        text = (self.directory / HOST_SEED).read_text().strip()
        if not re.fullmatch(r"[0-9a-f]{64}", text):
            raise ValueError(f"{HOST_SEED} is not 32 bytes in hex")
        return bytes.fromhex(text)


__all__ = ["HostKey", "SSHKeys", "SSHKeysError", "ssh_dir"]
