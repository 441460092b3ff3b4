"""Boot scripts: golden files for AWS cloud-init and the GCP startup-script, and the script actually run
against a stub ``docker`` so the commands, env and flags are checked by behaviour, not only by text.

Regenerate the golden files after an intended change with ``DURASTACK_UPDATE_GOLDEN=1 pytest tests/test_userdata.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from activities.userdata import DEFAULT_DEVEL_IMAGE, DEFAULT_IMAGE, cloud_init, start_script, startup_script
from models.replica import JobSpec

GOLDEN = Path(__file__).with_name("golden")


def _load(text: str):
    return YAML(typ="safe").load(text)


def job(**kw) -> JobSpec:
    fields = dict(service="llm-svc", group="decode", replica_num=3, submission_num=1, port=8000,
                  commands=["pip install vllm", "vllm serve Qwen/Qwen2.5-0.5B --port 8000"],
                  env={"HF_TOKEN": "hf_secret'value", "MODEL": "Qwen/Qwen2.5-0.5B"})
    return JobSpec(**{**fields, **kw})


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("DURASTACK_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"missing golden file {path}; run with DURASTACK_UPDATE_GOLDEN=1"
    assert text == path.read_text(encoding="utf-8"), f"{name} differs from its golden file"


CASES = {
    "aws_gpu_cloud_init.yml": lambda: cloud_init(job(), gpu=True),
    "aws_cpu_image_cloud_init.yml": lambda: cloud_init(job(image="vllm/vllm-openai:v0.6.0", commands=[], env={}),
                                                       gpu=False),
    "gcp_gpu_startup.sh": lambda: startup_script(job(), gpu=True),
    "gcp_nvcc_startup.sh": lambda: startup_script(job(env={}), gpu=True, nvcc=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    check_golden(name, CASES[name]())


def test_cloud_init_is_yaml_whose_file_is_the_start_script():
    doc = _load(cloud_init(job(), gpu=True))
    assert doc["runcmd"] == [["/bin/bash", "/opt/durastack/start.sh"]]
    (f,) = doc["write_files"]
    assert f["path"] == "/opt/durastack/start.sh" and f["permissions"] == "0700"
    assert f["content"] == start_script(job(), gpu=True)


def test_control_characters_fall_back_to_base64():
    import base64

    j = job(env={"WEIRD": "a\x01b"})
    doc = _load(cloud_init(j, gpu=False))
    (f,) = doc["write_files"]
    assert f["encoding"] == "b64" and base64.b64decode(f["content"]).decode() == start_script(j, gpu=False)


def test_gpu_flag_image_and_port():
    assert "--gpus all" in start_script(job(), gpu=True)
    assert "--gpus" not in start_script(job(), gpu=False)
    assert DEFAULT_IMAGE in start_script(job(), gpu=True)
    assert DEFAULT_DEVEL_IMAGE in start_script(job(), gpu=True, nvcc=True)
    assert "my/image:1" in start_script(job(image="my/image:1"), gpu=True, nvcc=True)
    assert "-p 8000:8000" in start_script(job(), gpu=False)


def test_invalid_env_names_are_refused():
    with pytest.raises(ValueError, match="invalid environment variable names: A B"):
        start_script(job(env={"A B": "x"}), gpu=False)


def test_startup_script_passes_bash_syntax_check():
    for text in (startup_script(job(), gpu=True), startup_script(job(commands=[]), gpu=False)):
        subprocess.run(["bash", "-n"], input=text, text=True, check=True)


DOCKER_STUB = """#!/bin/bash
# Records each docker call; for `run`, also runs the mounted job script the way the container would.
printf '%s\\n' "$*" >> "$DIR_OUT/docker.calls"
if [ "$1" = run ]; then
  printf 'HF_TOKEN=%s\\n' "${HF_TOKEN-unset}" > "$DIR_OUT/env.seen"
  printf 'MODEL=%s\\n' "${MODEL-unset}" >> "$DIR_OUT/env.seen"
  bash "$DURASTACK_DIR/job.sh" > "$DIR_OUT/job.out" 2>&1 || echo "exit $?" >> "$DIR_OUT/job.out"
fi
"""


@pytest.mark.parametrize("commands,expect", [
    (["echo one", "echo 'two  spaces'", "false", "echo never"], "one\ntwo  spaces\nexit 1\n"),
    (["DURASTACK_JOB", "echo after"], None),  # a command equal to the heredoc delimiter must not end it
])
def test_start_script_runs_commands_with_env(tmp_path, commands, expect):
    if shutil.which("bash") is None:
        pytest.skip("bash not installed")
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    (bin_dir / "docker").write_text(DOCKER_STUB)
    (bin_dir / "docker").chmod(0o755)
    j = job(commands=commands, env={"HF_TOKEN": "it's\na secret", "MODEL": "m"})
    script = tmp_path / "start.sh"
    script.write_text(start_script(j, gpu=False))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "DURASTACK_DIR": str(tmp_path / "state"), "DIR_OUT": str(out)}
    subprocess.run(["bash", str(script)], env=env, check=True, timeout=30)
    calls = (out / "docker.calls").read_text().splitlines()
    assert calls[0] == "rm -f durastack-job"
    run = calls[1]
    assert run.startswith("run -d --name durastack-job --ipc=host -p 8000:8000 -e HF_TOKEN -e MODEL ")
    assert f"{tmp_path / 'state'}/job.sh:/durastack/job.sh:ro" in run and DEFAULT_IMAGE in run
    assert (out / "env.seen").read_text() == "HF_TOKEN=it's\na secret\nMODEL=m\n"
    job_out = (out / "job.out").read_text()
    if expect is not None:
        assert job_out == expect
    else:
        assert (tmp_path / "state" / "job.sh").read_text().splitlines()[-2:] == ["DURASTACK_JOB", "echo after"]
    # Running it again (a reboot on GCP) replaces the container instead of failing.
    subprocess.run(["bash", str(script)], env=env, check=True, timeout=30)
    assert (out / "docker.calls").read_text().splitlines()[2] == "rm -f durastack-job"
