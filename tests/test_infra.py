"""infra/: every YAML parses, every DURASTACK_* name is one the code reads, and the compose stack, the manifests
and the Helm values point at real entry points, services, ports, secrets and task queues: the gateway in its own
container reachable by URL with the control token, scalable main workers, no forwarders. Fast: nothing is pulled
or run, except `docker compose config` and `kubectl kustomize` when those tools work here."""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
import tomllib
from pathlib import Path
from typing import Any, Iterator
from unittest import mock
from urllib.parse import urlsplit

import pytest
from ruamel.yaml import YAML

from gateway.app import GatewayServer
from models.backends import CLOUDS, load_backends_config
from models.settings import SEARCH_ATTRIBUTES, TASK_QUEUE, Settings
from rules.names import backend_queue

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DURASTACK_VAR = re.compile(r"\bDURASTACK_[A-Z0-9_]*[A-Z0-9]\b")
YAML_FILES = sorted(p for p in INFRA.rglob("*") if p.suffix in (".yaml", ".yml"))
K8S_FILES = sorted((INFRA / "k8s").glob("*.yaml"))
OUR_IMAGE = "durastack:"  # the k8s manifests' image before kustomize renames it
CONTROL_TOKEN = "DURASTACK_GATEWAY_CONTROL_TOKEN"
GATEWAY = ["python", "-m", "gateway"]
WORKER = ["python", "-m", "worker"]


def load_all(path: Path) -> list[Any]:
    return [d for d in YAML(typ="safe").load_all(path.read_text()) if d is not None]


def load_k8s(path: Path) -> list[Any]:
    """As kubectl reads a manifest: YAML 1.1, where a mode such as 0440 is octal. ruamel applies a version to the
    first document of a stream only, so each document is loaded on its own."""
    yaml = YAML(typ="safe")
    yaml.version = (1, 1)
    docs = (yaml.load(text) for text in re.split(r"^---[ \t]*$", path.read_text(), flags=re.M))
    return [d for d in docs if d is not None]


def shipped_sources() -> list[Path]:
    """The Python files the image installs: pyproject's packages and py-modules."""
    setup = PYPROJECT["tool"]["setuptools"]
    files = [ROOT / f"{m}.py" for m in setup["py-modules"]]
    for package in setup["packages"]:
        files += sorted((ROOT / package.replace(".", "/")).glob("*.py"))
    return files


SOURCE_TEXT = "\n".join(p.read_text() for p in shipped_sources())
COMPOSE = YAML(typ="safe").load((INFRA / "compose.yaml").read_text())
SERVICES: dict[str, dict] = COMPOSE["services"]
K8S = [doc for path in K8S_FILES if path.name != "kustomization.yaml" for doc in load_k8s(path)]
HELM = YAML(typ="safe").load((INFRA / "helm" / "temporal-values.yaml").read_text())


def k8s(kind: str) -> list[dict]:
    return [d for d in K8S if d.get("kind") == kind]


def ours(service: dict) -> bool:
    return "build" in service or str(service.get("image", "")).startswith("${IMAGE")


def pod_containers(pod_spec: dict) -> list[dict]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def workloads() -> Iterator[tuple[str, dict]]:
    """(name, pod template) of every Deployment and Job."""
    for d in k8s("Deployment") + k8s("Job"):
        yield d["metadata"]["name"], d["spec"]["template"]


def deployment(name: str) -> dict:
    (found,) = [d for d in k8s("Deployment") if d["metadata"]["name"] == name]
    return found


def gateway_pod() -> tuple[dict, dict]:
    """(the gateway's pod spec, its gateway container)."""
    pod = deployment("durastack-gateway")["spec"]["template"]["spec"]
    (gateway,) = [c for c in pod["containers"] if c["command"][:3] == GATEWAY]
    return pod, gateway


SSH_SECRET_COMMANDS = ("durastack ssh-keys ./durastack-ssh",
                       "kubectl -n durastack create secret generic durastack-ssh --from-file=./durastack-ssh")


@functools.cache
def ssh_secret_keys() -> frozenset[str]:
    """The keys of durastack-ssh, made as secret.example.yaml says (SSH_SECRET_COMMANDS): one per file of the
    directory that `durastack ssh-keys` fills."""
    from typer.testing import CliRunner

    from cli.main import app

    with tempfile.TemporaryDirectory() as tmp:
        made = Path(tmp) / SSH_SECRET_COMMANDS[0].split()[-1]
        assert CliRunner().invoke(app, ["ssh-keys", str(made)]).exit_code == 0
        return frozenset(p.name for p in made.iterdir() if p.is_file())  # what --from-file=DIR takes


def secret_keys() -> dict[str, set[str]]:
    """Secret name -> its keys, from the template, and durastack-ssh's from the files it is made of."""
    template = {d["metadata"]["name"]: set(d.get("stringData", {})) | set(d.get("data", {}))
                for d in load_k8s(INFRA / "k8s" / "secret.example.yaml")}
    return {**template, "durastack-ssh": set(ssh_secret_keys())}


