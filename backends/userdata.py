"""What a cloud instance gets, in two halves.

* At boot, in user data (AWS cloud-init, ``cloud_init``) or the ``startup-script`` metadata (GCP,
  ``startup_script``): ``templates/boot.sh.tmpl``, which installs the host key durastack made for the instance,
  authorizes the installation's key, and installs Docker (and the GPU runtime). It holds no env value and no
  command of the service: user data and metadata are readable by anything on the instance that reaches the
  metadata service, and are kept by the cloud.
* After boot, over SSH (``job_upload`` then ``start_command``): the job's files — its commands, and its env in a
  mode-600 ``--env-file`` — and the ``docker run`` of ``backends/runtime.py``.
"""

from __future__ import annotations

import base64
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from backends.runtime import (CONTAINER_NAME, DEFAULT_DEVEL_IMAGE, DEFAULT_IMAGE, REPLICA_SLICE, docker_run_argv,
                               env_files, job_script)
from models.replica import JobSpec

TEMPLATES = Path(__file__).with_name("templates")
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


@dataclass(frozen=True)
class BootKeys:
    host_key: str         # the instance's private host key (OpenSSH format)
    host_key_public: str  # ``ssh-ed25519 AAAA…``
    authorized_key: str   # the installation's public key


def _render(name: str, **values: str) -> str:
    """Fill ``{{name}}`` placeholders (not ``$``: the templates are shell). A line that is only a placeholder
    rendering to nothing is dropped; a missing or unused value is a bug and raises."""
    text = (TEMPLATES / name).read_text(encoding="utf-8")
    used = set(_PLACEHOLDER.findall(text))
    if used != set(values):
        raise KeyError(f"{name}: placeholders {sorted(used)} but values {sorted(values)}")
    lines = []
    for line in text.splitlines(keepends=True):
        m = _PLACEHOLDER.fullmatch(line.strip())
        if m and not values[m.group(1)]:
            continue
        lines.append(_PLACEHOLDER.sub(lambda m: values[m.group(1)], line))
    return "".join(lines)


def default_image(nvcc: bool = False) -> str:
    return DEFAULT_DEVEL_IMAGE if nvcc else DEFAULT_IMAGE


_KEY_LINE = re.compile(r"^[A-Za-z0-9+/=@. -]+$")


# The container runs on the instance's network (--network=host), so nothing of the network keeps it from the
# metadata service, whose user data (AWS) or startup script (GCP) holds the instance's host key, and IMDSv2's one
# hop limit no longer does on AWS. Every container runs in durastack's own cgroup (runtime.REPLICA_SLICE), and the
# metadata addresses (IPv4, and GCP's and AWS's IPv6 ones) are closed to it. GCP's guest agent, outside it, keeps
# its metadata; AWS also closes them to the whole instance, as nothing there needs them once cloud-init has run.
_METADATA = (("iptables", "169.254.169.254/32"), ("ip6tables", "fd20:ce::254/128"), ("ip6tables", "fd00:ec2::254/128"))


def _reject(tool: str, dest: str, match: str = "") -> str:
    rule = f"OUTPUT -d {dest}{match} -j REJECT"
    return f"{{ {tool} -C {rule} 2>/dev/null || {tool} -I {rule}; }}"


_SLICE = f"-m cgroup --path {REPLICA_SLICE}"
METADATA_RULE = _reject("iptables", "169.254.169.254/32")  # the whole instance (AWS)
CLOSE_TO_CONTAINERS = "\n".join([
    "  # The containers' cgroup (the rule needs it to exist) and the metadata service closed to it, at every boot.",
    f"  printf '[Unit]\\nDescription=durastack replicas\\n' >/etc/systemd/system/{REPLICA_SLICE}",
    f"  systemctl daemon-reload && systemctl start {REPLICA_SLICE}",
    f"  {_reject('iptables', '169.254.169.254/32', ' ' + _SLICE)}",
    *(f"  {_reject(tool, dest, ' ' + _SLICE)} 2>/dev/null || true" for tool, dest in _METADATA[1:])])
CLOSE_METADATA = f"""\
{CLOSE_TO_CONTAINERS}
  # On AWS, the whole instance too.
  {METADATA_RULE}"""
# iptables rules do not outlive a reboot, and the boot script runs once on AWS: cloud-init's bootcmd, which runs at
# every boot, closes it again once the instance has booted for durastack before (its ready file). (GCP's agent runs
# the whole boot script at every boot.)
_CLOSE_TO_SLICE = _reject("iptables", "169.254.169.254/32", " " + _SLICE)
REBOOT_CLOSE = json.dumps(["sh", "-c", f"if [ -e /opt/durastack/ready ]; then systemctl start {REPLICA_SLICE}; "
                                       f"{_CLOSE_TO_SLICE}; {METADATA_RULE}; fi"])


