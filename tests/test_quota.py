"""Quotas: offers the account cannot launch are marked and never tried (backends/quota.py).

The rule alone; its per-region cache (TTL, a failed read said once); then against moto (Service Quotas, behind the
fault middleware, which answers EC2's vCPU quotas as AWS does) and the fake Compute server (regions.get): a
zero-quota class is skipped without a launch call while other offers launch; an unreadable quota API blocks
nothing; and ``durastack offers`` shows the mark.
"""

from __future__ import annotations

import json
import logging

import boto3
import pytest
from botocore.exceptions import ClientError
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1
from typer.testing import CliRunner

from activities.cloud import OffersExhausted, provision_cloud
from backends.aws import AWSBackend
from backends.gcp import GCPBackend
from backends.quota import QUOTA_TTL, RegionQuotas, aws_vcpu_quota, gcp_gpu_quota, verdict
from cli.main import app
from models.backends import AWSConfig, GCPConfig
from models.offers import InstanceOffer
from models.replica import JobSpec
from models.resources import ResourcesSpec
from store import Store, StoreLedger
from tests.fakes.ec2_faults import ec2_server, fake_ec2  # noqa: F401  (fixtures)
from tests.fakes.gce import gce  # noqa: F401  (fixture)

GPU = ResourcesSpec.model_validate({"gpu": "1..", "disk": "150GB"})
G_ON_DEMAND, G_SPOT, P_SPOT, STANDARD = "L-DB2E81BA", "L-3819A6DF", "L-7212CCBC", "L-1216C47A"


def offer(instance_type: str, *, backend="aws", region="us-east-1", cpus=4, gpu=("A10G", 24.0, 1), spot=False,
          price=1.0, zones=None) -> InstanceOffer:
    name, mem, count = gpu or (None, 0.0, 0)
    return InstanceOffer(backend=backend, instance_type=instance_type, region=region,
                         zones=zones if zones is not None else [f"{region}a"], cpus=cpus, memory_gb=16.0,
                         gpu_vendor="nvidia" if gpu else None, gpu_name=name, gpu_memory_gb=mem, gpu_count=count,
                         spot=spot, price=price)


def job(replica=0) -> JobSpec:
    return JobSpec(service="svc", group="llm", replica_num=replica, submission_num=0, port=8000,
                   commands=["vllm serve Qwen/Qwen2.5-0.5B --port 8000"])


@pytest.fixture
def ledger(tmp_path):
    return StoreLedger(Store(f"sqlite:///{tmp_path}/store.db"))


# --- the rule -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("instance_type,spot,code", [
    ("g5.xlarge", False, G_ON_DEMAND), ("g4dn.xlarge", True, G_SPOT), ("gr6.4xlarge", False, G_ON_DEMAND),
    ("p4d.24xlarge", False, "L-417A185B"), ("p5.48xlarge", False, "L-417A185B"), ("p4d.24xlarge", True, P_SPOT),
    ("p5.48xlarge", True, None),  # spot P5 has a quota of its own in one AWS documentation version: unknown
    ("m7i.xlarge", False, STANDARD), ("t3.large", True, "L-34B43A08"), ("c5.xlarge", False, STANDARD),
    ("inf2.xlarge", False, None), ("trn1.2xlarge", False, None), ("x2idn.16xlarge", False, None)])
def test_aws_quota_code_by_class_and_market(instance_type, spot, code):
    assert aws_vcpu_quota(offer(instance_type, spot=spot)) == code


def test_aws_offer_lacks_quota_below_its_vcpus_and_fits_at_them():
    g5 = offer("g5.2xlarge", cpus=8)
    assert verdict(g5, {G_ON_DEMAND: 0.0}).status == "no quota"
    assert verdict(g5, {G_ON_DEMAND: 4.0}) == (
        "no quota", "Running On-Demand G and VT instances (L-DB2E81BA) is 4 vCPUs in us-east-1; g5.2xlarge needs 8")
    assert verdict(g5, {G_ON_DEMAND: 8.0}).status == "ok"
    assert verdict(offer("g5.2xlarge", cpus=8, spot=True), {G_ON_DEMAND: 0.0, G_SPOT: 8.0}).status == "ok"


def test_what_is_not_known_is_unknown_never_no():
    assert verdict(offer("g5.xlarge"), None).status == "unknown"  # not read
    assert verdict(offer("g5.xlarge"), {STANDARD: 0.0}).status == "unknown"  # its code not listed
    assert verdict(offer("inf2.xlarge", gpu=None), {STANDARD: 0.0}).status == "unknown"  # no known quota
    assert verdict(offer("local", backend="local", region="local"), {}).status == "unknown"


