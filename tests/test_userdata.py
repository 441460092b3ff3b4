"""What a cloud instance gets: golden files for the boot script (AWS cloud-init, GCP startup-script) and for the
``docker run`` of each runtime, and both actually run — the boot script in a scratch root, the start command
against a stub ``docker`` — so commands, env and flags are checked by behaviour, not only by text.

Regenerate the golden files after an intended change with ``DURASTACK_UPDATE_GOLDEN=1 pytest tests/test_userdata.py``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from backends.runtime import (DEFAULT_DEVEL_IMAGE, DEFAULT_IMAGE, DIND_IMAGE, docker_run_argv, job_script,
                               runtime_of)
from backends.ssh_keys import SSHKeys
from backends.userdata import BootKeys, boot_script, cloud_init, job_upload, start_command, startup_script
from models.loader import load_config_text
from models.replica import JobSpec
from rules.jobs import job_spec

GOLDEN = Path(__file__).with_name("golden")
SECRET = "hf_secret'value"


def _load(text: str):
    return YAML(typ="safe").load(text)


def job(**kw) -> JobSpec:
    fields = dict(service="llm-svc", group="decode", replica_num=3, submission_num=1, port=8000,
                  commands=["pip install vllm", "vllm serve Qwen/Qwen2.5-0.5B --port 8000"],
                  env={"HF_TOKEN": SECRET, "MODEL": "Qwen/Qwen2.5-0.5B"})
    return JobSpec(**{**fields, **kw})


def keys() -> BootKeys:
    # Fixed keys, so the golden files do not depend on the session's key directory.
    return BootKeys(host_key="-----BEGIN OPENSSH PRIVATE KEY-----\nAAAA\n-----END OPENSSH PRIVATE KEY-----",
                    host_key_public="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHostKeyForTheGoldenFile",
                    authorized_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIClientKeyForTheGoldenFile durastack")


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("DURASTACK_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"missing golden file {path}; run with DURASTACK_UPDATE_GOLDEN=1"
    assert text == path.read_text(encoding="utf-8"), f"{name} differs from its golden file"


def _argv(j: JobSpec, gpu: bool) -> str:
    argv = docker_run_argv(j, gpu=gpu, job_dir="/opt/durastack/job", replica_ip="10.0.1.17")
    return " \\\n  ".join(shlex.quote(a) for a in argv) + "\n"


CASES = {
    "aws_gpu_cloud_init.yml": lambda: cloud_init(job(), gpu=True, keys=keys()),
    "gcp_cpu_startup.sh": lambda: startup_script(job(), gpu=False, keys=keys()),
    # One per runtime: what `docker run` the instance is given.
    "docker_run_default_gpu.txt": lambda: _argv(job(), True),
    "docker_run_image.txt": lambda: _argv(job(image="vllm/vllm-openai:v0.6.0", commands=[]), True),
    "docker_run_python.txt": lambda: _argv(job(python="3.12"), False),
    "docker_run_nvcc.txt": lambda: _argv(job(nvcc=True, python="3.12"), True),
    "docker_run_docker.txt": lambda: _argv(job(docker=True, privileged=True), False),
    # The job file the container runs: what nvcc + python and docker: true add before the commands.
    "job_nvcc_python.sh": lambda: job_upload(job(nvcc=True, python="3.12"))["job.sh"],
    "job_docker.sh": lambda: job_upload(job(docker=True, privileged=True))["job.sh"],
    "docker_run_privileged_user_workdir.txt": lambda: _argv(job(privileged=True, user="1000", working_dir="/work"),
                                                            True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    check_golden(name, CASES[name]())


def test_boot_data_carries_keys_and_no_env_or_command():
    for text in (cloud_init(job(), gpu=True, keys=keys()), startup_script(job(), gpu=True, keys=keys())):
        assert keys().host_key_public in text and keys().authorized_key in text
        assert SECRET not in text and "Qwen" not in text and "vllm" not in text


def test_cloud_init_is_yaml_whose_file_is_the_boot_script():
    doc = _load(cloud_init(job(), gpu=True, keys=keys()))
    assert doc["runcmd"] == [["/bin/bash", "/opt/durastack/start.sh"]]
    (f,) = doc["write_files"]
    assert f["permissions"] == "0700"
    assert f["content"] == boot_script(job(), gpu=True, keys=keys(), close_metadata=True)


def test_the_metadata_service_is_closed_to_the_containers_on_every_boot():
    # IMDSv2's one hop no longer separates a --network=host container from the metadata service (user data, or
    # GCP's startup script, holds the host key). Every container runs in durastack's cgroup, closed to it.
    cgroup_rule = "iptables -I OUTPUT -d 169.254.169.254/32 -m cgroup --path durastack.slice -j REJECT"
    argv = docker_run_argv(job(), gpu=False, job_dir="/j")
    assert "--cgroup-parent=durastack.slice" in argv and argv.index("--cgroup-parent=durastack.slice") < argv.index(
        DEFAULT_IMAGE)
    aws, gcp = boot_script(job(), gpu=True, keys=keys(), close_metadata=True), startup_script(job(), gpu=True, keys=keys())
    for script in (aws, gcp):
        assert cgroup_rule in script and "ip6tables -I OUTPUT -d fd20:ce::254/128 -m cgroup" in script
        # The slice exists before the rule names it, and both before any container can start.
        assert script.index("systemctl start durastack.slice") < script.index(cgroup_rule) < script.index(
            'touch "$DIR/ready"')
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    # AWS also closes it to the whole instance; GCP's guest agent, outside the containers' cgroup, needs it.
    whole = "iptables -I OUTPUT -d 169.254.169.254/32 -j REJECT"
    assert whole in aws and whole not in gcp
    # GCP's agent runs the boot script at every boot; on AWS it runs once, and iptables rules do not outlive a
    # reboot: bootcmd (every boot) closes it again on an instance that booted for durastack before.
    bootcmd = _load(cloud_init(job(), gpu=True, keys=keys()))["bootcmd"]
    assert bootcmd[0][:2] == ["sh", "-c"] and bootcmd[0][2].startswith("if [ -e /opt/durastack/ready ]; then ")
    assert cgroup_rule in bootcmd[0][2] and whole in bootcmd[0][2]
    subprocess.run(["sh", "-n", "-c", bootcmd[0][2]], check=True)


def test_runtimes():
    assert runtime_of(job()).image == DEFAULT_IMAGE
    assert runtime_of(job(nvcc=True)).image == DEFAULT_DEVEL_IMAGE
    assert runtime_of(job(python="3.11")).image == "python:3.11"
    assert runtime_of(job(image="my/image:1", nvcc=True)).image == "my/image:1"  # an explicit image wins
    dind = runtime_of(job(docker=True))
    assert dind.image == DIND_IMAGE and dind.privileged and any("dockerd" in line for line in dind.preamble)
    assert runtime_of(job(privileged=True)).privileged and not runtime_of(job()).privileged
    nvcc_python = runtime_of(job(nvcc=True, python="3.12"))
    assert any("--python 3.12" in line for line in nvcc_python.preamble)


def test_docker_run_flags():
    argv = docker_run_argv(job(user="1000", working_dir="/w"), gpu=True, job_dir="/j")
    assert argv[:2] == ["docker", "run"] and "--gpus" in argv and "--privileged" not in argv
    assert argv[argv.index("--env-file") + 1] == "/j/env" and SECRET not in " ".join(argv)
    assert argv[argv.index("-u") + 1] == "1000" and argv[argv.index("-w") + 1] == "/w"
    # The instance's network: the service's other replicas reach it at its private address on any port (the
    # firewall admits them and SSH only); nothing is published, the tunnel reaches 127.0.0.1:<port> there.
    assert "--network=host" in argv and "-p" not in argv
    assert "DURASTACK_REPLICA_IP" not in " ".join(argv)  # no address known: none set
    with_ip = docker_run_argv(job(), gpu=False, job_dir="/j", replica_ip="10.0.1.17")
    assert with_ip[with_ip.index("-e", with_ip.index("-e") + 1) + 1] == "DURASTACK_REPLICA_IP=10.0.1.17"
    assert "--gpus" not in docker_run_argv(job(), gpu=False, job_dir="/j")


SERVICE = """
type: service
name: rt
port: 8000
docker: true
groups:
  - name: router
    replicas: 1
    commands: [echo router]
  - name: worker
    replicas: 1
    python: "3.12"
    nvcc: true
    commands: [echo worker]
    resources: {gpu: 1}