def boot_script(job: JobSpec, *, gpu: bool, keys: BootKeys, close_metadata: bool = False) -> str:
    """The boot script: host key, authorized key, sshd settings, Docker (and the GPU runtime), the metadata service
    closed to the containers; with ``close_metadata``, to the whole instance too, once booted (AWS)."""
    for line in (keys.host_key_public, keys.authorized_key):
        if not _KEY_LINE.match(line):
            raise ValueError(f"not a public key line: {line[:40]!r}")
    gpu_setup, gpu_driver = ((TEMPLATES / name).read_text(encoding="utf-8").rstrip("\n") if gpu else ""
                             for name in ("gpu_setup.sh.tmpl", "gpu_driver.sh.tmpl"))
    return _render("boot.sh.tmpl", replica_id=job.replica_id, host_key=keys.host_key.strip("\n"),
                   host_key_public=keys.host_key_public, authorized_key=keys.authorized_key, gpu_setup=gpu_setup,
                   gpu_driver=gpu_driver, close_metadata=CLOSE_METADATA if close_metadata else CLOSE_TO_CONTAINERS)


def _yaml_block_safe(text: str) -> bool:
    # YAML literal blocks carry any printable text as is; other control characters need base64.
    return all(c in "\t\n" or (c.isprintable() and c != "\ufeff") for c in text) and "\r" not in text


def cloud_init(job: JobSpec, *, gpu: bool, keys: BootKeys) -> str:
    """AWS user-data: a ``#cloud-config`` that writes the boot script and runs it once."""
    script = boot_script(job, gpu=gpu, keys=keys, close_metadata=True)
    if _yaml_block_safe(script):
        content = "    content: |\n" + "".join(line if line == "\n" else f"      {line}"
                                              for line in script.splitlines(keepends=True))
    else:
        content = "    encoding: b64\n    content: " + base64.b64encode(script.encode()).decode() + "\n"
    return _render("cloud-init.yml.tmpl", replica_id=job.replica_id, content=content.rstrip("\n"),
                   bootcmd=REBOOT_CLOSE)


def startup_script(job: JobSpec, *, gpu: bool, keys: BootKeys) -> str:
    """GCP ``startup-script`` metadata: the boot script itself (the agent runs it at every boot)."""
    return boot_script(job, gpu=gpu, keys=keys)


# --- after boot, over SSH ----------------------------------------------------------------------------

def job_upload(job: JobSpec) -> dict[str, str]:
    """The job's files, relative to the instance's job dir, each written mode 600 by root: ``job.sh``, ``env``
    (docker's --env-file) and ``env.d/<NAME>`` for values with newlines."""
    env_text, multi = env_files(job)
    files = {"job.sh": job_script(job), "env": env_text}
    files.update({f"env.d/{k}": v for k, v in sorted(multi.items())})
    return files


def start_command(job: JobSpec, *, gpu: bool, replica_ip: str = "") -> str:
    """The shell command, run as root over SSH once the files are in place, that (re)starts the container;
    ``replica_ip``: the instance's private address. A network volume that is not mounted stops it: Docker would
    make an empty directory in its place, and the app would write to the instance's own disk."""
    argv = docker_run_argv(job, gpu=gpu, job_dir="@JOB@", replica_ip=replica_ip, volumes_dir="@VOLUMES@")
    run = " ".join(_placed(a) for a in argv)
    mounted = "".join(f'mountpoint -q "$VOLUMES"/{m.name} || {{ echo "volume {m.name} is not mounted" >&2; '
                      "exit 1; }; " for m in job.volumes if m.network)
    return ("set -e; DIR=\"${DURASTACK_DIR:-/opt/durastack}\"; JOB=\"$DIR/job\"; VOLUMES=\"$DIR/volumes\"; "
            f"{mounted}docker rm -f {CONTAINER_NAME} >/dev/null 2>&1 || true; {run}")


def _placed(arg: str) -> str:
    """One argument, quoted, with the instance's directories (``@JOB@``, ``@VOLUMES@``) as shell variables."""
    for mark, var in (("@JOB@", '"$JOB"'), ("@VOLUMES@", '"$VOLUMES"')):
        if arg.startswith(mark):
            return var + shlex.quote(arg[len(mark):])
    return shlex.quote(arg)


__all__ = ["BootKeys", "boot_script", "cloud_init", "default_image", "job_upload", "start_command", "startup_script"]