def gcp_offer(instance_type, gpu=("L4", 24.0, 1), spot=False, cpus=4) -> InstanceOffer:
    return offer(instance_type, backend="gcp", region="us-central1", gpu=gpu, spot=spot, cpus=cpus)


def test_gcp_gpu_quota_per_model():
    assert gcp_gpu_quota(gcp_offer("g2-standard-4")) == "NVIDIA_L4_GPUS"
    assert gcp_gpu_quota(gcp_offer("a2-ultragpu-1g", gpu=("A100", 80.0, 1))) == "NVIDIA_A100_80GB_GPUS"
    assert gcp_gpu_quota(gcp_offer("a2-highgpu-1g", gpu=("A100", 40.0, 1))) == "NVIDIA_A100_GPUS"
    assert gcp_gpu_quota(gcp_offer("a3-highgpu-8g", gpu=("H100", 80.0, 8))) == "NVIDIA_H100_GPUS"
    assert gcp_gpu_quota(gcp_offer("n2-standard-4", gpu=None)) is None


def test_gcp_gpu_count_against_the_model_quota():
    g2 = gcp_offer("g2-standard-24", gpu=("L4", 24.0, 2))
    assert verdict(g2, {"NVIDIA_L4_GPUS": 1.0}) == (
        "no quota", "NVIDIA_L4_GPUS is 1 GPUs in us-central1; g2-standard-24 needs 2")
    assert verdict(g2, {"NVIDIA_L4_GPUS": 2.0}).status == "ok"


def test_gcp_spot_draws_on_the_preemptible_quota_else_the_standard_one():
    spot = gcp_offer("g2-standard-4", spot=True)
    assert verdict(spot, {"PREEMPTIBLE_NVIDIA_L4_GPUS": 0.0, "NVIDIA_L4_GPUS": 4.0}).status == "ok"
    assert verdict(spot, {"PREEMPTIBLE_NVIDIA_L4_GPUS": 1.0, "NVIDIA_L4_GPUS": 0.0}).status == "ok"
    assert verdict(spot, {"PREEMPTIBLE_NVIDIA_L4_GPUS": 0.0, "NVIDIA_L4_GPUS": 0.0}).status == "no quota"
    assert verdict(spot, {"NVIDIA_L4_GPUS": 0.0}).status == "unknown"  # PREEMPTIBLE_* not listed


def test_gcp_cpu_quota_of_the_family():
    n1 = gcp_offer("n1-standard-96", gpu=None, cpus=96)
    assert verdict(n1, {"CPUS": 24.0}) == ("no quota", "CPUS is 24 vCPUs in us-central1; n1-standard-96 needs 96")
    n2 = gcp_offer("n2-standard-32", gpu=None, cpus=32)
    assert verdict(n2, {"CPUS": 0.0, "N2_CPUS": 32.0}).status == "ok"  # N2 has its own quota
    assert verdict(n2, {"CPUS": 0.0}).status == "unknown"  # N2_CPUS not listed: not known to use CPUS
    g2 = gcp_offer("g2-standard-4")
    assert verdict(g2, {"NVIDIA_L4_GPUS": 1.0, "CPUS": 0.0}).status == "ok"  # G2 is not known to use CPUS


# --- the cache --------------------------------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_region_is_read_once_per_ttl():
    reads, clock = [], Clock()
    quotas = RegionQuotas("aws", lambda region: reads.append(region) or {G_ON_DEMAND: 0.0}, clock=clock)
    assert QUOTA_TTL == 600.0 and quotas.ttl == QUOTA_TTL
    for _ in range(3):
        assert quotas.verdict(offer("g5.xlarge")).status == "no quota"
    quotas.verdict(offer("g5.xlarge", region="us-west-2"))
    assert reads == ["us-east-1", "us-west-2"]
    clock.now = QUOTA_TTL - 1
    quotas.limits("us-east-1")
    assert reads == ["us-east-1", "us-west-2"]
    clock.now = QUOTA_TTL
    quotas.limits("us-east-1")
    assert reads == ["us-east-1", "us-west-2", "us-east-1"]