"""


def test_group_fields_reach_the_job():
    result = load_config_text(SERVICE.replace("docker: true\n", ""))
    assert result.config is not None, result.errors
    worker = job_spec(result.config, "rt", "worker", 0, 0)
    assert (worker.python, worker.nvcc, worker.docker, worker.privileged) == ("3.12", True, False, False)
    router = job_spec(result.config, "rt", "router", 1, 0)
    assert not router.nvcc and router.python is None
    # docker: true at the service level reaches every group, privileged (K11 cannot happen here).
    result = load_config_text(SERVICE.replace("    nvcc: true\n", "").replace('    python: "3.12"\n', ""))
    assert result.config is not None, result.errors
    router = job_spec(result.config, "rt", "router", 1, 0)
    assert router.docker and router.privileged


def test_invalid_env_names_are_refused():
    with pytest.raises(ValueError, match="invalid environment variable names: A B"):
        job_upload(job(env={"A B": "x"}))


def test_boot_script_passes_bash_syntax_check():
    for text in (startup_script(job(), gpu=True, keys=keys()), startup_script(job(), gpu=False, keys=keys())):
        subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_boot_script_installs_the_host_key_and_the_installation_key(tmp_path):
    ssh = SSHKeys.of_home(tmp_path)
    host = ssh.host_key("ds-some-key")
    boot = BootKeys(host.private_openssh, host.public_openssh, ssh.client_public())
    script = tmp_path / "boot.sh"
    script.write_text(boot_script(job(), gpu=False, keys=boot))
    root = tmp_path / "root"
    env = {"PATH": "/usr/bin:/bin", "DURASTACK_DIR": str(root / "opt"), "DURASTACK_ETC": str(root / "etc"),
           "DURASTACK_ROOT_HOME": str(root / "home"), "DURASTACK_SIMULATED": "1"}
    for _ in range(2):  # GCP runs it at every boot
        subprocess.run(["bash", str(script)], env=env, check=True, timeout=30)
    assert (root / "etc/ssh/durastack_host_ed25519_key").read_text() == host.private_openssh
    assert (root / "etc/ssh/durastack_host_ed25519_key").stat().st_mode & 0o777 == 0o600
    assert (root / "home/.ssh/authorized_keys").read_text() == ssh.client_public() + "\n"
    assert (root / "opt/ready").exists()
    if shutil.which("ssh-keygen"):  # OpenSSH reads the host key durastack wrote
        out = subprocess.run(["ssh-keygen", "-y", "-f", str(root / "etc/ssh/durastack_host_ed25519_key")],
                             capture_output=True, text=True, check=True).stdout
        assert out.split()[:2] == host.public_openssh.split()[:2]


# `sshd -T` as far as host keys go, with sshd's own rules: the HostKey lines in the order it reads them, the drop-ins
# read where sshd_config includes them (the real path mapped to the scratch root), and its default keys only when no
# line names one.
SSHD_STUB = r"""#!/bin/bash
[ "$1" = -T ] && [ -f "$DURASTACK_ETC/ssh/sshd_config" ] || exit 1
keys=$(while read -r word value; do
  case "$word" in
    Include) for f in $DURASTACK_ETC/ssh/sshd_config.d/*.conf; do awk '$1 == "HostKey" {print $2}' "$f"; done ;;
    HostKey) echo "$value" ;;
  esac
done <"$DURASTACK_ETC/ssh/sshd_config")
printf 'hostkey %s\n' ${keys:-/etc/ssh/ssh_host_ecdsa_key /etc/ssh/ssh_host_ed25519_key /etc/ssh/ssh_host_rsa_key}
"""
UBUNTU_SSHD_CONFIG = "Include /etc/ssh/sshd_config.d/*.conf\n#HostKey /etc/ssh/ssh_host_ed25519_key\nUsePAM yes\n"


def _boot_root(tmp_path: Path, sshd_config: str, gpu: bool = False) -> tuple[Path, dict, SSHKeys]:
    """A scratch root with an image's sshd_config and `sshd` (the stub) on PATH; the boot script at boot.sh."""
    ssh = SSHKeys.of_home(tmp_path)
    host = ssh.host_key("ds-some-key")
    (tmp_path / "boot.sh").write_text(startup_script(job(), gpu=gpu, keys=BootKeys(
        host.private_openssh, host.public_openssh, ssh.client_public())))
    root, bin_dir = tmp_path / "root", tmp_path / "bin"
    (root / "etc/ssh").mkdir(parents=True)
    (root / "etc/ssh/sshd_config").write_text(sshd_config)
    bin_dir.mkdir()
    (bin_dir / "sshd").write_text(SSHD_STUB)
    (bin_dir / "sshd").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "DURASTACK_DIR": str(root / "opt"), "DURASTACK_ETC": str(root / "etc"),
           "DURASTACK_ROOT_HOME": str(root / "home"), "DURASTACK_SIMULATED": "1"}
    return root, env, ssh


def _sshd_keys(env: dict) -> list[str]:
    out = subprocess.run(["sshd", "-T"], env=env, capture_output=True, text=True, check=True).stdout
    return [line.split()[1] for line in out.splitlines()]


@pytest.mark.parametrize("sshd_config", [UBUNTU_SSHD_CONFIG, "#Include\nUsePAM yes\n"],
                         ids=["ubuntu", "no-include"])
def test_the_guest_agent_racing_the_first_boot_leaves_sshd_serving_durastacks_host_key(tmp_path, sshd_config):
    root, env, ssh = _boot_root(tmp_path, sshd_config)
    ours = (root / "etc/ssh/durastack_host_ed25519_key", ssh.host_key("ds-some-key").private_openssh)
    subprocess.run(["bash", str(tmp_path / "boot.sh")], env=env, check=True, timeout=30)
    # GCP's guest agent, after the script on this first boot: new keys in sshd's default files, sshd restarted; and
    # at the next boot the agent's startup-script runner runs the script again.
    for kind in ("ed25519", "ecdsa", "rsa"):
        (root / f"etc/ssh/ssh_host_{kind}_key").write_text(f"the agent's {kind} key\n")
    subprocess.run(["bash", str(tmp_path / "boot.sh")], env=env, check=True, timeout=30)
    assert ours[0].read_text() == ours[1] and (root / "opt/ready").exists()
    assert _sshd_keys(env) == ["/etc/ssh/durastack_host_ed25519_key"]  # as sshd reads it: ours alone
    lines = (root / "etc/ssh/sshd_config").read_text().splitlines()
    assert lines[0] == "Include /etc/ssh/sshd_config.d/*.conf" and lines.count(lines[0]) == 1  # added once if absent


def test_a_boot_whose_sshd_would_serve_another_key_first_stops_saying_so(tmp_path):
    root, env, _ = _boot_root(tmp_path, "HostKey /etc/ssh/ssh_host_ed25519_key\n" + UBUNTU_SSHD_CONFIG)
    ran = subprocess.run(["bash", str(tmp_path / "boot.sh")], env=env, timeout=30)
    assert ran.returncode != 0 and not (root / "opt/ready").exists()
    assert "durastack: sshd would serve /etc/ssh/ssh_host_ed25519_key, not /etc/ssh/durastack_host_ed25519_key" in \
        (root / "opt/boot.log").read_text()


def test_a_gpu_boot_records_the_nvidia_driver_it_found(tmp_path):
    root, env, _ = _boot_root(tmp_path, UBUNTU_SSHD_CONFIG, gpu=True)
    subprocess.run(["bash", str(tmp_path / "boot.sh")], env=env, check=True, timeout=30)
    assert (root / "opt/nvidia-driver").read_text() == "none (nvidia-smi did not answer)\n"
    smi = tmp_path / "bin/nvidia-smi"  # answers as nvidia-smi 595 does
    smi.write_text('#!/bin/sh\nif [ "$1" = --query-gpu=driver_version ]; then echo 595.91.07; exit; fi\n'
                   'echo "| NVIDIA-SMI 595.91.07    Driver Version: 595.91.07    CUDA Version: 13.2     |"\n')
    smi.chmod(0o755)
    subprocess.run(["bash", str(tmp_path / "boot.sh")], env=env, check=True, timeout=30)
    assert (root / "opt/nvidia-driver").read_text() == "595.91.07, CUDA 13.2\n"


DOCKER_STUB = """#!/bin/bash
# Records each docker call; for `run`, runs the mounted job the way the container would: env from --env-file.
printf '%s\\n' "$*" >> "$DIR_OUT/docker.calls"
if [ "$1" = run ]; then
  shift
  while [ $# -gt 0 ]; do
    case "$1" in
      --env-file) envfile="$2"; shift 2;;
      -v) mount="${2%%:*}"; shift 2;;
      --name|--restart|--label|--gpus|-e|-u|-w|-p|--entrypoint) shift 2;;
      -*) shift;;
      *) break;;
    esac
  done
  ( set -a; . /dev/null; while IFS= read -r line; do export "$line"; done < "$envfile"
    printf 'HF_TOKEN=%s\\n' "${HF_TOKEN-unset}" > "$DIR_OUT/env.seen"
    printf 'MODEL=%s\\n' "${MODEL-unset}" >> "$DIR_OUT/env.seen"
    sed "s#/durastack/#$mount/#g" "$mount/job.sh" > "$DIR_OUT/job.rewritten"
    bash "$DIR_OUT/job.rewritten" > "$DIR_OUT/job.out" 2>&1 || echo "exit $?" >> "$DIR_OUT/job.out" )
fi
"""


@pytest.mark.parametrize("commands,expect", [
    (["echo one", "echo 'two  spaces'", "false", "echo never"], "one\ntwo  spaces\nexit 1\n"),
    (['echo "$MULTI"'], "line one\nline two\n"),
])
def test_start_command_runs_commands_with_env_from_files(tmp_path, commands, expect):
    if shutil.which("bash") is None:
        pytest.skip("bash not installed")
    bin_dir, out, state = tmp_path / "bin", tmp_path / "out", tmp_path / "state"
    for d in (bin_dir, out, state / "job"):
        d.mkdir(parents=True)
    (bin_dir / "docker").write_text(DOCKER_STUB)
    (bin_dir / "docker").chmod(0o755)
    j = job(commands=commands, env={"HF_TOKEN": "it's a secret", "MODEL": "m", "MULTI": "line one\nline two"})
    for name, text in job_upload(j).items():  # what the launch uploads over SSH
        path = state / "job" / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert (state / "job/env.d/MULTI").read_text() == "line one\nline two"
    assert "MULTI" not in (state / "job/env").read_text()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "DURASTACK_DIR": str(state), "DIR_OUT": str(out)}
    subprocess.run(["bash", "-c", start_command(j, gpu=False)], env=env, check=True, timeout=30)
    calls = (out / "docker.calls").read_text().splitlines()
    assert calls[0] == "rm -f durastack-job"
    assert calls[1].startswith("run -d --name durastack-job ")
    assert f"--env-file {state}/job/env" in calls[1] and "it's a secret" not in calls[1]
    assert (out / "env.seen").read_text() == "HF_TOKEN=it's a secret\nMODEL=m\n"
    assert (out / "job.out").read_text() == expect


def test_shell_and_entrypoint_reach_the_container(tmp_path):
    # `shell`: the job file runs under it, not under bash-if-present.
    argv = docker_run_argv(job(shell="sh"), gpu=False, job_dir="/j")
    assert argv[argv.index("--entrypoint") + 1] == "/bin/sh" and argv[-1].endswith("/job.sh")
    argv = docker_run_argv(job(shell="/usr/bin/zsh"), gpu=False, job_dir="/j")
    assert argv[argv.index("--entrypoint") + 1] == "/usr/bin/zsh"
    # `entrypoint`: it runs the commands, given as one script in its last argument (run here by sh, as in the
    # container).
    script = tmp_path / "job.sh"
    script.write_text(job_script(job(entrypoint="/bin/sh -c 'echo \"ran: $0\"'", commands=["echo a", "echo b"])))
    ran = subprocess.run(["sh", str(script)], capture_output=True, text=True, timeout=10)
    assert ran.returncode == 0 and ran.stdout == "ran: echo a\necho b\n", ran


@pytest.mark.parametrize("text, error", [
    ("shell: zsh", "shell: `shell: zsh`: give sh, bash, or the absolute path of a shell"),
    ("entrypoint: \"python3 -c 'x\"", "entrypoint: `entrypoint` cannot be split into words"),
    ("entrypoint: python3\nshell: bash", "shell: `shell` and `entrypoint` are mutually exclusive"),
])
def test_shell_and_entrypoint_are_checked(text, error):
    result = load_config_text(f"type: service\nname: s\nport: 8000\ncommands: [x]\n{text}\n")
    assert not result.valid and any(str(e).startswith(error) for e in result.errors), [str(e) for e in result.errors]
