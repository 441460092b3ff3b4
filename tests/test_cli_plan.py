"""`durastack apply` plans each group from the offers `durastack offers -f` lists, on the configured backends.

No control plane runs here: a plan that finds offers goes on to connect and exits 2 ("control plane not
running"); one that finds none exits 1 before connecting, naming the group and why.
"""

from __future__ import annotations

import json
import socket

import pytest
from typer.testing import CliRunner

from cli.main import app

SERVICE = """\
type: service
name: plan-test
port: 8000
backends: [{backend}]
groups:
  - name: llm
    replicas: 1
    commands: ["python3 -m http.server 8000"]
    resources:
      gpu: {gpu}
  - name: router
    replicas: 1
    commands: ["python3 -m http.server 8000"]
    resources:
      cpu: 2
      memory: 8GB
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    for name in ("DURASTACK_AWS_REGIONS", "DURASTACK_GCP_PROJECT", "DURASTACK_BACKENDS", "DURASTACK_GCP_REGIONS"):
        monkeypatch.delenv(name, raising=False)
    # Nothing listens there: the apply stops at the connection, after the plan.
    monkeypatch.setenv("DURASTACK_TEMPORAL_ADDRESS", f"127.0.0.1:{_free_port()}")
    monkeypatch.setenv("DURASTACK_HOME", str(home))
    monkeypatch.setenv("COLUMNS", "200")
    return home


def _run(*args: str):
    return CliRunner().invoke(app, list(args))


def _service(tmp_path, backend: str, gpu: str = "A10G"):
    path = tmp_path / "plan-test.yml"
    path.write_text(SERVICE.format(backend=backend, gpu=gpu))
    return path


@pytest.mark.parametrize("backend,config,gpu,gpu_type,cpu_region", [
    ("aws", "backends:\n  aws:\n    regions: [us-west-2]\n", "A10G", "g5.xlarge", "us-west-2"),
    ("gcp", "backends:\n  gcp:\n    project_id: p\n    regions: [europe-west4]\n", "L4", "g2-standard-4",
     "europe-west4"),
])
def test_a_gpu_service_is_planned_on_the_cloud_from_a_machine_without_gpu(home, tmp_path, backend, config, gpu,
                                                                           gpu_type, cpu_region):
    (home / "config.yml").write_text(config)
    service = _service(tmp_path, backend, gpu)
    result = _run("apply", "-f", str(service), "-y")
    assert "no offers" not in result.output, result.output
    assert result.exit_code == 2 and "control plane" in result.output  # planned, then tried to submit
    llm = next(line for line in result.output.splitlines() if "group=llm" in line)
    router = next(line for line in result.output.splitlines() if "group=router" in line)
    assert f"→ {backend} {gpu_type} ({cpu_region})" in llm
    assert f"→ {backend} " in router and f"({cpu_region})" in router

    # The same offers as `durastack offers -f`, which honours config.yml's regions too.
    listed = json.loads(_run("offers", "-f", str(service), "--json", "--limit", "1").stdout)
    best = {g["name"]: g["offers"][0] for g in listed["groups"]}
    assert best["llm"]["instance_type"] == gpu_type and best["llm"]["region"] == cpu_region
    assert best["router"]["region"] == cpu_region and best["router"]["gpu_count"] == 0
    assert best["router"]["instance_type"] in router


def test_a_cloud_that_is_not_configured_is_named(home, tmp_path):
    result = _run("apply", "-f", str(_service(tmp_path, "aws")), "-y")
    assert result.exit_code == 1
    assert "group llm: no offers" in result.output and "config.yml" in result.output
    assert "aws" in result.output


def test_offers_honour_configured_regions(home, tmp_path):
    (home / "config.yml").write_text("backends:\n  aws:\n    regions: [eu-west-1]\n")
    listed = json.loads(_run("offers", "--gpu", "A10G", "--backend", "aws", "--json", "--limit", "0").stdout)
    regions = {o["region"] for o in listed["groups"][0]["offers"]}
    assert regions == {"eu-west-1"}


LOCAL_DIND = """\
type: service
name: dind-test
port: 8000
groups:
  - name: builder
    replicas: 1
    docker: true
    commands: ["docker build ."]
  - name: web
    replicas: 1
    privileged: true
    commands: ["python3 -m http.server 8000"]
