"""GCP backend: google-cloud-compute (REST) against the fake Compute server in tests/fakes/gce.py.

The client is pointed at the fake with the endpoint setting and anonymous credentials; it never reaches
Google (insert_unary + our own ZoneOperationsClient, so even operation polling stays on the fake).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

from activities.cloud import OffersExhausted, provision_cloud, terminate_cloud, terminate_service
from activities.replica import ReplicaActivities
from activities.replica_cloud import CloudReplicas
from backends.catalog import load_catalog
from backends.cloud import make_backends
from backends.cloud_errors import CloudError, ErrorKind
from backends.gcp import REQUEST_NS, GCPBackend
from backends.ssh_keys import SSHKeys
from backends.userdata import BootKeys, startup_script
from models.backends import BackendsConfig, GCPConfig, owner, provisioning_key
from models.offers import InstanceOffer, describe_mismatch, match_offers
from models.replica import JobSpec
from models.resources import ResourcesSpec
from models.messages import LaunchInput, ReplicaInput, TeardownInput
from store import Store, StoreLedger
from tests.fakes.activity_env import FakeClient, FakeGateway, activity_env, app_server, refusal_of
from tests.fakes.gce import gce  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parent.parent
CHILD = [sys.executable, "-m", "tests.fakes.provision_child"]
GPU = ResourcesSpec.model_validate({"gpu": "1..", "disk": "200GB"})
CENTRAL = ["us-central1-a", "us-central1-b", "us-central1-c"]
NEWEST_DLVM = "common-cu129-ubuntu-2404-nvidia-580-v20261020"  # the default family's newest (tests/fakes/gce.py)


def offer(instance_type: str, price: float, *, region="us-central1", zones=None, gpu=("T4", 16.0, 1),
          spot=False) -> InstanceOffer:
    name, mem, count = gpu or (None, 0.0, 0)
    # By default the catalog's zones of that type: the fake, like Compute, refuses a zone that lacks it.
    known = next((o.zones for o in load_catalog() if o.backend == "gcp" and o.instance_type == instance_type
                  and o.region == region), [])
    return InstanceOffer(backend="gcp", instance_type=instance_type, region=region,
                         zones=zones if zones is not None else known[:2], cpus=4, memory_gb=15.0,
                         gpu_vendor="nvidia" if gpu else None, gpu_name=name, gpu_memory_gb=mem, gpu_count=count,
                         spot=spot, price=price)


N1_T4 = offer("n1-standard-4", 0.54, zones=CENTRAL)
N1_T4_SPOT = offer("n1-standard-4", 0.18, zones=CENTRAL, spot=True)
G2 = offer("g2-standard-4", 0.71, gpu=("L4", 24.0, 1))
G2_EAST = offer("g2-standard-4", 0.72, region="us-east1", gpu=("L4", 24.0, 1))


def job(replica=0, submission=0, service="Svc.One", group="llm") -> JobSpec:
    return JobSpec(service=service, group=group, replica_num=replica, submission_num=submission, port=8000,
                   commands=["vllm serve Qwen/Qwen2.5-0.5B --port 8000"], env={"HF_TOKEN": "hf_x"})


@pytest.fixture
def gcp(gce):
    return GCPBackend(GCPConfig(project_id="proj", regions=["us-central1", "us-east1"], endpoint=gce.url))


@pytest.fixture
def ledger(tmp_path):
    return StoreLedger(Store(f"sqlite:///{tmp_path}/store.db"))


def walk(backend, ledger, offers, j=None):
    return provision_cloud(j or job(), GPU, offers, backends={"gcp": backend}, ledger=ledger, max_offers=25)


# --- the launch -----------------------------------------------------------------------------------

def test_gpu_group_comes_up_with_accelerators_spot_labels_and_startup_script(gcp, ledger, gce):
    chosen, inst = walk(gcp, ledger, [N1_T4_SPOT, G2])
    key = provisioning_key("Svc.One", "llm", 0, 0, N1_T4_SPOT)
    assert chosen == N1_T4_SPOT.model_copy(update={"disk_gb": 200.0})
    assert (inst.instance_id, inst.zone, inst.state, inst.spot) == (key, "us-central1-a", "running", True)
    (req,) = gce.inserts()
    body = req["body"]
    assert req["path"] == "/compute/v1/projects/proj/zones/us-central1-a/instances"
    assert req["query"]["requestId"] == str(__import__("uuid").uuid5(REQUEST_NS, f"{key}/us-central1-a"))
    assert body["name"] == key and body["machineType"] == "zones/us-central1-a/machineTypes/n1-standard-4"
    assert body["guestAccelerators"] == [{"acceleratorType": "zones/us-central1-a/acceleratorTypes/nvidia-tesla-t4",
                                          "acceleratorCount": 1}]
    assert body["scheduling"] == {"provisioningModel": "SPOT", "onHostMaintenance": "TERMINATE",
                                  "automaticRestart": False, "instanceTerminationAction": "DELETE"}
    assert body["labels"] == {"managed-by": "durastack", "durastack-service": "svc-one", "durastack-group": "llm",
                              "durastack-replica": "r0-s0", "durastack-key": key, "durastack-port": "8000",
                              "durastack-host-key": "after-boot", "durastack-image": NEWEST_DLVM}
    assert inst.image == NEWEST_DLVM
    (disk,) = body["disks"]
    assert disk["boot"] and disk["autoDelete"] and disk["initializeParams"]["diskSizeGb"] == "200"
    # The default family, resolved to its newest image: the boot disk names what the instance boots.
    assert disk["initializeParams"]["sourceImage"] == \
        f"projects/deeplearning-platform-release/global/images/{NEWEST_DLVM}"
    items = {i["key"]: i["value"] for i in body["metadata"]["items"]}
    keys = SSHKeys.of_home(Path("/nonexistent"))  # DURASTACK_SSH_DIR (tests/conftest.py)
    host = keys.host_key(key)
    boot = BootKeys(host.private_openssh, host.public_openssh, keys.client_public())
    assert items == {"startup-script": startup_script(job(), gpu=True, keys=boot), "install-nvidia-driver": "True",
                     "block-project-ssh-keys": "true", "enable-oslogin": "FALSE"}
    # Metadata carries the host key and the installation's key, never env or commands (they come over SSH).
    for value in job().env.values():
        assert value not in json.dumps(body)
    assert not any(c in json.dumps(body) for c in job().commands)
    assert body["tags"]["items"] == [gcp.network_tag, gcp.service_tag("Svc.One")]
    rules = {r["name"]: r for r in gce.firewall_rules()}
    assert set(rules) == {gcp.firewall_name, gcp.service_tag("Svc.One")}
    rule = rules[gcp.firewall_name]
    # The default config: an external IP and no gateway_cidrs, so the gateway dials from anywhere.
    assert rule["targetTags"] == [gcp.network_tag] and rule["sourceRanges"] == ["0.0.0.0/0"]
    assert rule["allowed"] == [{"IPProtocol": "tcp", "ports": ["22"]}]  # SSH only, never the service port
    own = rules[gcp.service_tag("Svc.One")]  # the service's instances reach each other, on any port
    assert own["sourceTags"] == own["targetTags"] == [gcp.service_tag("Svc.One")] and "sourceRanges" not in own
    assert own["allowed"] == [{"IPProtocol": "tcp"}, {"IPProtocol": "udp"}]
    assert inst.address == "34.1.{}.2:8000".format(inst.public_ip.split(".")[2]) and inst.price == 0.18
    assert [e["phase"] for e in ledger.entries(key)] == ["intent", "created"]
    assert inst.owner == owner("gcp", "Svc.One", "llm", 0, 0)


def test_machine_types_with_built_in_gpus_get_no_accelerators_and_on_demand_scheduling(gcp, gce):
    inst = gcp.create(job(), G2, provisioning_key("Svc.One", "llm", 0, 0, G2))
    body = gce.inserts()[-1]["body"]
    assert "guestAccelerators" not in body and not inst.spot
    assert body["scheduling"] == {"provisioningModel": "STANDARD", "onHostMaintenance": "TERMINATE",
                                  "automaticRestart": True}


def test_cpu_instance_uses_the_cpu_image_and_may_migrate(gcp, gce):
    cpu = offer("n2-standard-4", 0.19, gpu=None)
    gcp.create(job(), cpu, provisioning_key("Svc.One", "llm", 0, 0, cpu))
    body = gce.inserts()[-1]["body"]
    assert body["disks"][0]["initializeParams"]["sourceImage"] == \
        "projects/ubuntu-os-cloud/global/images/ubuntu-2204-jammy-v20261015"
    assert body["scheduling"]["onHostMaintenance"] == "MIGRATE"
    assert [i["key"] for i in body["metadata"]["items"]] == ["startup-script", "block-project-ssh-keys",
                                                             "enable-oslogin"]


# --- the boot image ----------------------------------------------------------------------------------

def test_the_gpu_family_resolves_to_its_newest_image_once_per_ttl(gcp, gce):
    gcp.create(job(), G2, provisioning_key("Svc.One", "llm", 0, 0, G2))
    gce.add_image("deeplearning-platform-release", "common-cu129-ubuntu-2404-nvidia-580-v20261201",
                  "common-cu129-ubuntu-2404-nvidia-580")
    gcp.create(job(replica=1), G2, provisioning_key("Svc.One", "llm", 1, 0, G2))
    lookups = [r["path"] for r in gce.requests if "/global/images/" in r["path"]]
    assert lookups == ["/compute/v1/projects/deeplearning-platform-release/global/images/family/"
                       "common-cu129-ubuntu-2404-nvidia-580"]  # cached: the second launch asked nothing
    sources = [r["body"]["disks"][0]["initializeParams"]["sourceImage"] for r in gce.inserts()]
    assert sources == [f"projects/deeplearning-platform-release/global/images/{NEWEST_DLVM}"] * 2
    gcp._boot_images.clear()  # the TTL passed
    inst = gcp.create(job(replica=2), G2, provisioning_key("Svc.One", "llm", 2, 0, G2))
    assert inst.image == "common-cu129-ubuntu-2404-nvidia-580-v20261201"


def test_a_retired_family_fails_the_launch_naming_the_setting(gce, ledger):
    retired = "projects/deeplearning-platform-release/global/images/family/common-cu124-ubuntu-2204-py310"
    old = GCPBackend(GCPConfig(project_id="proj", regions=["us-central1"], endpoint=gce.url, gpu_image=retired))
    with pytest.raises(CloudError, match="backends.gcp.gpu_image: no image family common-cu124-ubuntu-2204-py310 "
                                         "in project deeplearning-platform-release") as e:
        walk(old, ledger, [N1_T4, G2])
    assert e.value.kind is ErrorKind.FATAL and gce.inserts() == []  # one lookup, no offer walked
    # Compute itself refuses the retired family in an insert, as the fake does: what a launch without the lookup met.
    status, answer = gce.route("POST", "/compute/v1/projects/proj/zones/us-central1-a/instances", {}, {
        "name": "x", "machineType": "zones/us-central1-a/machineTypes/g2-standard-4",
        "disks": [{"boot": True, "initializeParams": {"sourceImage": retired}}]})
    assert status == 400 and "The referenced image resource cannot be found" in answer["error"]["message"]


def test_a_pinned_image_is_used_as_is_and_an_obsolete_one_is_refused(gce):
    gce.add_image("proj", "my-cuda-image")
    pinned = GCPBackend(GCPConfig(project_id="proj", regions=["us-central1"], endpoint=gce.url,
                                  gpu_image="global/images/my-cuda-image"))
    assert pinned.create(job(), G2, provisioning_key("Svc.One", "llm", 0, 0, G2)).image == "my-cuda-image"
    assert gce.inserts()[-1]["body"]["disks"][0]["initializeParams"]["sourceImage"] == \
        "projects/proj/global/images/my-cuda-image"
    gce.add_image("proj", "my-old-image", deprecated="OBSOLETE")
    old = GCPBackend(GCPConfig(project_id="proj", regions=["us-central1"], endpoint=gce.url,
                               gpu_image="projects/proj/global/images/my-old-image"))
    with pytest.raises(CloudError, match=r"no image my-old-image \(obsolete\) in project proj"):
        old.create(job(), G2, provisioning_key("Svc.One", "llm", 0, 0, G2))


@pytest.mark.parametrize("value", ["common-cu129-ubuntu-2404-nvidia-580", "projects/p/images/x",
                                   "projects/p/global/images/family/Bad_Name"])
def test_an_image_setting_that_names_no_image_is_refused(value):
    with pytest.raises(ValueError, match=f"backends.gcp.gpu_image: '{value}' names no Compute image"):
        GCPConfig(project_id="proj", gpu_image=value)


# --- exactly once -----------------------------------------------------------------------------------

def test_same_key_twice_adopts_on_409(gcp, gce):
    key = provisioning_key("Svc.One", "llm", 0, 0, G2)
    first = gcp.create(job(), G2, key)
    again = gcp.create(job(), G2, key)
    assert again.instance_id == first.instance_id and len(gce.all_instances()) == 1


def test_lost_responses_ten_times_then_one_instance(gcp, gce):
    key = provisioning_key("Svc.One", "llm", 0, 0, G2)
    gce.lose_responses(1)  # created, answered 503
    with pytest.raises(CloudError) as e:
        gcp.create(job(), G2, key)
    assert e.value.kind is ErrorKind.TRANSIENT
    for _ in range(10):  # same requestId → the same operation; or the name → 409 → adopt
        assert gcp.create(job(), G2, key).instance_id == key
    assert len(gce.all_instances()) == 1


def test_walker_repeated_after_lost_responses_keeps_one_instance(gcp, ledger, gce):
    gce.fail("capacity", machine_type="n1-standard-4", times=3)  # every zone of the cheapest offer, once
    gce.lose_responses(1)
    with pytest.raises(CloudError):
        walk(gcp, ledger, [N1_T4, G2])
    for _ in range(10):
        chosen, inst = walk(gcp, ledger, [N1_T4, G2])  # capacity is back for n1, but g2 exists already
        assert chosen.instance_type == "g2-standard-4"
    assert [i["name"] for i in gce.all_instances()] == [provisioning_key("Svc.One", "llm", 0, 0, G2)]


def _spec(tmp_path, gce, n: int, kill: bool) -> Path:
    spec = {"config": {"gcp": {"project_id": "proj", "regions": ["us-central1"], "endpoint": gce.url}},
            "job": job().model_dump(mode="json"), "resources": GPU.model_dump(mode="json"),
            "offers": [o.model_dump(mode="json") for o in (N1_T4, G2)], "store": f"sqlite:///{tmp_path}/store.db",
            "kill": kill}
    path = tmp_path / f"spec{n}.json"
    path.write_text(json.dumps(spec))
    return path


def test_worker_killed_after_the_cloud_call_ten_times_leaves_one_instance(tmp_path, gce):
    gce.fail("capacity", machine_type="n1-standard-4", times=3)
    for n in range(10):
        proc = subprocess.run([*CHILD, str(_spec(tmp_path, gce, n, True))], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
    proc = subprocess.run([*CHILD, str(_spec(tmp_path, gce, 99, False))], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    result = json.loads(proc.stdout)
    (only,) = gce.all_instances()
    assert only["name"] == result["instance"]["instance_id"] == provisioning_key("Svc.One", "llm", 0, 0, G2)
    assert len(gce.inserts()) == 4  # three zones without capacity, then g2 once; later workers adopted it


# --- zones, offers, errors --------------------------------------------------------------------------

def test_zone_without_capacity_moves_to_the_next_zone(gcp, ledger, gce):
    gce.fail("capacity", zone="us-central1-a")
    _, inst = walk(gcp, ledger, [N1_T4, G2])
    assert (inst.instance_type, inst.zone) == ("n1-standard-4", "us-central1-b")


def test_no_capacity_in_any_zone_moves_to_the_next_offer(gcp, ledger, gce):
    gce.fail("capacity", machine_type="n1-standard-4")
    chosen, inst = walk(gcp, ledger, [N1_T4, G2])
    assert chosen.instance_type == inst.instance_type == "g2-standard-4"
    assert [r["path"].split("/")[6] for r in gce.inserts()] == CENTRAL + ["us-central1-a"]


@pytest.mark.parametrize("kind", ["quota", "quota_sync_regional"])
def test_quota_exceeded_skips_the_region(gcp, ledger, gce, kind):
    if kind == "quota":
        gce.fail("quota", zone="us-central1-a")
    else:
        gce.fail("quota_sync", zone="us-central1-a",
                 message="Quota 'NVIDIA_T4_GPUS' exceeded. Limit: 0.0 in region us-central1.")
    chosen, _ = walk(gcp, ledger, [N1_T4, G2, G2_EAST])
    assert (chosen.instance_type, chosen.region) == ("g2-standard-4", "us-east1")
    assert len(gce.inserts()) == 2  # n1 in us-central1-a, then g2 in us-east1; g2 in us-central1 skipped


def test_global_gpu_quota_skips_every_region(gcp, ledger, gce):
    gce.fail("quota_sync")  # GPUS_ALL_REGIONS
    with pytest.raises(OffersExhausted, match="skipped, quota exceeded for gcp all regions"):
        walk(gcp, ledger, [N1_T4, G2, G2_EAST])
    assert len(gce.inserts()) == 1


@pytest.mark.parametrize("status,reason,kind,message", [
    (403, "forbidden", ErrorKind.FATAL, "forbidden: HTTP 403 here"),
    # google-auth answers a 401 by refreshing the credentials; anonymous ones cannot be refreshed.
    (401, "required", ErrorKind.FATAL, "GCP credentials: Anonymous credentials cannot be refreshed"),
    (400, "invalid", ErrorKind.FATAL, "invalid: HTTP 400 here"),
    (503, "backendError", ErrorKind.TRANSIENT, "backendError: HTTP 503 here"),
    (429, "rateLimitExceeded", ErrorKind.TRANSIENT, "rateLimitExceeded: HTTP 429 here")])
def test_fatal_and_transient_errors_stop_the_walk(gcp, ledger, gce, status, reason, kind, message):
    gce.fail("http", status=status, reason=reason, message=f"HTTP {status} here")
    with pytest.raises(CloudError, match=message) as e:
        walk(gcp, ledger, [N1_T4, G2])
    assert e.value.kind is kind and len(gce.inserts()) == 1


def test_name_taken_by_a_foreign_instance_is_fatal(gcp, gce):
    key = provisioning_key("Svc.One", "llm", 0, 0, G2)
    gce.instances[("proj", "us-central1-a", key)] = {"name": key, "status": "RUNNING", "labels": {"team": "ml"},
                                                     "machineType": "zones/us-central1-a/machineTypes/e2-small"}
    with pytest.raises(CloudError, match="taken by an instance durastack did not label"):
        gcp.create(job(), G2, key)


# --- listing, termination, stop ---------------------------------------------------------------------

def test_list_tagged_filters_by_label_and_region(gcp, ledger, gce):
    walk(gcp, ledger, [G2], j=job(0))
    walk(gcp, ledger, [G2_EAST], j=job(1, service="other"))
    assert sorted((i.region, i.owner[0]) for i in gcp.list_tagged()) == [("us-central1", "svc-one"),
                                                                         ("us-east1", "other")]
    assert [i.region for i in gcp.list_tagged(service="other")] == ["us-east1"]
    assert [i.region for i in gcp.list_tagged(regions=["us-east1"])] == ["us-east1"]
    assert "labels.managed-by" in gce.requests[-1]["query"]["filter"]


def test_terminating_a_gone_instance_is_success(gcp, ledger, gce):
    _, inst = walk(gcp, ledger, [G2])
    terminate_cloud(inst, backends={"gcp": gcp}, ledger=ledger)
    assert gcp.get(inst) is None and gce.all_instances() == []
    terminate_cloud(inst, backends={"gcp": gcp}, ledger=ledger)


def test_stopping_the_service_leaves_no_instance_labelled_for_it(gcp, ledger, gce):
    for n in range(3):
        walk(gcp, ledger, [G2 if n % 2 else G2_EAST], j=job(n))
    walk(gcp, ledger, [G2], j=job(9, service="keep"))
    assert terminate_service({"gcp": gcp}, "Svc.One", ledger=ledger) == 3
    assert gcp.list_tagged(service="Svc.One") == []
    assert [i["labels"]["durastack-service"] for i in gce.all_instances()] == ["keep"]
    # "keep" still runs: the SSH rule and its own rule stay; Svc.One's went with its last instance.
    assert sorted(r["name"] for r in gce.firewall_rules()) == sorted([gcp.firewall_name, gcp.service_tag("keep")])
    assert terminate_service({"gcp": gcp}, "keep", ledger=ledger) == 1
    assert gce.firewall_rules() == []  # no durastack instance left: the rules go too


def test_rules_a_release_deleted_just_before_an_insert_are_made_again_after_it(gcp, ledger, gce):
    """GCE deletes a rule whatever instances it targets: another worker's release (its service's last replica torn
    down) deleted the rules after this worker had checked them (still remembered as made) and before its insert."""
    walk(gcp, ledger, [G2], j=job(0))
    releasing = GCPBackend(GCPConfig(project_id="proj", regions=["us-central1"], endpoint=gce.url))
    for name in (gcp.firewall_name, gcp.service_tag("Svc.One")):
        releasing._delete_rule(name)
    walk(gcp, ledger, [G2], j=job(1))
    assert sorted(r["name"] for r in gce.firewall_rules()) == sorted([gcp.firewall_name, gcp.service_tag("Svc.One")])


def test_a_release_that_meets_an_instance_launched_meanwhile_puts_the_rules_back(gcp, ledger, gce, monkeypatch):
    """The other order: the release listed no instance, a launch inserted one (its rules checked before they went),
    then the release deleted the rules; it lists again after deleting and makes them again."""
    walk(gcp, ledger, [G2], j=job(0))
    looks, real = [], gcp.list_tagged

    def list_tagged(*args, **kwargs):
        looks.append(kwargs)
        return [] if len(looks) == 1 else real(*args, **kwargs)  # the first look came before the insert

    monkeypatch.setattr(gcp, "list_tagged", list_tagged)
    gcp.release("Svc.One")
    assert sorted(r["name"] for r in gce.firewall_rules()) == sorted([gcp.firewall_name, gcp.service_tag("Svc.One")])


def test_ssh_sources_follow_gateway_cidrs_and_the_address_replicas_are_dialled_at(gce, caplog):
    def sources(**config):
        backend = GCPBackend(GCPConfig(project_id="proj", endpoint=gce.url, **config))
        backend.ensure_firewall()
        (rule,) = [r for r in gce.firewall_rules() if r["name"] == backend.firewall_name]
        return rule["sourceRanges"]

    assert sources() == ["0.0.0.0/0"]  # external IPs, dialled from wherever the gateway runs
    assert "backends.gcp.gateway_cidrs" in caplog.text
    assert sources(public_ip=False) == ["10.0.0.0/8"]  # brought to the new sources (patched)
    assert sources(gateway_cidrs=["203.0.113.7/32"]) == ["203.0.113.7/32"]


def test_service_tags_keep_gce_rules_and_tell_services_apart(gce):
    backend = GCPBackend(GCPConfig(project_id="proj", endpoint=gce.url), installation="h" + "x" * 30)
    long, alike = "A" * 80 + ".Service", ["a.b", "a-b"]
    for name in [long, "x", *alike]:
        for tag in (backend.service_tag(name), backend.gateway_rule(name)):
            assert len(tag) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", tag) and backend.installation in tag
    assert backend.service_tag(alike[0]) != backend.service_tag(alike[1])
    assert backend.service_tag(long) != backend.service_tag(long + "2")
    assert backend.service_tag("x") != backend.network_tag and backend.service_tag("ssh") != backend.firewall_name
    backend.ensure_service_firewall(long, 8000)  # the fake refuses names and tags GCE would
    assert [r["name"] for r in gce.firewall_rules()] == [backend.service_tag(long)]


def test_a_zone_without_the_type_moves_to_the_next_zone_then_the_next_offer(gcp, ledger, gce):
    # The catalog can be out of date: Compute refuses a zone that does not exist or lacks the machine type.
    stale = offer("g2-standard-4", 0.70, gpu=("L4", 24.0, 1), zones=["us-central1-z", "us-central1-a"])
    chosen, inst = walk(gcp, ledger, [stale])
    assert inst.zone == "us-central1-a"
    nowhere = offer("a9-imaginary-1g", 0.10, gpu=("L4", 24.0, 1), zones=["us-central1-a"])
    chosen, inst = walk(gcp, ledger, [nowhere, G2], j=job(1))
    assert chosen.instance_type == "g2-standard-4"


@pytest.mark.parametrize("status,reason,message", [
    (404, "notFound", "The resource 'projects/proj/zones/us-central1-a/acceleratorTypes/nvidia-tesla-t4' was not "
                      "found"),
    (400, "invalid", "Network profile only allows resource creation in location us-central1-b.")])
def test_a_zone_the_insert_cannot_use_moves_to_the_next_zone(gcp, ledger, gce, status, reason, message):
    gce.fail("http", zone="us-central1-a", status=status, reason=reason, message=message)
    _, inst = walk(gcp, ledger, [N1_T4])
    assert inst.zone == "us-central1-b"


def test_a_spot_quota_leaves_on_demand_in_the_region_open(gcp, ledger, gce):
    gce.fail("quota", zone="us-central1-a",
             message="Quota 'PREEMPTIBLE_NVIDIA_T4_GPUS' exceeded.  Limit: 0.0 in region us-central1.")
    spot_g2 = offer("g2-standard-4", 0.25, gpu=("L4", 24.0, 1), spot=True)
    chosen, _ = walk(gcp, ledger, [N1_T4_SPOT, spot_g2, N1_T4])
    assert (chosen.instance_type, chosen.spot) == ("n1-standard-4", False)
    assert len(gce.inserts()) == 2  # the spot g2 in us-central1 skipped


def test_two_control_planes_share_a_project_without_touching_each_other(gcp, ledger, gce):
    laptop, cluster = (GCPBackend(gcp.config, installation=i) for i in ("h-laptop", "t-cluster"))
    old = walk(gcp, ledger, [G2], j=job(5))[1]  # from before installations were labelled
    _, mine = walk(laptop, ledger, [G2])
    _, theirs = walk(cluster, ledger, [G2])  # the same replica and offer: another name, not adopted on 409
    assert mine.instance_id != theirs.instance_id
    assert {i["name"]: i["labels"].get("durastack-installation") for i in gce.all_instances()} == {
        old.instance_id: None, mine.instance_id: "h-laptop", theirs.instance_id: "t-cluster"}
    assert {i.instance_id for i in laptop.list_tagged()} == {mine.instance_id, old.instance_id}
    assert [i.instance_id for i in cluster.find_replica(job())] == [theirs.instance_id]
    assert terminate_service({"gcp": laptop}, "Svc.One", ledger=ledger) == 2
    assert [i["name"] for i in gce.all_instances()] == [theirs.instance_id]


def test_operation_polling_never_leaves_the_configured_endpoint(gcp, gce):
    gce.op_polls = 3  # the insert operation stays RUNNING for a while
    gcp.create(job(), G2, provisioning_key("Svc.One", "llm", 0, 0, G2))
    waits = [r for r in gce.requests if r["path"].endswith("/wait")]
    assert waits, "operation was not polled through our own ZoneOperationsClient"


def test_make_backends_with_an_http_endpoint_uses_anonymous_credentials(gce):
    backends = make_backends(BackendsConfig(gcp=GCPConfig(project_id="proj", endpoint=gce.url)), catalog=[G2, G2_EAST])
    assert backends["gcp"].regions == ["us-central1", "us-east1"]
    assert backends["gcp"].list_tagged() == []


# --- the replica activities on GCP: launch, teardown ----------------------------------------------

async def test_launch_on_gcp_registers_a_retry_adopts_the_instance_and_teardown_deletes_it(gcp, ledger, gce):
    server, address = await app_server()
    gateway, client = FakeGateway(), FakeClient()
    config = BackendsConfig(gcp=GCPConfig(project_id="proj", regions=gcp.regions, endpoint=gce.url))
    cloud = CloudReplicas(config, {"gcp": gcp}, ledger, catalog=[N1_T4, G2], address=lambda _: address,
                          poll_seconds=0.1, gateway=gateway)
    acts = ReplicaActivities(None, gateway, cloud=cloud, quick_seconds=0)  # the fake places in milliseconds
    inp = LaunchInput(backend="gcp", replica=ReplicaInput(service_workflow_id="service/Svc.One", job=job(),
                                                          resources=GPU, backends=["gcp"]))
    async with server:
        first = await activity_env(client).run(acts.launch, inp)
        again = await activity_env(client).run(acts.launch, inp)  # its first result was lost
    assert first.instance.kind == "cloud" and first.instance.backend == "gcp"
    assert again.instance.instance_id == first.instance.instance_id
    assert [i.instance_id for i in gcp.list_tagged() if i.state != "terminated"] == [first.instance.instance_id]
    assert gateway.routed == {job().replica_id: address}

    await activity_env(client).run(acts.teardown, TeardownInput(
        service_workflow_id="service/Svc.One", job=job(), backend="gcp", instance=first.instance, reason="stopped"))
    assert [i for i in gcp.list_tagged() if i.state != "terminated"] == [] and gateway.routed == {}
    assert [u.seq for _, _, u in client.signals] == [1, 2, 3, 1, 2, 3, 10, 11]


# --- reservations ---------------------------------------------------------------------------------

N1_V100 = offer("n1-standard-4", 2.67, zones=CENTRAL, gpu=("V100", 16.0, 1))


def reserved(backend, value: str, offers=(N1_T4, N1_T4_SPOT, N1_V100, G2)):
    return match_offers(list(offers), GPU, spot_policy="auto", reservation=backend.find_reservation(value))


def test_a_reservation_takes_its_machine_and_accelerators_on_demand_in_its_zones(gcp, ledger, gce):
    gce.add_reservation("proj", "us-central1-b", "t4-pool", "n1-standard-4", count=2,
                        accelerators={"nvidia-tesla-t4": 1})
    gce.add_reservation("proj", "us-east1-c", "t4-pool", "n1-standard-8", accelerators={"nvidia-tesla-t4": 1})
    # Not the spot price, not the V100 on the same machine type, not the L4 machine: the T4 one, in the zone.
    kept = reserved(gcp, "t4-pool")
    assert [(o.instance_type, o.gpu_name, o.spot, o.zones, o.reservation) for o in kept] == \
        [("n1-standard-4", "T4", False, ["us-central1-b"], "t4-pool")]

    _, inst = walk(gcp, ledger, kept)
    (insert,) = gce.inserts()
    assert insert["path"].endswith("/zones/us-central1-b/instances")
    assert insert["body"]["reservationAffinity"] == {
        "consumeReservationType": "SPECIFIC_RESERVATION", "key": "compute.googleapis.com/reservation-name",
        "values": ["projects/proj/reservations/t4-pool"]}
    assert insert["body"]["scheduling"]["provisioningModel"] == "STANDARD"
    assert inst.zone == "us-central1-b" and not inst.spot
    assert gce.reservation("proj", "us-central1-b", "t4-pool")["specificReservation"]["inUseCount"] == "1"
    terminate_cloud(inst, backends={"gcp": gcp})
    assert gce.reservation("proj", "us-central1-b", "t4-pool")["specificReservation"]["inUseCount"] == "0"


def test_a_reservation_shared_from_another_project_is_named_with_it(gcp, ledger, gce):
    gce.add_reservation("owner-proj", "us-central1-a", "shared", "g2-standard-4")
    assert gcp.find_reservation("shared").found == []  # not in the backend's own project
    kept = reserved(gcp, "projects/owner-proj/reservations/shared")
    assert [(o.instance_type, o.zones) for o in kept] == [("g2-standard-4", ["us-central1-a"])]
    walk(gcp, ledger, kept)
    assert gce.inserts()[0]["body"]["reservationAffinity"]["values"] == ["projects/owner-proj/reservations/shared"]
    assert gce.reservation("owner-proj", "us-central1-a", "shared")["specificReservation"]["inUseCount"] == "1"


def test_a_full_reservation_in_one_zone_moves_to_the_next_zone_that_has_one(gcp, ledger, gce):
    for zone in ("us-central1-a", "us-central1-b"):
        gce.add_reservation("proj", zone, "l4", "g2-standard-4")
    kept = reserved(gcp, "l4")
    assert kept[0].zones == ["us-central1-a", "us-central1-b"]
    walk(gcp, ledger, kept)
    _, second = walk(gcp, ledger, kept, job(replica=1))  # us-central1-a is full now
    assert second.zone == "us-central1-b"
    with pytest.raises(OffersExhausted) as full:
        walk(gcp, ledger, kept, job(replica=2))
    (reason,) = full.value.reasons
    assert "CONDITION_NOT_MET: Specified reservation 'projects/proj/reservations/l4' does not have available " \
           "resources for the request." in reason


@pytest.mark.parametrize("status,specific,why", [
    ("CREATING", True, "it is CREATING, not READY"),
    ("READY", False, "it does not require specific targeting (specificReservationRequired is false), so no VM can "
                     "target it by name")])
def test_a_reservation_no_vm_can_target_now_leaves_no_offer_and_says_why(gcp, gce, status, specific, why):
    gce.add_reservation("proj", "us-central1-a", "l4", "g2-standard-4", status=status, specific=specific)
    lookup = gcp.find_reservation("l4")
    assert not match_offers([G2], GPU, reservation=lookup)
    assert describe_mismatch([G2], GPU, reservation=lookup) == \
        f"no offer has reservation l4 open to launches (us-central1-a: {why})"


def test_the_fake_refuses_what_compute_refuses_for_a_reservation(gcp, ledger, gce):
    gce.add_reservation("proj", "us-central1-a", "l4", "g2-standard-4")
    gce.add_reservation("proj", "us-central1-b", "t4", "n1-standard-4", accelerators={"nvidia-tesla-t4": 1})
    gce.add_reservation("proj", "us-central1-c", "creating", "g2-standard-4", status="CREATING")
    gce.add_reservation("proj", "us-central1-a", "automatic", "g2-standard-4", specific=False)

    def refused(offer_: InstanceOffer, name: str) -> CloudError:
        marked = offer_.model_copy(update={"reservation": name})
        with pytest.raises(CloudError) as e:
            gcp.create(job(), marked, provisioning_key("Svc.One", "llm", 0, 0, marked))
        return e.value

    gone = refused(G2.model_copy(update={"zones": ["us-central1-b"]}), "l4")  # no l4 in that zone
    assert gone.kind is ErrorKind.CAPACITY and gone.code == "CONDITION_NOT_MET"
    assert "Specified reservation 'projects/proj/reservations/l4' does not exist." in gone.message
    other = refused(N1_V100.model_copy(update={"zones": ["us-central1-b"]}), "t4")  # a V100 VM, T4 reserved
    assert "No available resources in specified reservations 'projects/proj/reservations/t4'" in other.message
    not_ready = refused(G2.model_copy(update={"zones": ["us-central1-c"]}), "creating")
    assert "status: CREATING, as it requires reservation to be in READY state" in not_ready.message
    automatic = refused(G2.model_copy(update={"zones": ["us-central1-a"]}), "automatic")
    assert automatic.code == "invalid" and "[projects/proj/reservations/automatic] can not be targeted" in \
        automatic.message
    assert gce.all_instances() == []


async def test_launch_into_a_reservation_on_gcp_and_one_no_project_has(gcp, ledger, gce):
    server, address = await app_server()
    gce.add_reservation("proj", "us-central1-c", "l4", "g2-standard-4")
    config = BackendsConfig(gcp=GCPConfig(project_id="proj", regions=gcp.regions, endpoint=gce.url))
    cloud = CloudReplicas(config, {"gcp": gcp}, ledger, catalog=[N1_T4, G2], address=lambda _: address,
                          poll_seconds=0.1)
    acts = ReplicaActivities(None, FakeGateway(), cloud=cloud, quick_seconds=0)

    def launch(j: JobSpec, reservation: str) -> LaunchInput:
        return LaunchInput(backend="gcp", replica=ReplicaInput(
            service_workflow_id="service/Svc.One", job=j, resources=GPU, backends=["gcp"], reservation=reservation,
            regions=["us-central1"]))

    async with server:
        launched = await activity_env(FakeClient()).run(acts.launch, launch(job(), "l4"))
    assert (launched.placement.instance_type, launched.instance.zone) == ("g2-standard-4", "us-central1-c")
    with pytest.raises(ApplicationError) as failed:
        await activity_env(FakeClient()).run(acts.launch, launch(job(replica=1), "nowhere"))
    assert refusal_of(failed.value).reasons == [
        "no offer has reservation nowhere (gcp: no reservation nowhere in project proj (us-central1))"]