def test_a_failed_read_is_unknown_kept_and_said_once(caplog):
    from backends.cloud_errors import CloudError, ErrorKind

    reads = []

    def denied(region):
        reads.append(region)
        raise CloudError(ErrorKind.FATAL, f"GetServiceQuota in {region}: AccessDeniedException: not authorized",
                         code="AccessDeniedException")

    quotas = RegionQuotas("aws", denied)
    with caplog.at_level(logging.WARNING, logger="durastack.quota"):
        for region in ("us-east-1", "us-east-1", "us-west-2"):
            assert quotas.verdict(offer("g5.xlarge", region=region)).status == "unknown"
    assert reads == ["us-east-1", "us-west-2"]
    said = [r.getMessage() for r in caplog.records if r.name == "durastack.quota"]
    assert len(said) == 1 and "AccessDeniedException" in said[0] and "tried" in said[0]
    assert "AccessDeniedException" in quotas.failure("us-west-2")


# --- AWS: Service Quotas on moto ---------------------------------------------------------------------------------

def test_the_fake_answers_get_service_quota_as_aws_does(fake_ec2):
    quotas = boto3.client("service-quotas", region_name="us-east-1")
    fake_ec2.set_quota("us-east-1", G_ON_DEMAND, 8.0)
    got = quotas.get_service_quota(ServiceCode="ec2", QuotaCode=G_ON_DEMAND)["Quota"]
    assert (got["QuotaName"], got["Value"], got["UsageMetric"]["MetricDimensions"]["Class"]) == (
        "Running On-Demand G and VT instances", 8.0, "G/OnDemand")
    assert got["QuotaArn"].startswith("arn:aws:servicequotas:us-east-1:")
    other = boto3.client("service-quotas", region_name="us-west-2")
    assert other.get_service_quota(ServiceCode="ec2", QuotaCode=G_ON_DEMAND)["Quota"]["Value"] == 2048.0
    with pytest.raises(ClientError) as missing:
        quotas.get_service_quota(ServiceCode="ec2", QuotaCode="L-00000000")
    assert missing.value.response["Error"]["Code"] == "NoSuchResourceException"
    fake_ec2.deny_quotas()
    with pytest.raises(ClientError) as denied:
        quotas.get_service_quota(ServiceCode="ec2", QuotaCode=G_ON_DEMAND)
    assert denied.value.response["Error"]["Code"] == "AccessDeniedException"
    assert "servicequotas:GetServiceQuota" in denied.value.response["Error"]["Message"]


@pytest.fixture
def aws(fake_ec2):
    fake_ec2.seed_amis("us-east-1", "us-west-2")
    return AWSBackend(AWSConfig(regions=["us-east-1", "us-west-2"], ami_owners=["self"],
                                gateway_cidrs=["203.0.113.7/32"]))


G5 = offer("g5.xlarge", price=1.006)
G5_WEST = offer("g5.xlarge", region="us-west-2", price=1.1)
M5 = offer("m5.xlarge", gpu=None, price=0.192)


def launched(fake_ec2) -> list[tuple[str, str]]:
    return [(r["region"], r["InstanceType"]) for r in fake_ec2.run_requests]


def test_a_zero_quota_class_is_never_attempted_while_other_offers_launch(aws, ledger, fake_ec2):
    fake_ec2.set_quota("us-east-1", G_ON_DEMAND, 0.0)
    chosen, _ = provision_cloud(job(0), GPU, [G5, G5_WEST], backends={"aws": aws}, ledger=ledger,
                                max_offers=1)  # the skipped offer does not use up the one attempt
    assert (chosen.instance_type, chosen.region) == ("g5.xlarge", "us-west-2")
    cpu = ResourcesSpec.model_validate({"cpu": "4", "memory": "16GB"})
    chosen, _ = provision_cloud(job(1), cpu, [M5], backends={"aws": aws}, ledger=ledger)  # Standard: its own quota
    assert chosen.region == "us-east-1"
    assert launched(fake_ec2) == [("us-west-2", "g5.xlarge"), ("us-east-1", "m5.xlarge")]
    assert sorted(fake_ec2.quota_reads) == sorted((r, c) for r in ("us-east-1", "us-west-2")
                                                  for c in ("L-417A185B", G_ON_DEMAND, STANDARD, P_SPOT, G_SPOT,
                                                            "L-34B43A08"))  # six codes, once per region


def test_all_offers_without_quota_fail_saying_so_with_no_launch(aws, ledger, fake_ec2):
    for region in ("us-east-1", "us-west-2"):
        fake_ec2.set_quota(region, G_ON_DEMAND, 2.0)
    with pytest.raises(OffersExhausted) as e:
        provision_cloud(job(), GPU, [G5, G5_WEST], backends={"aws": aws}, ledger=ledger)
    assert e.value.reasons == [
        f"aws g5.xlarge in {r} (${p:g}/h): skipped, no quota: Running On-Demand G and VT instances (L-DB2E81BA) "
        f"is 2 vCPUs in {r}; g5.xlarge needs 4" for r, p in (("us-east-1", 1.006), ("us-west-2", 1.1))]
    assert launched(fake_ec2) == [] and ledger.entries() == []


