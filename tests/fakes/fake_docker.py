"""A stand-in for the Docker CLI on a simulated cloud host: ``pull``, ``run -d``, ``rm -f``, ``inspect``, ``logs``,
``exec``, ``kill`` — enough for what durastack sends over SSH (backends/userdata.py, backends/ssh.py). Its
registry has the private repositories ``$FAKE_REGISTRY`` lists, pulled only with their credentials.

A "container" is the group's commands run by a supervisor process in the host's network namespace, with the
env of ``--env-file``/``-e``, the working dir of ``-w``, and its ``-v SRC:/durastack`` mount seen at SRC (the
job file is copied with that path rewritten: there is no mount namespace here). Every other ``-v SRC:DST`` is seen
the same way: DST is rewritten to SRC in the job file and the env values, and SRC, a path of the host (under
``$FAKE_HOST_ROOT``, where the simulated host keeps its files), is made if missing, as Docker makes a bind's source. It is on the host's network,
as ``--network=host`` puts it (the flags it was given are kept in ``spec.json``). State lives under ``$FAKE_DOCKER_DIR/<name>``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

STATE = Path(os.environ.get("FAKE_DOCKER_DIR", "/tmp/fake-docker"))
VALUE_OPTS = {"--name", "--restart", "--label", "--gpus", "--env-file", "-e", "-u", "-w", "-p", "-v", "--entrypoint"}


def _dir(name: str) -> Path:
    return STATE / name


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return status != "Z"


def _run(args: list[str]) -> int:
    opts: dict[str, list[str]] = {}
    flags: set[str] = set()
    i = 0
    while i < len(args) and args[i].startswith("-"):
        if args[i] in VALUE_OPTS:
            opts.setdefault(args[i], []).append(args[i + 1])
            i += 2
        else:
            flags.add(args[i])
            i += 1
    image, rest = args[i], args[i + 1:]
    name = opts["--name"][0]
    d = _dir(name)
    if d.exists() and (d / "pid").exists() and _alive(int((d / "pid").read_text())):
        print(f"Conflict. The container name \"/{name}\" is already in use", file=sys.stderr)
        return 125
    d.mkdir(parents=True, exist_ok=True)
    for stale in ("exit", "pid"):
        (d / stale).unlink(missing_ok=True)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(d), "HOSTNAME": name}
    for path in opts.get("--env-file", []):
        for line in Path(path).read_text().splitlines():
            if line and not line.startswith("#"):
                k, _, v = line.partition("=")
                env[k] = v
    for kv in opts.get("-e", []):
        k, _, v = kv.partition("=")
        env[k] = v
    mount = next((v.split(":")[0] for v in opts.get("-v", []) if ":/durastack" in v), None)
    binds = _binds([v for v in opts.get("-v", []) if ":/durastack" not in v])
    env = {k: _seen_at(v, binds) for k, v in env.items()}
    argv = rest
    if mount and rest[:1] == ["-c"]:
        job = _seen_at((Path(mount) / "job.sh").read_text().replace("/durastack/", f"{mount}/"), binds)
        (d / "job.sh").write_text(job)
        argv = ["-c", rest[1].replace("/durastack/job.sh", str(d / "job.sh"))]
    spec = {"image": image, "argv": argv, "env": env, "cwd": opts.get("-w", [str(d)])[0], "flags": sorted(flags),
            "opts": {k: v for k, v in opts.items() if k != "--env-file"}}
    (d / "spec.json").write_text(json.dumps(spec))
    workdir = Path(spec["cwd"])
    workdir.mkdir(parents=True, exist_ok=True)
    log = open(d / "log", "ab")
    # The supervisor outlives this command (the SSH session that ran it ends at once), as dockerd does.
    sup = subprocess.Popen([sys.executable, __file__, "_supervise", name], stdin=subprocess.DEVNULL, stdout=log,
                           stderr=log, start_new_session=True, env={**os.environ, "FAKE_DOCKER_DIR": str(STATE)})
    deadline = time.monotonic() + 10
    while not (d / "pid").exists() and time.monotonic() < deadline and sup.poll() is None:
        time.sleep(0.01)
    print(name)
    return 0


def _binds(volumes: list[str]) -> list[tuple[str, str]]:
    """(container path, host path) of each ``-v SRC:DST[:ro]``, longest first; each source made if missing."""
    root = os.environ.get("FAKE_HOST_ROOT", "")
    binds = []
    for volume in volumes:
        source, target = volume.split(":")[:2]
        if root and not (source + "/").startswith(root.rstrip("/") + "/"):
            source = root.rstrip("/") + source  # a path of the simulated host, kept under its root
        Path(source).mkdir(parents=True, exist_ok=True)
        binds.append((target, source))
    return sorted(binds, key=lambda b: -len(b[0]))


def _seen_at(text: str, binds: list[tuple[str, str]]) -> str:
    """``text`` with each container path of ``binds`` (a whole path component) replaced by its host path."""
    for target, source in binds:
        text = re.sub(re.escape(target) + r"(?![\w.-])", lambda _: source, text)
    return text


def _supervise(name: str) -> int:
    d = _dir(name)
    spec = json.loads((d / "spec.json").read_text())
    shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
    proc = subprocess.Popen([shell, *spec["argv"]], env=spec["env"], cwd=spec["cwd"], stdin=subprocess.DEVNULL)
    (d / "pid").write_text(str(proc.pid))
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    code = proc.wait()
    (d / "exit").write_text(str(code if code >= 0 else 128 - code))
    return 0


def _state(name: str) -> tuple[str, int]:
    d = _dir(name)
    if not (d / "spec.json").exists():
        return "missing", 0
    if (d / "exit").exists():
        return "exited", int((d / "exit").read_text() or 0)
    if (d / "pid").exists() and _alive(int((d / "pid").read_text())):
        return "running", 0
    return "exited", 137


def _render(fmt: str, name: str, state: str, code: int) -> str:
    """A ``docker inspect -f`` template, for the fields durastack reads; any other is refused as docker refuses
    a field a container does not have."""
    labels = dict(kv.partition("=")[::2] for kv in
                  json.loads((_dir(name) / "spec.json").read_text())["opts"].get("--label", []))
    fields = {".State.Status": state, ".State.ExitCode": str(code)}

    def field(m: re.Match) -> str:
        expr = m.group(1).strip()
        label = re.fullmatch(r'index \.Config\.Labels "([^"]+)"', expr)
        if label:
            return labels.get(label.group(1), "<no value>")
        if expr not in fields:
            raise SystemExit(f"template: :1: executing \"\" at <{expr}>: can't evaluate field")
        return fields[expr]
    return re.sub(r"\{\{(.*?)\}\}", field, fmt)


def _kill(name: str, sig: int = signal.SIGKILL) -> None:
    d = _dir(name)
    if (d / "pid").exists():
        pid = int((d / "pid").read_text())
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _registry_refuses(image: str, repository: str, config: Path) -> str:
    """Why the registry refuses the pull ('' if it does not): a repository ``$FAKE_REGISTRY`` (JSON: {repository:
    "user:password"}) lists is private, pulled only with those credentials in the client's ``config.json`` under
    the registry's key, as ``docker login`` writes them. Refused in the daemon's words: Docker Hub's, or a
    registry's ``unauthorized``."""
    listed = Path(os.environ.get("FAKE_REGISTRY") or "/nonexistent")
    private = json.loads(listed.read_text()) if listed.exists() else {}
    if repository not in private:
        return ""
    first, slash, path = repository.partition("/")
    registry = first if slash and ("." in first or ":" in first or first == "localhost") else ""
    try:
        auths = json.loads((config / "config.json").read_text()).get("auths", {})
    except (OSError, ValueError):
        auths = {}
    given = auths.get(registry or "https://index.docker.io/v1/", {}).get("auth", "")
    if given and base64.b64decode(given).decode() == private[repository]:
        return ""
    if not registry:
        return (f"Error response from daemon: pull access denied for {repository}, repository does not exist or "
                "may require 'docker login': denied: requested access to the resource is denied")
    reference = image.rpartition(":")[2] if ":" in image.rsplit("/", 1)[-1] else "latest"
    return (f'Error response from daemon: Head "https://{registry}/v2/{path}/manifests/{reference}": '
            "unauthorized: authentication required")