"""


def test_the_local_backend_says_at_plan_time_what_it_cannot_honour(home, tmp_path):
    path = tmp_path / "dind-test.yml"
    path.write_text(LOCAL_DIND)
    result = _run("apply", "-f", str(path), "-y")
    assert result.exit_code == 1
    assert "groups[0].docker: the local backend cannot run Docker-in-Docker" in result.output
    assert "groups[1].privileged: the local backend never runs replicas privileged" in result.output
    # With a cloud configured, those groups go there instead.
    (home / "config.yml").write_text("backends:\n  aws:\n    regions: [us-east-1]\n")
    result = _run("apply", "-f", str(path), "-y")
    assert result.exit_code == 2 and "→ aws " in result.output, result.output


def test_a_user_the_local_backend_refuses_is_said_at_plan_time(home, tmp_path, monkeypatch):
    from backends.local_host import probe_confinement

    if not probe_confinement()[0]:
        pytest.skip("replicas are not confined here: any other user is refused, as the unit tests show")
    path = tmp_path / "as-nobody.yml"
    path.write_text("type: service\nname: as-nobody\nport: 8000\nuser: nobody\ncommands: [\"sleep 1\"]\n")
    monkeypatch.delenv("DURASTACK_LOCAL_USERS", raising=False)
    result = _run("apply", "-f", str(path), "-y")
    assert result.exit_code == 1, result.output
    assert "user: user 'nobody': replicas run as" in result.output and "DURASTACK_LOCAL_USERS" in result.output
    monkeypatch.setenv("DURASTACK_LOCAL_USERS", "nobody")  # allowed: planned, then the control plane is asked
    assert _run("apply", "-f", str(path), "-y").exit_code == 2


PD = """\
type: service
name: pd-plan
port: 8000
groups:
  - name: router
    replicas: 1
    router: {type: sglang}
    commands: ["smg launch --pd-disaggregation"]
    resources: {cpu: 2, memory: 8GB}
  - name: prefill
    replicas: 1
    commands: ["serve prefill"]
    resources: {gpu: %s}
  - name: decode
    replicas: 1..2
    scaling: {metric: rps, target: 2}
    commands: ["serve decode"]
    resources: {gpu: %s}
"""
TWO_CLOUDS = ("backends:\n  aws:\n    regions: [us-east-1, us-west-2]\n"
              "  gcp:\n    project_id: p\n    regions: [us-central1, europe-west4]\n")


def test_a_service_whose_replicas_reach_each_other_is_planned_in_one_place(home, tmp_path):
    # Alone, the router's cheapest offer is wherever CPUs are cheapest; with its workers, it goes where they can.
    (home / "config.yml").write_text(TWO_CLOUDS)
    path = tmp_path / "pd.yml"
    path.write_text(PD % ("A10G", "A10G"))
    result = _run("apply", "-f", str(path), "-y")
    assert result.exit_code == 2 and "control plane" in result.output, result.output  # planned, then tried to submit
    place = next(line for line in result.output.splitlines() if line.strip().startswith("place:"))
    backend, region = place.split()[1:3]
    assert backend == "aws" and region in ("us-east-1", "us-west-2"), place
    groups = [line for line in result.output.splitlines() if "group=" in line]
    assert len(groups) == 3 and all(f"→ aws " in line and f"({region})" in line for line in groups), groups


def test_a_service_no_single_place_can_hold_is_refused_naming_the_groups(home, tmp_path):
    (home / "config.yml").write_text(TWO_CLOUDS)
    path = tmp_path / "pd.yml"
    path.write_text(PD % ("A10G", "V100"))  # A10G only on AWS, V100 only on GCP
    result = _run("apply", "-f", str(path), "-y")
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "nothing was submitted: no single backend and region holds every group" in text
    assert "group prefill only in aws/us-east-1, aws/us-west-2" in text
    assert "group decode only in gcp/europe-west4, gcp/us-central1" in text


def test_instance_types_and_zones_narrow_the_plan(home, tmp_path):
    (home / "config.yml").write_text("backends:\n  aws:\n    regions: [us-east-1, us-west-2]\n")
    path = tmp_path / "plan-test.yml"
    path.write_text(SERVICE.format(backend="aws", gpu="A10G") + "instance_types: [g5.2xlarge]\n"
                    "availability_zones: [us-west-2b]\n")
    result = _run("apply", "-f", str(path), "-y")
    llm = next(line for line in result.output.splitlines() if "group=llm" in line)
    assert "→ aws g5.2xlarge (us-west-2)" in llm, result.output
    router = next(line for line in result.output.splitlines() if "group=router" in line)
    assert "no offers" in router and "instance type g5.2xlarge" in result.output  # a CPU group finds no g5


def test_token_add_names_the_flag_of_a_bad_service(home):
    result = _run("token", "add", "ci", "--service", "svc-a,Not_A_Service")
    assert result.exit_code == 1 and "--service 'Not_A_Service' is not a service name" in result.output
