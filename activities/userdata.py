"""What a cloud instance runs at boot: the replica's job in Docker (``--gpus all`` on GPU instances).

One shell script (``templates/start.sh.tmpl``) does the work; AWS gets it wrapped in cloud-init
(``cloud_init``), GCP as the ``startup-script`` metadata (``startup_script``). The job's env values can be
secrets: they go into the script (root-only on the VM) and never into logs, history or the ledger.
"""

from __future__ import annotations

import base64
import re
import shlex
from pathlib import Path

from models.replica import JobSpec

TEMPLATES = Path(__file__).with_name("templates")
DEFAULT_IMAGE = "nvidia/cuda:12.4.1-runtime-ubuntu22.04"
DEFAULT_DEVEL_IMAGE = "nvidia/cuda:12.4.1-devel-ubuntu22.04"  # nvcc: true
CONTAINER_JOB = "/durastack/job.sh"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


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


def _heredoc_delimiter(body: str) -> str:
    delimiter = "DURASTACK_JOB"
    while delimiter in body.splitlines():  # a command line equal to the delimiter would end the heredoc
        delimiter += "_"
    return delimiter


def start_script(job: JobSpec, *, gpu: bool, nvcc: bool = False) -> str:
    """The boot script: write the job's commands to a file, then ``docker run`` the image with env and port."""
    bad = [k for k in job.env if not _ENV_NAME.match(k)]
    if bad:
        raise ValueError(f"invalid environment variable names: {', '.join(sorted(bad))}")
    flags = (["--gpus all"] if gpu else []) + [f"-p {job.port}:{job.port}"] + [f"-e {k}" for k in sorted(job.env)]
    job_file = job_args = ""
    if job.commands:
        body = "set -e\n" + "\n".join(job.commands) + "\n"
        delimiter = _heredoc_delimiter(body)
        job_file = f"cat >\"$DIR/job.sh\" <<'{delimiter}'\n{body}{delimiter}"
        flags += [f'-v "$DIR/job.sh:{CONTAINER_JOB}:ro"', "--entrypoint /bin/sh"]
        # The commands are written for bash, but an image may have only sh.
        job_args = " -c " + shlex.quote(f"if command -v bash >/dev/null 2>&1; then exec bash {CONTAINER_JOB}; fi; "
                                        f"exec sh {CONTAINER_JOB}")
    # Exported here and passed by name (-e NAME), so values never need docker's --env-file escaping.
    exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(job.env.items()))
    gpu_setup = (TEMPLATES / "gpu_setup.sh.tmpl").read_text(encoding="utf-8").rstrip("\n") if gpu else ""
    return _render("start.sh.tmpl", replica_id=job.replica_id, job_file=job_file, gpu_setup=gpu_setup,
                   env_exports=exports, docker_flags=" ".join(flags),
                   image=shlex.quote(job.image or default_image(nvcc)), job_args=job_args)


def _yaml_block_safe(text: str) -> bool:
    # YAML literal blocks carry any printable text as is; other control characters need base64.
    return all(c in "\t\n" or (c.isprintable() and c != "\ufeff") for c in text) and "\r" not in text


def cloud_init(job: JobSpec, *, gpu: bool, nvcc: bool = False) -> str:
    """AWS user-data: a ``#cloud-config`` that writes the start script and runs it once."""
    script = start_script(job, gpu=gpu, nvcc=nvcc)
    if _yaml_block_safe(script):
        content = "    content: |\n" + "".join(line if line == "\n" else f"      {line}"
                                              for line in script.splitlines(keepends=True))
    else:
        content = "    encoding: b64\n    content: " + base64.b64encode(script.encode()).decode() + "\n"
    return _render("cloud-init.yml.tmpl", replica_id=job.replica_id, content=content.rstrip("\n"))


def startup_script(job: JobSpec, *, gpu: bool, nvcc: bool = False) -> str:
    """GCP ``startup-script`` metadata: the start script itself (the agent runs it at every boot)."""
    return start_script(job, gpu=gpu, nvcc=nvcc)


__all__ = ["DEFAULT_DEVEL_IMAGE", "DEFAULT_IMAGE", "cloud_init", "default_image", "start_script", "startup_script"]