def _pull(image: str, config: Path) -> int:
    """What ``docker pull`` prints without a terminal: per layer ``<id>: <state>`` lines. Each pull is recorded in
    ``pulls`` (one image per line), each that downloaded the image in ``downloads``; a second pull of an image finds
    it there, as Docker's image store would ("Image is up to date", nothing downloaded). A
    reference Docker cannot parse (a repository name with capitals) fails as Docker fails it; a private one
    without its credentials as the registry refuses it."""
    repository = image.split("@")[0].rsplit(":", 1)[0] if "/" not in image.rsplit(":", 1)[-1] else image
    if repository != repository.lower() or not image or any(c.isspace() for c in image):
        # Docker refuses the reference before it asks any registry.
        print(f"invalid reference format: repository name ({repository}) must be lowercase", file=sys.stderr)
        return 1
    refused = _registry_refuses(image, repository, config)
    if refused:
        print(refused, file=sys.stderr)
        return 1
    record = STATE / "pulls"
    pulled = record.read_text().splitlines() if record.exists() else []
    record.parent.mkdir(parents=True, exist_ok=True)
    with open(record, "a") as f:
        f.write(image + "\n")
    name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "latest")
    print(f"{tag}: Pulling from {name}", flush=True)
    layers = [hashlib.sha256(f"{image} {n}".encode()).hexdigest()[:12] for n in range(3)]
    if image in pulled:
        print(f"Digest: sha256:{'0' * 64}\nStatus: Image is up to date for {image}", flush=True)
        return 0
    with open(STATE / "downloads", "a") as f:
        f.write(image + "\n")
    for state in ("Pulling fs layer", "Downloading", "Download complete", "Pull complete"):
        for layer in layers:
            print(f"{layer}: {state}", flush=True)
    print(f"Digest: sha256:{'0' * 64}\nStatus: Downloaded newer image for {image}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    config = Path(os.environ.get("DOCKER_CONFIG") or Path(os.environ.get("HOME", "/root")) / ".docker")
    if argv[:1] == ["--config"]:  # the client's own option, before the command
        config, argv = Path(argv[1]), argv[2:]
    cmd, args = argv[0], argv[1:]
    if cmd == "run":
        return _run(args)
    if cmd == "_supervise":
        return _supervise(args[0])
    if cmd == "rm":
        name = args[-1]
        _kill(name)
        d = _dir(name)
        if d.exists():
            for f in d.iterdir():
                f.unlink() if f.is_file() else None
        return 0
    if cmd == "kill":
        _kill(args[-1])
        return 0
    if cmd == "inspect":
        name = args[-1]
        state, code = _state(name)
        if state == "missing":
            print(f"Error: No such object: {name}", file=sys.stderr)
            return 1
        fmt = args[args.index("-f") + 1] if "-f" in args else None
        print(_render(fmt, name, state, code) if fmt else json.dumps([{"Name": f"/{name}"}]))
        return 0
    if cmd == "logs":
        name, follow = args[-1], "-f" in args
        path = _dir(name) / "log"
        if not path.exists():
            print(f"Error: No such container: {name}", file=sys.stderr)
            return 1
        with open(path, "rb") as f:
            if "--tail" in args:  # the last N lines, then (with -f) what follows
                tail = int(args[args.index("--tail") + 1])
                lines = f.read().splitlines(keepends=True)
                sys.stdout.buffer.write(b"".join(lines[-tail:] if tail > 0 else []))
                sys.stdout.flush()
            while True:
                chunk = f.read(65536)
                if chunk:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()
                    continue
                if not follow or _state(name)[0] != "running":
                    return 0
                time.sleep(0.1)
    if cmd == "exec":
        rest = [a for a in args if a not in ("-i", "-t", "-it")]
        name, command = rest[0], rest[1:]
        spec = json.loads((_dir(name) / "spec.json").read_text())
        return subprocess.call(command, env=spec["env"], cwd=spec["cwd"])
    if cmd == "pull":
        return _pull(args[-1], config)
    if cmd == "info":
        return 0
    print(f"fake docker: {cmd} is not simulated", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