def test_quotas_that_cannot_be_read_block_nothing_and_are_said_once(aws, ledger, fake_ec2, caplog):
    fake_ec2.deny_quotas()
    with caplog.at_level(logging.WARNING, logger="durastack.quota"):
        chosen, _ = provision_cloud(job(0), GPU, [G5], backends={"aws": aws}, ledger=ledger)
        provision_cloud(job(1), GPU, [G5_WEST], backends={"aws": aws}, ledger=ledger)
    assert chosen.region == "us-east-1"
    assert launched(fake_ec2) == [("us-east-1", "g5.xlarge"), ("us-west-2", "g5.xlarge")]
    said = [r.getMessage() for r in caplog.records if r.name == "durastack.quota"]
    assert len(said) == 1 and "AccessDeniedException" in said[0]
    assert fake_ec2.quota_reads == [("us-east-1", "L-417A185B"), ("us-west-2", "L-417A185B")]  # stops at the denial


# --- GCP: regions.get on the fake Compute server ---------------------------------------------------------------

CENTRAL = ["us-central1-a", "us-central1-b", "us-central1-c"]
G2 = offer("g2-standard-4", backend="gcp", region="us-central1", gpu=("L4", 24.0, 1), price=0.71,
           zones=["us-central1-a"])
G2_EAST = offer("g2-standard-4", backend="gcp", region="us-east1", gpu=("L4", 24.0, 1), price=0.72,
                zones=["us-east1-b"])
N1_T4_SPOT = offer("n1-standard-4", backend="gcp", region="us-central1", gpu=("T4", 16.0, 1), spot=True,
                   price=0.18, zones=CENTRAL)


@pytest.fixture
def gcp(gce):
    return GCPBackend(GCPConfig(project_id="proj", regions=["us-central1", "us-east1"], endpoint=gce.url))


def inserted(gce) -> list[str]:
    return [r["path"].split("/zones/")[1].split("/")[0] for r in gce.inserts()]


def test_the_fake_region_lists_its_quotas_as_compute_does(gce):
    gce.set_quota("us-central1", "NVIDIA_L4_GPUS", 2.0, usage=1.0)
    region = compute_v1.RegionsClient(credentials=AnonymousCredentials(), transport="rest",
                                      client_options={"api_endpoint": gce.url}).get(project="proj",
                                                                                     region="us-central1")
    quotas = {q.metric: (q.limit, q.usage) for q in region.quotas}
    assert quotas["NVIDIA_L4_GPUS"] == (2.0, 1.0) and "CPUS" in quotas and region.status == "UP"
    assert region.zones[0].endswith("/zones/us-central1-a")


def test_gcp_zero_gpu_quota_is_never_inserted_while_other_offers_launch(gcp, ledger, gce):
    gce.set_quota("us-central1", "NVIDIA_L4_GPUS", 0.0)
    chosen, inst = provision_cloud(job(0), GPU, [G2, G2_EAST], backends={"gcp": gcp}, ledger=ledger)
    assert (chosen.region, inst.zone) == ("us-east1", "us-east1-b")
    assert inserted(gce) == ["us-east1-b"]
    provision_cloud(job(1), GPU, [G2, G2_EAST], backends={"gcp": gcp}, ledger=ledger)
    assert sorted(gce.region_reads()) == ["us-central1", "us-east1"]  # cached across walks


def test_gcp_spot_is_skipped_only_when_neither_quota_has_room(gcp, ledger, gce):
    gce.set_quota("us-central1", "NVIDIA_T4_GPUS", 0.0)  # and PREEMPTIBLE_NVIDIA_T4_GPUS is 0 by default
    gcp.quotas.ttl = 0  # each walk reads them again
    with pytest.raises(OffersExhausted) as e:
        provision_cloud(job(0), GPU, [N1_T4_SPOT], backends={"gcp": gcp}, ledger=ledger)
    assert "skipped, no quota: PREEMPTIBLE_NVIDIA_T4_GPUS is 0 and NVIDIA_T4_GPUS is 0 GPUs" in e.value.reasons[0]
    assert inserted(gce) == []
    gce.set_quota("us-central1", "PREEMPTIBLE_NVIDIA_T4_GPUS", 4.0)
    chosen, _ = provision_cloud(job(1), GPU, [N1_T4_SPOT], backends={"gcp": gcp}, ledger=ledger)
    assert chosen.spot and inserted(gce) == ["us-central1-a"]