def mounted_volumes(container: dict, pod_spec: dict) -> dict[str, dict]:
    """A container's mount path -> the pod volume mounted there."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}


def secret_refs(container: dict, pod_spec: dict) -> set[str]:
    """The Secrets a container reads: whole (envFrom), one key (env valueFrom), or mounted (not its pod's others)."""
    refs = {s["secretRef"]["name"] for s in container.get("envFrom", []) if "secretRef" in s}
    refs |= {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", [])
             if "secretKeyRef" in e.get("valueFrom", {})}
    return refs | {v["secret"]["secretName"] for v in mounted_volumes(container, pod_spec).values() if "secret" in v}


def secret_env(container: dict) -> set[str]:
    """The variable names a container gets from Secrets."""
    keys = secret_keys()
    names = {n for s in container.get("envFrom", []) if "secretRef" in s for n in keys[s["secretRef"]["name"]]}
    return names | {e["name"] for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}


def config_map() -> dict[str, str]:
    (cm,) = k8s("ConfigMap")
    return cm["data"]


def container_env(container: dict) -> dict[str, str]:
    """A container's plain environment: its ConfigMaps' data, then its own env values."""
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        if "configMapRef" in src:
            env.update(config_map())
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


def plain(env: dict[str, str]) -> dict[str, str]:
    """Compose values with their `${VAR:-default}` interpolations resolved to the defaults."""
    return {k: re.sub(r"\$\{[A-Z_]+:?[-?]([^}]*)\}", lambda m: m.group(1) if "?" not in m.group(0) else "x",
                      str(v)) for k, v in env.items()}


# --- argv checks shared by compose, k8s and the Dockerfile ------------------------------------------------------

def argparse_flags(module_file: Path) -> set[str]:
    """The `--flags` a module's argparse parser(s) accept, read from its source."""
    flags = set()
    for node in ast.walk(ast.parse(module_file.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return flags


def module_main(module: str) -> Path:
    """The file `python -m module` runs from the installed project; fails for a module the image lacks."""
    setup = PYPROJECT["tool"]["setuptools"]
    if module in setup["py-modules"]:
        return ROOT / f"{module}.py"
    assert module in setup["packages"], f"`python -m {module}`: not a module the image installs"
    main = ROOT / module.replace(".", "/") / "__main__.py"
    assert main.is_file(), f"`python -m {module}`: the package has no __main__.py"
    return main


def check_cli(args: list[str], where: str) -> None:
    import typer

    from cli.main import app

    assert "durastack" in PYPROJECT["project"]["scripts"]
    command = typer.main.get_command(app)
    path = ["durastack"]
    for arg in args:
        if arg.startswith("-"):
            names = {o for p in command.params for o in getattr(p, "opts", [])}
            assert arg.split("=")[0] in names, f"{where}: {' '.join(path)} has no option {arg}"
        else:  # a command group (typer may bring its own click: no isinstance here); cli.main loads its groups lazily
            sub = command.get_command(None, arg) if hasattr(command, "get_command") else None
            assert sub is not None, f"{where}: `{' '.join(path)} {arg}` is not a durastack command"
            command, path = sub, path + [arg]


def check_argv(argv: list[str], where: str) -> None:
    prog, args = argv[0], argv[1:]
    if prog == "python":
        assert args[0] == "-m", f"{where}: run our code as `python -m MODULE`"
        flags = argparse_flags(module_main(args[1]))
        for arg in args[2:]:
            if arg.startswith("--"):
                assert arg.split("=")[0] in flags, f"{where}: `python -m {args[1]}` has no flag {arg}"
    elif prog == "durastack":
        check_cli(args, where)
    else:  # no forwarders (socat) or namespace holders: each process listens where it is reached
        pytest.fail(f"{where}: unknown command {prog}")


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# --- every file --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(INFRA)))
def test_yaml_parses_without_duplicate_keys(path):
    docs = list(YAML(typ="safe").load_all(path.read_text()))  # duplicate keys raise
    if "dynamicconfig" not in path.parts:  # Temporal's dynamic config may be comments only
        assert any(isinstance(d, dict) and d for d in docs), f"{path}: no content"


def test_every_durastack_variable_is_read_by_the_shipped_code():
    used: dict[str, set[str]] = {}
    for path in INFRA.rglob("*"):
        if path.is_file():
            for name in DURASTACK_VAR.findall(path.read_text()):
                used.setdefault(name, set()).add(str(path.relative_to(INFRA)))
    assert len(used) >= 10  # the scan found the names the files do set
    unread = {n: sorted(files) for n, files in used.items() if not re.search(rf"\b{n}\b", SOURCE_TEXT)}
    assert not unread, f"named in infra/ but read nowhere in the installed code: {unread}"


def test_dockerfile_builds_the_project_and_runs_the_worker():
    text = (INFRA / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M)[1])
    check_argv(cmd, "Dockerfile CMD")
    # The build context is the repository: nothing the wheel packages may be ignored.
    ignored = {line.strip() for line in (INFRA / "Dockerfile.dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    setup = PYPROJECT["tool"]["setuptools"]
    needed = {p.split(".")[0] for p in setup["packages"]} | {f"{m}.py" for m in setup["py-modules"]} | \
        {"pyproject.toml", PYPROJECT["project"]["readme"]}
    assert not needed & ignored, needed & ignored
    assert "socat" not in text, "nothing forwards ports any more: the image does not need socat"
    exposed = {int(p) for p in re.search(r"^EXPOSE (.*)$", text, re.M)[1].split()}
    gateway = SERVICES["gateway"]["command"]
    assert exposed == {int(flag(gateway, "--port")), int(flag(gateway, "--control-port")),
                       int(config_map()["DURASTACK_WORKER_METRICS_PORT"])}


# --- compose -----------------------------------------------------------------------------------------------------

def test_compose_references_defined_services_volumes_secrets_and_files():
    volumes, secrets = set(COMPOSE.get("volumes") or {}), set(COMPOSE.get("secrets") or {})
    for name, svc in SERVICES.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in SERVICES, f"{name} depends on undefined {dep}"
            target = SERVICES[dep]
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in target, f"{name} waits for {dep} to be healthy; it has no healthcheck"
            if cond["condition"] == "service_completed_successfully":
                assert target.get("restart") == "no", f"{name} waits for {dep} to finish; it is not a one-shot"
        assert "network_mode" not in svc, f"{name}: every container has its own network namespace"
        for mount in svc.get("volumes", []):
            source = mount.split(":", 1)[0]
            if source.startswith("."):
                assert (INFRA / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in volumes, f"{name} mounts undefined volume {source}"
        for secret in svc.get("secrets", []):
            assert secret in secrets, f"{name} uses undefined secret {secret}"


def test_compose_commands_are_real_entry_points():
    checked = 0
    for name, svc in SERVICES.items():
        if ours(svc):
            check_argv(svc["command"], f"compose service {name}")
            checked += 1
        if "healthcheck" in svc and svc["healthcheck"]["test"][1] == "python":
            compile(svc["healthcheck"]["test"][3], f"{name} healthcheck", "exec")
    assert checked >= 5


def test_compose_one_shot_scripts_are_mounted_and_every_script_is_posix_shell():
    scripts = sorted(INFRA.rglob("*.sh"))
    mounted = set()
    for name, svc in SERVICES.items():
        if svc.get("entrypoint") == ["/bin/sh"]:
            (script,) = svc["command"]
            mount = next(m for m in svc["volumes"] if m.split(":")[1] == str(Path(script).parent))
            mounted.add((INFRA / mount.split(":")[0] / Path(script).name).resolve())
    mounted |= {(INFRA / m.split(":")[0]).resolve() for m in SERVICES["postgresql"]["volumes"] if m.endswith(".sh:ro")}
    assert mounted == {p.resolve() for p in scripts}, "every script is used, every used script exists"
    for path in scripts:
        assert path.read_text().startswith("#!/bin/sh\n"), path  # the images have no bash
        result = subprocess.run(["sh", "-n", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


def test_compose_gateway_listens_in_its_own_container_and_the_main_workers_reach_it_by_url(tmp_path):
    gateway, worker = SERVICES["gateway"], SERVICES["worker"]
    argv, env = gateway["command"], plain(gateway["environment"])
    port, control = flag(argv, "--port"), flag(argv, "--control-port")
    # It listens off loopback with a token: the gateway's own rule accepts that, and would refuse it tokenless.
    GatewayServer(tmp_path, host=env["DURASTACK_BIND_HOST"], control_token=env[CONTROL_TOKEN])
    with pytest.raises(ValueError):
        GatewayServer(tmp_path, host=env["DURASTACK_BIND_HOST"])
    assert [p.rsplit(":", 1)[1] for p in gateway["ports"]] == [port], "publish the traffic port only"
    settings = Settings.from_env(plain(worker["environment"]))
    url = urlsplit(settings.gateway_control_url)
    assert (url.hostname, str(url.port)) == ("gateway", control), "the main workers call the control API"
    variable = re.compile(r"\$\{(\w+)")
    assert variable.match(worker["environment"][CONTROL_TOKEN])[1] == \
        variable.match(gateway["environment"][CONTROL_TOKEN])[1], "both read the same token from .env"
    assert settings.control_token
    # Scalable: replicas from .env, no host port, no volume but the SSH keys (made once, then only read).
    assert variable.match(str(worker["deploy"]["replicas"]))
    assert "ports" not in worker and worker.get("volumes") == [f"ssh:{plain(worker['environment'])['DURASTACK_SSH_DIR']}"]
    assert f":{settings.worker_metrics_port}/metrics" in worker["healthcheck"]["test"][3]
    # The gateway's state volume is its own.
    state = {m.split(":")[0] for m in gateway["volumes"] if m.split(":")[1] == "/data/durastack"}
    sharing = [n for n, s in SERVICES.items()
               if n != "gateway" and state & {m.split(":")[0] for m in s.get("volumes", [])}]
    assert state and not sharing, sharing


def test_compose_cloud_workers_share_their_keys_and_their_tunnels_with_the_gateway():
    """On the SSH data path the gateway's upstream for a cloud replica is the local end of the tunnel that the
    replica's cloud worker holds: a Unix socket under the gateway's $DURASTACK_HOME/tunnels (gateway.upstreams),
    so that directory is one volume, at the same path, in the gateway and in every cloud worker. Every worker
    reaches the instances with the one key pair, on one volume that DURASTACK_SSH_DIR names."""
    from backends.ssh import tunnel_socket
    from backends.ssh_keys import ssh_dir

    gateway_home = Path(flag(SERVICES["gateway"]["command"], "--runtime-dir")).parent
    mounts = lambda name: dict(reversed(m.split(":")[:2]) for m in SERVICES[name].get("volumes", []))  # noqa: E731
    tunnels = mounts("gateway").get(str(gateway_home / "tunnels"))
    assert tunnels, "the gateway mounts a tunnels volume in its home"
    workers = [n for n, svc in SERVICES.items() if ours(svc) and svc.get("command") == WORKER]
    clouds = [n for n in workers if plain(SERVICES[n]["environment"]).get("DURASTACK_WORKER_BACKENDS") in ("aws", "gcp")]
    assert sorted(clouds) == ["worker-aws", "worker-gcp"]
    for name in workers:
        env = plain(SERVICES[name]["environment"])
        with mock.patch.dict(os.environ, {"DURASTACK_SSH_DIR": env.get("DURASTACK_SSH_DIR", "")}):
            keys = ssh_dir(Path(env["DURASTACK_HOME"]))  # as the worker finds them
        assert mounts(name).get(str(keys)) == "ssh", f"{name}: its SSH keys on the shared volume"
        if name in clouds:
            socket = tunnel_socket(Path(env["DURASTACK_HOME"]), "svc/group/r0-s0")
            assert socket.parent == gateway_home / "tunnels", f"{name}: tunnels where the gateway looks"
            assert mounts(name).get(str(socket.parent)) == tunnels, f"{name}: the gateway's tunnels volume"
    # The image makes both mount points its user's, so that new named volumes start out writable by it.
    dockerfile = (INFRA / "Dockerfile").read_text()
    assert "/data/durastack/tunnels /data/ssh" in dockerfile


def test_compose_registers_the_search_attributes_and_uses_postgres_visibility():
    assert SERVICES["temporal-setup"]["environment"]["SEARCH_ATTRIBUTES"].split() == list(SEARCH_ATTRIBUTES)
    env = SERVICES["temporal"]["environment"]
    assert env["DB"] == "postgres12" and env["VISIBILITY_DBNAME"] != env["DBNAME"]
    assert "ENABLE_ES" not in env  # visibility stays in PostgreSQL (SQL advanced visibility)
    initdb = (INFRA / "postgres" / "initdb.sh").read_text()
    assert all(f"CREATE DATABASE {db} " in initdb for db in (env["DBNAME"], env["VISIBILITY_DBNAME"], "durastack"))


# --- task queues: compose and k8s against worker.py ---------------------------------------------------------------

def workers() -> list[tuple[str, dict[str, str]]]:
    """(where, plain env) of every durastack worker in compose and in the manifests."""
    found = [(f"compose {n}", plain(s["environment"])) for n, s in SERVICES.items()
             if ours(s) and s.get("command") == WORKER]
    for name, pod in workloads():
        for c in pod["spec"]["containers"]:
            if c["image"].startswith(OUR_IMAGE) and c["command"] == WORKER:
                found.append((f"k8s {name}", container_env(c)))
    return found


def test_each_deployment_has_one_main_worker_and_a_worker_for_each_cloud_it_delegates():
    from worker import worker_backends

    for where in ("compose", "k8s"):
        mains, served = [], set()
        for name, env in workers():
            if not name.startswith(where):
                continue
            assert env.get("DURASTACK_TASK_QUEUE", TASK_QUEUE) == TASK_QUEUE
            backends = worker_backends([], env)
            if backends is None or "local" in backends:
                mains.append((name, env, backends))
            else:
                assert set(backends) <= set(CLOUDS), f"{name}: {backends}"
                served |= {backend_queue(TASK_QUEUE, b) for b in backends}
        assert len(mains) == 1, f"{where}: one main worker service, scaled by replicas; found {[m[0] for m in mains]}"
        name, env, backends = mains[0]
        assert backends == ["local"], f"{name}: cloud credentials belong to the cloud workers only"
        configured = [c for c in load_backends_config(env, path=INFRA / "absent.yml").configured() if c != "local"]
        delegated = {backend_queue(TASK_QUEUE, c) for c in configured}
        if where == "compose":  # clouds come from .env, with their profiles: each profile serves its queue
            delegated = {backend_queue(TASK_QUEUE, c) for c in CLOUDS}
        assert delegated <= served, f"{where}: {delegated - served} would have no poller"
    readme = (INFRA / "README.md").read_text()
    assert all(f"`{backend_queue(TASK_QUEUE, c)}`" in readme for c in CLOUDS) and f"`{TASK_QUEUE}`" in readme
    # The gateway cannot reach a local replica in another container: services must name their clouds.
    assert f"`backends: [{', '.join(CLOUDS)}]`" in readme


def test_infra_readme_names_only_files_that_exist():
    readme = (INFRA / "README.md").read_text()
    for name in set(re.findall(r"\b[A-Z][A-Za-z_-]*\.md\b", readme)):  # e.g. CONTRIBUTING.md: only once it exists
        assert (ROOT / name).is_file() or (INFRA / name).is_file(), f"infra/README.md names {name}, which is missing"
    for path in set(re.findall(r"`((?:k8s|helm|postgres|temporal)/[\w./-]+)`", readme)):
        assert (INFRA / path).exists(), f"infra/README.md names infra/{path}, which is missing"


def test_cloud_workers_hold_only_their_own_cloud_credentials():
    markers = {"aws": ("AWS_", "durastack-aws"), "gcp": ("GOOGLE_", "durastack-gcp")}
    for name, svc in SERVICES.items():
        if ours(svc) and svc.get("command") == WORKER:
            cloud = svc["environment"].get("DURASTACK_WORKER_BACKENDS")
            creds = {c for c, (prefix, _) in markers.items() if any(k.startswith(prefix) for k in svc["environment"])}
            assert creds == ({cloud} if cloud in markers else set()), f"compose {name}: {creds}"
    for name, pod in workloads():
        for c in pod["spec"]["containers"]:
            backends = container_env(c).get("DURASTACK_WORKER_BACKENDS")
            if backends is None:
                continue
            refs = secret_refs(c, pod["spec"])
            held = {cloud for cloud, (_, secret) in markers.items() if secret in refs}
            assert held == ({backends} if backends in markers else set()), f"k8s {name}: {held}"


def test_only_the_gateway_and_the_main_workers_hold_the_control_token():
    from worker import worker_backends

    def needs_token(argv: list[str], env: dict[str, str]) -> bool:
        return argv[:3] == GATEWAY or (argv == WORKER and "local" in (worker_backends([], env) or ["local"]))

    holders = set()
    for name, svc in SERVICES.items():
        if ours(svc):
            env = plain(svc.get("environment") or {})
            assert (CONTROL_TOKEN in env) == needs_token(svc["command"], env), f"compose {name}"
            if CONTROL_TOKEN in env:
                holders.add(name)
    assert holders == {"gateway", "worker"}
    holders = set()
    for name, pod in workloads():
        for c in pod_containers(pod["spec"]):
            if c["image"].startswith(OUR_IMAGE):
                held = CONTROL_TOKEN in secret_env(c)
                assert held == needs_token(c["command"], container_env(c)), f"k8s {name}/{c['name']}"
                if held:
                    holders.add(name)
    assert holders == {"durastack-gateway", "durastack-worker"}
    assert not [s for s, keys in secret_keys().items() if CONTROL_TOKEN in keys and len(keys) > 1], \
        "the token has a Secret of its own, so that no other workload reads it"


# --- k8s ----------------------------------------------------------------------------------------------------------

def test_k8s_containers_run_real_entry_points_and_probe_real_code():
    checked = 0
    for name, pod in workloads():
        for c in pod_containers(pod["spec"]):
            if c["image"].startswith(OUR_IMAGE):
                check_argv(c["command"], f"k8s {name}/{c['name']}")
                checked += 1
            for probe in ("livenessProbe", "readinessProbe"):
                command = c.get(probe, {}).get("exec", {}).get("command")
                if command:
                    compile(command[2], f"{name}/{c['name']} {probe}", "exec")
                port = c.get(probe, {}).get("httpGet", {}).get("port")
                assert port is None or port in {p["name"] for p in c.get("ports", [])}, f"{name}/{c['name']} {probe}"
    assert checked >= 5


def test_k8s_selectors_ports_and_references_resolve():
    pods = {d["metadata"]["name"]: d["spec"]["template"] for d in k8s("Deployment")}
    for d in k8s("Deployment"):
        assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()

    def matching(selector: dict) -> list[dict]:
        found = [p for p in pods.values() if selector.items() <= p["metadata"]["labels"].items()]
        assert found, f"selector {selector} matches no pod"
        return found

    for svc in k8s("Service"):
        ports = {p["name"]: p["containerPort"] for pod in matching(svc["spec"]["selector"])
                 for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, f"{svc['metadata']['name']}: no container port {port['targetPort']}"
        annotations = svc["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true":
            assert int(annotations["prometheus.io/port"]) in ports.values()
    for pdb in k8s("PodDisruptionBudget"):
        matching(pdb["spec"]["selector"]["matchLabels"])
    secrets = secret_keys()
    claims = {d["metadata"]["name"] for d in k8s("PersistentVolumeClaim")}
    (configmap,) = k8s("ConfigMap")
    for name, pod in workloads():
        for c in pod_containers(pod["spec"]):
            for src in c.get("envFrom", []):
                if "secretRef" in src:
                    assert src["secretRef"]["name"] in secrets, f"{name}: {src}"
                if "configMapRef" in src:
                    assert src["configMapRef"]["name"] == configmap["metadata"]["name"], f"{name}: {src}"
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("configMapKeyRef")
                assert ref is None or ref["key"] in config_map(), f"{name}: {ref}"
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                assert ref is None or ref["key"] in secrets.get(ref["name"], ()), f"{name}: {ref}"
        for v in pod["spec"].get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, f"{name}: {v}"
            if "secret" in v:
                assert v["secret"]["secretName"] in secrets, f"{name}: {v}"


def service_ports(svc: dict) -> dict[str, int]:
    """A Service's port -> the container port it reaches (targetPort names resolved on its pods)."""
    pods = [d["spec"]["template"] for d in k8s("Deployment")
            if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    named = {p["name"]: p["containerPort"]
             for pod in pods for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    return {p["port"]: named.get(p["targetPort"], p["targetPort"]) for p in svc["spec"]["ports"]}


def test_k8s_gateway_has_a_traffic_service_and_an_in_cluster_control_service(tmp_path):
    gw = deployment("durastack-gateway")
    _, c = gateway_pod()
    port, control = int(flag(c["command"], "--port")), int(flag(c["command"], "--control-port"))
    assert {p["containerPort"] for p in c["ports"]} == {port, control}
    env = container_env(c)
    assert CONTROL_TOKEN in secret_env(c)
    GatewayServer(tmp_path, host=env["DURASTACK_BIND_HOST"], control_token="from the Secret")
    with pytest.raises(ValueError):  # off loopback: without the Secret it would not start
        GatewayServer(tmp_path, host=env["DURASTACK_BIND_HOST"])
    # One gateway owns the routes (state.json on a ReadWriteOnce volume).
    assert gw["spec"]["replicas"] == 1 and gw["spec"]["strategy"]["type"] == "Recreate"
    services = {s["metadata"]["name"]: s for s in k8s("Service")}
    reaching = {name: set(service_ports(s).values()) for name, s in services.items()}
    assert reaching["durastack-gateway"] == {port}
    assert reaching["durastack-gateway-control"] == {control}
    for name, targets in reaching.items():
        if control in targets and services[name]["spec"]["selector"] == gw["spec"]["selector"]["matchLabels"]:
            assert services[name]["spec"].get("type", "ClusterIP") == "ClusterIP", f"{name}: inside the cluster only"
    assert not k8s("Ingress")
    annotations = services["durastack-gateway-control"]["metadata"]["annotations"]
    assert (int(annotations["prometheus.io/port"]), annotations["prometheus.io/path"]) == (control, "/metrics")


def test_k8s_main_workers_scale_and_reach_the_control_service_by_url():
    worker = deployment("durastack-worker")
    pod = worker["spec"]["template"]["spec"]
    (c,) = [c for c in pod["containers"] if c["command"] == WORKER]
    settings = Settings.from_env(container_env(c))
    url = urlsplit(settings.gateway_control_url)
    (svc,) = [s for s in k8s("Service") if s["metadata"]["name"] == url.hostname]
    _, gateway = gateway_pod()
    assert service_ports(svc).get(url.port) == int(flag(gateway["command"], "--control-port"))
    assert CONTROL_TOKEN in secret_env(c)
    # Scalable: more than one, rolled, no volume claimed by one pod.
    assert worker["spec"]["replicas"] >= 2 and worker["spec"]["strategy"]["type"] == "RollingUpdate"
    assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert [p for p in k8s("PodDisruptionBudget") if p["spec"]["selector"]["matchLabels"] ==
            worker["spec"]["selector"]["matchLabels"]]


def test_k8s_cloud_workers_share_their_keys_and_their_tunnels_with_the_gateway():
    """The compose rule (above) in a cluster, where a volume is one pod's: the cloud workers are containers of the
    gateway's pod, with one emptyDir for the tunnels at the gateway's $DURASTACK_HOME/tunnels; every worker reads
    the key pair and host-key seed from one Secret at DURASTACK_SSH_DIR, readable by the user the pods run as."""
    from backends.ssh import tunnel_socket
    from backends.ssh_keys import CLIENT_KEY, HOST_SEED, ssh_dir

    image_uid = int(re.search(r"--uid (\d+) ", (INFRA / "Dockerfile").read_text())[1])
    pod, gateway = gateway_pod()
    gateway_home = Path(flag(gateway["command"], "--runtime-dir")).parent
    tunnels = mounted_volumes(gateway, pod).get(str(gateway_home / "tunnels"))
    assert tunnels and "emptyDir" in tunnels, "the gateway mounts the pod's tunnels volume in its home"
    clouds, key_secrets = {}, []
    for name, template in workloads():
        spec = template["spec"]
        for c in spec["containers"]:
            if c["command"] != WORKER:
                continue
            env, mounts = container_env(c), mounted_volumes(c, spec)
            with mock.patch.dict(os.environ, {"DURASTACK_SSH_DIR": env.get("DURASTACK_SSH_DIR", "")}):
                keys = ssh_dir(Path(env["DURASTACK_HOME"]))  # as the worker finds them
            assert "DURASTACK_SSH_DIR" in env and "secret" in mounts.get(str(keys), {}), f"{name}/{c['name']}"
            assert next(m for m in c["volumeMounts"] if m["mountPath"] == str(keys)).get("readOnly") is True
            key_secrets.append(mounts[str(keys)]["secret"])
            identity = {spec["securityContext"][k] for k in ("runAsUser", "runAsGroup", "fsGroup")}
            assert identity == {image_uid}, f"{name}: the image's user, in the group the kubelet gives the keys"
            backends = env["DURASTACK_WORKER_BACKENDS"]
            if backends in CLOUDS:
                clouds[backends] = f"{name}/{c['name']}"
                socket = tunnel_socket(Path(env["DURASTACK_HOME"]), "svc/group/r0-s0")
                assert socket.parent == gateway_home / "tunnels", f"{c['name']}: tunnels where the gateway looks"
                assert mounts.get(str(socket.parent)) is tunnels, f"{c['name']}: the gateway's tunnels volume"
    assert sorted(clouds) == sorted(CLOUDS), clouds
    assert len(key_secrets) == 3  # the main workers and one container per cloud
    # One Secret holding the two files backends/ssh_keys.py reads. The kubelet makes each file root's, with the
    # group fsGroup and the group's read bit whatever the mode: say that mode, and none for others.
    assert {s["secretName"] for s in key_secrets} == {"durastack-ssh"}
    assert secret_keys()["durastack-ssh"] == {CLIENT_KEY, HOST_SEED}
    for where in (INFRA / "k8s" / "secret.example.yaml", INFRA / "README.md"):  # how to make it, said the same
        assert all(command in where.read_text() for command in SSH_SECRET_COMMANDS), where
    assert {s["defaultMode"] for s in key_secrets} == {0o440}
    # The gateway, internet-facing, holds neither the keys nor any cloud's credentials.
    assert not secret_refs(gateway, pod) & {"durastack-ssh", "durastack-aws", "durastack-gcp"}
    # A cloud worker restarting must not take the one gateway out of its Services (a pod is ready only while all
    # its containers are), and a disruption budget on a one-pod Deployment would block every node drain.
    labels = deployment("durastack-gateway")["spec"]["template"]["metadata"]["labels"]
    selecting = [svc for svc in k8s("Service") if svc["spec"]["selector"].items() <= labels.items()]
    assert {svc["metadata"]["name"] for svc in selecting} >= {"durastack-gateway", "durastack-gateway-control"}
    assert all(svc["spec"].get("publishNotReadyAddresses") is True for svc in selecting)
    assert not [b for b in k8s("PodDisruptionBudget") if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]


def test_k8s_every_worker_serves_metrics_on_its_pod_ip():
    cm = config_map()
    assert Settings.from_env(cm).bind_host not in ("127.0.0.1", "localhost", "::1")
    scraped = {s["metadata"]["name"]: s for s in k8s("Service")
               if s["metadata"].get("annotations", {}).get("prometheus.io/scrape") == "true"}
    for name, pod in workloads():
        ports = [p for c in pod["spec"]["containers"] for p in c.get("ports", [])]
        # One network namespace per pod: each port, and each port's name, once in it.
        assert len({p["name"] for p in ports}) == len({p["containerPort"] for p in ports}) == len(ports), name
        for c in pod["spec"]["containers"]:
            if c["command"] == WORKER:
                port = Settings.from_env(container_env(c)).worker_metrics_port
                assert [p["containerPort"] for p in c["ports"]] == [port], f"{name}/{c['name']}: its own port only"
                assert f"127.0.0.1:{port}/metrics" in c["livenessProbe"]["exec"]["command"][2]
                assert [s for s in scraped.values() if port in service_ports(s).values()
                        and int(s["metadata"]["annotations"]["prometheus.io/port"]) == port], \
                    f"{name}/{c['name']}: no scraped Service reaches its metrics"
    # Secrets never sit in the ConfigMap.
    assert not [k for k in cm if re.search(r"KEY|PASSWORD|DATABASE_URL|TOKEN", k)]


def test_k8s_search_attributes_job_and_the_chart_use_the_durastack_namespace():
    (job,) = k8s("Job")
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SEARCH_ATTRIBUTES"]["value"].split() == list(SEARCH_ATTRIBUTES)
    assert env["NAMESPACE"]["valueFrom"]["configMapKeyRef"]["key"] == "DURASTACK_NAMESPACE"
    created = [n["name"] for n in HELM["server"]["config"]["namespaces"]["namespace"]]
    assert HELM["server"]["config"]["namespaces"]["create"] and config_map()["DURASTACK_NAMESPACE"] in created


def test_kustomization_lists_every_manifest_but_the_secret_template():
    kustomization = YAML(typ="safe").load((INFRA / "k8s" / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(
        p.name for p in K8S_FILES if p.name not in ("kustomization.yaml", "secret.example.yaml"))
    assert [i["name"] for i in kustomization["images"]] == [OUR_IMAGE.rstrip(":")]


# --- Helm ----------------------------------------------------------------------------------------------------------

def test_helm_values_put_both_stores_on_postgres_with_fixed_shards_metrics_and_codec():
    persistence = HELM["server"]["config"]["persistence"]
    stores = persistence["datastores"]
    default, visibility = stores[persistence["defaultStore"]]["sql"], stores[persistence["visibilityStore"]]["sql"]
    assert default["pluginName"] == visibility["pluginName"] == "postgres12"  # SQL advanced visibility
    assert default["databaseName"] != visibility["databaseName"]
    assert all("password" not in s and s["existingSecret"] for s in (default, visibility))
    shards = persistence["numHistoryShards"]
    assert isinstance(shards, int) and shards > 0 and shards & (shards - 1) == 0
    lines = (INFRA / "helm" / "temporal-values.yaml").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "numHistoryShards:" in line)
    assert "can NEVER change" in "\n".join(lines[at - 5:at]), "say next to it that it cannot change"
    assert HELM["server"]["config"]["metrics"]["prometheus"]["listenAddress"]
    assert HELM["server"]["metrics"]["annotations"]["enabled"] is True
    codec = {e["name"]: e["value"] for e in HELM["web"]["additionalEnv"]}["TEMPORAL_CODEC_ENDPOINT"]
    assert codec == SERVICES["temporal-ui"]["environment"]["TEMPORAL_CODEC_ENDPOINT"].split(":-")[1].rstrip("}")


# --- external validators, when this machine has them ---------------------------------------------------------------

def _works(*argv: str) -> bool:
    if shutil.which(argv[0]) is None:
        return False
    try:
        return subprocess.run(argv, capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@pytest.mark.skipif(not _works("docker", "compose", "version"), reason="no docker compose here")
def test_docker_compose_config_accepts_the_stack(tmp_path):
    env = tmp_path / "env"
    env.write_text("POSTGRES_PASSWORD=p\nTEMPORAL_DB_PASSWORD=t\nSTORE_DB_PASSWORD=s\nCODEC_KEY=k\n")
    result = subprocess.run(["docker", "compose", "--env-file", str(env), "-f", str(INFRA / "compose.yaml"),
                             "--profile", "aws", "--profile", "gcp", "config", "--quiet"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(not _works("kubectl", "version", "--client"), reason="no kubectl here")
def test_kustomize_renders_the_manifests_with_namespace_and_image():
    result = subprocess.run(["kubectl", "kustomize", str(INFRA / "k8s")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    rendered = [d for d in YAML(typ="safe").load_all(result.stdout) if d]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in rendered) == \
        sorted((d["kind"], d["metadata"]["name"]) for d in K8S if d["kind"] != "Secret")
    assert all(d["metadata"]["namespace"] == "durastack" for d in rendered)
    images = {c["image"] for d in rendered if d["kind"] in ("Deployment", "Job")
              for c in pod_containers(d["spec"]["template"]["spec"])}
    assert not any(i.startswith(OUR_IMAGE) for i in images) and "registry.example.com/durastack:0.1.0" in images
    modes = lambda docs: sorted(v["secret"]["defaultMode"] for d in docs if d["kind"] == "Deployment"  # noqa: E731
                                for v in d["spec"]["template"]["spec"]["volumes"] if "secret" in v)
    assert modes(rendered) == modes(K8S) == [0o440] * 3, "kubectl reads 0440 as octal, as load_k8s does"
