"""The installation's SSH keys (backends/ssh_keys.py) made ahead with `durastack ssh-keys` and then only read from
a directory laid out and mounted as the kubelet mounts a Secret: read-only, each file a link into `..data`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from backends.ssh_keys import CLIENT_KEY, HOST_SEED, SSH_DIR_ENV, SSHKeys, SSHKeysError


def secret_volume(where: Path, files: dict[str, bytes]) -> Path:
    """``files`` as the kubelet writes a Secret volume: in a timestamped directory that ``..data`` links to, each
    key a link through ``..data`` (kubectl create secret generic --from-file=DIR makes one key per file)."""
    stamp = where / "..2026_12_04_10_53_23.000000001"
    stamp.mkdir(parents=True)
    for name, content in files.items():
        (stamp / name).write_bytes(content)
        (stamp / name).chmod(0o440)
        (where / name).symlink_to(Path("..data") / name)
    (where / "..data").symlink_to(stamp.name)
    return where


def made_ahead(tmp_path: Path) -> tuple[SSHKeys, dict[str, bytes]]:
    result = CliRunner().invoke(app, ["ssh-keys", str(tmp_path / "made")])
    assert result.exit_code == 0, result.output
    keys = SSHKeys(tmp_path / "made")
    assert result.output.splitlines()[-1] == keys.client_public()  # what instances will authorize
    return keys, {p.name: p.read_bytes() for p in keys.directory.iterdir()}


def read_only_mount_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def in_read_only_secret(tmp_path: Path, files: dict[str, bytes], code: str) -> subprocess.CompletedProcess:
    """Run ``code`` (Python; the mount at ``MOUNT``) with ``files`` in a Secret-like volume on a tmpfs remounted
    read-only in a mount namespace of its own: every write and chmod there fails with EROFS, as on a Secret."""
    staged = secret_volume(tmp_path / "staged", files)
    mount = tmp_path / "secret"
    mount.mkdir()
    script = ('set -e; mount -t tmpfs -o mode=0755 tmpfs "$1"; cp -a "$2"/. "$1"; mount -o remount,ro "$1"; '
              'shift 2; exec "$@"')
    return subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(mount), str(staged), sys.executable,
                           "-c", f"MOUNT = {str(mount)!r}\n{code}"],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parent.parent)


def test_the_command_makes_the_two_files_once_and_nothing_else(tmp_path):
    keys, files = made_ahead(tmp_path)
    assert sorted(files) == sorted([CLIENT_KEY, HOST_SEED])  # the Secret's keys: no draft left behind
    assert {oct(p.stat().st_mode & 0o777) for p in keys.directory.iterdir()} == {"0o600"}
    again = CliRunner().invoke(app, ["ssh-keys", str(keys.directory)])
    assert again.exit_code == 0 and {p.name: p.read_bytes() for p in keys.directory.iterdir()} == files


def test_the_command_defaults_to_the_directory_the_workers_read(tmp_path, monkeypatch):
    monkeypatch.setenv(SSH_DIR_ENV, str(tmp_path / "shared"))
    assert CliRunner().invoke(app, ["ssh-keys"]).exit_code == 0
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == sorted([CLIENT_KEY, HOST_SEED])


def test_keys_in_a_secret_volume_are_only_read_and_are_the_same_installation(tmp_path):
    made, files = made_ahead(tmp_path)
    secret = secret_volume(tmp_path / "secret", files)
    secret.chmod(0o555)
    before = sorted((p.name, p.lstat().st_mode, p.lstat().st_mtime_ns) for p in secret.iterdir())
    keys = SSHKeys.at(secret)
    assert keys.client_public() == made.client_public()
    assert keys.host_key("ds-svc-llm-r0s0-aaa") == made.host_key("ds-svc-llm-r0s0-aaa")
    assert keys.host_key("k", after_boot=True) == made.host_key("k", after_boot=True)
    assert oct(secret.stat().st_mode & 0o777) == "0o555", "not ours to chmod"
    assert sorted((p.name, p.lstat().st_mode, p.lstat().st_mtime_ns) for p in secret.iterdir()) == before


@pytest.mark.skipif(not read_only_mount_works(), reason="no mount namespace here (unshare -rm)")
def test_a_read_only_secret_serves_its_keys_and_one_without_them_is_refused_by_name(tmp_path):
    made, files = made_ahead(tmp_path)
    code = ("from backends.ssh_keys import SSHKeys, SSHKeysError\n"
            "try:\n    print(SSHKeys.at(MOUNT).client_public())\n"
            "except SSHKeysError as e:\n    print(e)\n")
    served = in_read_only_secret(tmp_path / "full", files, code)
    assert served.returncode == 0, served.stderr
    assert served.stdout.strip() == made.client_public()
    # The Secret made by hand, without the seed: the worker stops saying what is missing and how to make it.
    refused = in_read_only_secret(tmp_path / "partial", {CLIENT_KEY: files[CLIENT_KEY]}, code)
    assert refused.returncode == 0, refused.stderr
    message = refused.stdout.strip()
    assert f"has no {HOST_SEED}," in message and "Read-only file system" in message
    assert SSH_DIR_ENV in message and "durastack ssh-keys" in message


@pytest.mark.parametrize("broken", [
    {CLIENT_KEY: b"CHANGE-ME\n"},
    {HOST_SEED: b"CHANGE-ME\n"},
    {HOST_SEED: b"00\n"},  # a seed anyone could guess derives every host key
])
def test_malformed_keys_are_refused_naming_the_file(tmp_path, broken):
    _, files = made_ahead(tmp_path)
    secret = secret_volume(tmp_path / "secret", {**files, **broken})
    with pytest.raises(SSHKeysError) as e:
        SSHKeys.at(secret)
    (name,) = broken
    assert f"{SSH_DIR_ENV}): {secret}: {name} is not" in str(e.value) and "durastack ssh-keys" in str(e.value)


def test_a_worker_given_placeholder_keys_stops_saying_so_before_it_connects(tmp_path):
    """secret.example.yaml's placeholders applied as they are: the worker exits at start, naming the file."""
    placeholders = secret_volume(tmp_path / "secret", {CLIENT_KEY: b"CHANGE-ME\n", HOST_SEED: b"CHANGE-ME\n"})
    env = {**os.environ, SSH_DIR_ENV: str(placeholders), "DURASTACK_HOME": str(tmp_path / "home"),
           "DURASTACK_TEMPORAL_ADDRESS": "127.0.0.1:9", "DURASTACK_WORKER_METRICS_PORT": "0"}
    done = subprocess.run([sys.executable, "-m", "worker"], env=env, capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 1, done.stderr
    assert f"worker: SSH keys ({SSH_DIR_ENV}): {placeholders}: {CLIENT_KEY} is not" in done.stderr