def test_gcp_regions_get_refused_blocks_nothing(gcp, ledger, gce):
    gce.set_quota("us-central1", "NVIDIA_L4_GPUS", 0.0)
    gce.refuse_regions(403, "forbidden")
    chosen, _ = provision_cloud(job(), GPU, [G2], backends={"gcp": gcp}, ledger=ledger)
    assert chosen.region == "us-central1" and inserted(gce) == ["us-central1-a"]
    assert "compute.regions.get" in gcp.quotas.failure("us-central1")


# --- durastack offers ------------------------------------------------------------------------------------------

def offers_cli(home, *args: str):
    return CliRunner().invoke(app, ["offers", "--gpu", "A10G", "--backend", "aws", "--region", "us-east-1",
                                    "--region", "us-west-2", "--limit", "0", *args],
                              env={"COLUMNS": "220", "DURASTACK_HOME": str(home)})


@pytest.fixture
def aws_home(tmp_path, fake_ec2):
    (tmp_path / "config.yml").write_text("backends:\n  aws:\n    regions: [us-east-1, us-west-2]\n")
    return tmp_path


def test_offers_marks_those_without_quota(aws_home, fake_ec2):
    fake_ec2.set_quota("us-east-1", G_ON_DEMAND, 0.0)
    result = offers_cli(aws_home)
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.stdout.splitlines() if " g5." in line]
    assert "QUOTA" in result.stdout and rows
    east = [row for row in rows if row[2] == "us-east-1"]
    west = [row for row in rows if row[2] == "us-west-2"]
    assert east and all(row[-2:] == ["no", "quota"] for row in east)
    assert west and all(row[-1] == "ok" for row in west)
    assert "no quota: Running On-Demand G and VT instances (L-DB2E81BA) is 0 vCPUs in us-east-1; g5.xlarge " \
           "needs 4" in result.stdout
    data = json.loads(offers_cli(aws_home, "--json").stdout)
    [group] = data["groups"]
    marks = {(o["region"], o["instance_type"]): m["status"] for o, m in zip(group["offers"], group["quota"])}
    assert marks[("us-east-1", "g5.xlarge")] == "no quota" and marks[("us-west-2", "g5.xlarge")] == "ok"
    assert data["quota_notes"] == []


def test_offers_says_once_that_quotas_could_not_be_read(aws_home, fake_ec2):
    fake_ec2.deny_quotas()
    result = offers_cli(aws_home)
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stdout.splitlines() if line.startswith("quota: ")]
    assert len(notes) == 1 and "AccessDeniedException" in notes[0] and "tried" in notes[0]
    assert "no quota" not in result.stdout and " unknown" in result.stdout


def test_offers_without_a_configured_cloud_reads_no_quota(tmp_path, fake_ec2):
    result = offers_cli(tmp_path)
    assert result.exit_code == 0 and "QUOTA" not in result.stdout and fake_ec2.quota_reads == []


def test_apply_plans_on_the_offers_a_launch_would_try(aws_home, fake_ec2, tmp_path):
    """The plan's offer is one the walk would try: us-east-1's G quota is 0, so the plan names us-west-2; with no
    G quota anywhere nothing is submitted, and the plan says why."""
    service = tmp_path / "svc.yml"
    service.write_text("type: service\nname: svc\nport: 8000\nimage: vllm/vllm-openai\nbackends: [aws]\n"
                       "resources:\n  gpu: A10G\n")
    env = {"COLUMNS": "220", "DURASTACK_HOME": str(aws_home), "DURASTACK_TEMPORAL_ADDRESS": "127.0.0.1:9"}
    fake_ec2.set_quota("us-east-1", G_ON_DEMAND, 0.0)
    result = CliRunner().invoke(app, ["apply", "-f", str(service), "-y"], env=env)
    (plan,) = [line for line in result.stdout.splitlines() if "group=0" in line]
    assert "(us-west-2)" in plan, result.stdout
    fake_ec2.set_quota("us-west-2", G_ON_DEMAND, 0.0)
    result = CliRunner().invoke(app, ["apply", "-f", str(service), "-y"], env=env)
    assert result.exit_code != 0
    said = " ".join((result.stdout + result.stderr).split())
    assert "nothing was submitted: group 0: no offers (no quota for any: aws g5.xlarge in us-" in said, said
