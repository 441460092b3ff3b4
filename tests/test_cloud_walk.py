"""The offer walker, the ledger, provisioning keys, error classes and the backends config — no cloud needed.

Backends here are in-memory fakes with scripted errors; tests/test_aws.py and tests/test_gcp.py run the same
walker against moto and the fake Compute server.
"""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from temporalio.testing import ActivityEnvironment

from activities.cloud import (OffersExhausted, activity_error, cloud_offers, heartbeat_from_thread, placement_of,
                             provision_cloud, terminate_cloud, terminate_replica)
from backends.cloud_errors import CloudError, ErrorKind, QuotaScope, aws_quota_class, classify_aws, classify_gcp
from connect.installation import installation_id
from models.backends import (INSTALLATION_PATTERN, TAG_NAMES, AWSConfig, BackendsConfig, CloudInstance, GCPConfig,
                             backends_config_from, load_backends_config, owner, provisioning_key, replica_label)
from models.offers import InstanceOffer
from models.replica import JobSpec
from models.resources import ResourcesSpec
from store import Store, StoreLedger

ANY = ResourcesSpec.model_validate({"cpu": "1..", "memory": "1GB.."})
JOB = JobSpec(service="svc", group="g", replica_num=1, submission_num=0, port=8000)


def offer(instance_type: str, price: float, backend="aws", region="us-east-1", spot=False, gpu="A10G", count=1):
    return InstanceOffer(backend=backend, instance_type=instance_type, region=region, zones=[f"{region}-a"], cpus=4,
                         memory_gb=16, gpu_vendor="nvidia", gpu_name=gpu, gpu_memory_gb=24, gpu_count=count,
                         spot=spot, price=price)


class FakeBackend:
    installation = None

    def __init__(self, name: str, regions=(), errors: Optional[dict] = None):
        self.name, self.regions, self.errors = name, list(regions), errors or {}
        self.calls: list[tuple[str, str, bool]] = []
        self.instances: dict[str, CloudInstance] = {}

    def create(self, job, offer, key, *, nvcc=False):
        self.calls.append((offer.instance_type, offer.region, offer.spot))
        error = self.errors.get((offer.instance_type, offer.region)) or self.errors.get(offer.instance_type)
        if error is not None:
            raise error
        names = TAG_NAMES[self.name]
        svc, grp, rep = owner(self.name, job.service, job.group, job.replica_num, job.submission_num)
        inst = CloudInstance(backend=self.name, instance_id=f"id-{len(self.instances)}", region=offer.region,
                             instance_type=offer.instance_type, key=key, state="pending", spot=offer.spot,
                             price=offer.price, tags={names["service"]: svc, names["group"]: grp,
                                                      names["replica"]: rep, names["key"]: key})
        self.instances[key] = inst
        return inst

    def find_replica(self, job, regions=None):
        want = owner(self.name, job.service, job.group, job.replica_num, job.submission_num)
        return [i for i in self.instances.values() if i.owner == want and i.region in (regions or self.regions)]

    def list_tagged(self, regions=None, *, service=None):
        return list(self.instances.values())

    def get(self, instance):
        return self.instances.get(instance.key)

    def terminate(self, instance):
        self.instances.pop(instance.key, None)


def err(kind: ErrorKind, code: str, scope: Optional[QuotaScope] = None) -> CloudError:
    return CloudError(kind, f"{code}: scripted", code=code, scope=scope)


@pytest.fixture
def ledger(tmp_path):
    return StoreLedger(Store(f"sqlite:///{tmp_path}/store.db"))  # tests/test_store.py tests the ledger


def run(backends, offers, ledger, **kw):
    return provision_cloud(JOB, ANY, offers, backends=backends, ledger=ledger, **{"max_offers": 25, **kw})


# --- walking ----------------------------------------------------------------------------------------

def test_cheapest_first_and_next_offer_on_capacity(ledger):
    aws = FakeBackend("aws", ["us-east-1"], {"a": err(ErrorKind.CAPACITY, "InsufficientInstanceCapacity")})
    chosen, inst = run({"aws": aws}, [offer("c", 3.0), offer("a", 1.0), offer("b", 2.0)], ledger)
    assert chosen.instance_type == "b" and inst.key == provisioning_key("svc", "g", 1, 0, chosen)
    assert [c[0] for c in aws.calls] == ["a", "b"]


def test_max_offers_bounds_the_walk(ledger):
    aws = FakeBackend("aws", ["us-east-1"], {t: err(ErrorKind.CAPACITY, "X") for t in "abcd"})
    with pytest.raises(OffersExhausted, match=r"^all offers failed: "):
        run({"aws": aws}, [offer(t, i) for i, t in enumerate("abcd")], ledger, max_offers=2)
    assert [c[0] for c in aws.calls] == ["a", "b"]


def test_no_offers_on_configured_backends(ledger):
    with pytest.raises(OffersExhausted, match=r"^no offers: none of the 1 offers is on a configured cloud backend \(aws\)"):
        run({"aws": FakeBackend("aws", ["us-east-1"])}, [offer("x", 1, backend="gcp", region="us-central1")], ledger)
    with pytest.raises(OffersExhausted, match="none configured"):
        run({}, [offer("x", 1)], ledger)


def test_offers_outside_the_backends_regions_are_dropped():
    backends = {"aws": FakeBackend("aws", ["us-west-2"])}
    kept = cloud_offers([offer("a", 1), offer("b", 2, region="us-west-2")], ANY, backends)
    assert [o.instance_type for o in kept] == ["b"]


def test_quota_skips_the_region_and_class_but_not_others(ledger):
    east_g = QuotaScope(backend="aws", region="us-east-1", quota_class="on-demand:G")
    aws = FakeBackend("aws", ["us-east-1", "us-west-2"], {
        "g4dn.xlarge": err(ErrorKind.QUOTA, "VcpuLimitExceeded", east_g), "p4d.24xlarge": err(ErrorKind.CAPACITY, "X")})
    offers = [offer("g4dn.xlarge", 1), offer("g5.xlarge", 2), offer("g5.xlarge", 2.5, spot=True),
              offer("p4d.24xlarge", 3), offer("g5.xlarge", 4, region="us-west-2")]
    chosen, _ = run({"aws": aws}, offers, ledger)
    # g5 on-demand in us-east-1: skipped (same class); g5 spot: its own quota, tried.
    assert aws.calls == [("g4dn.xlarge", "us-east-1", False), ("g5.xlarge", "us-east-1", True)]
    assert chosen.spot


def test_spot_quota_skips_only_spot_offers(ledger):
    spot_scope = QuotaScope(backend="aws", region="us-east-1", spot_only=True)
    aws = FakeBackend("aws", ["us-east-1"], {"a": err(ErrorKind.QUOTA, "MaxSpotInstanceCountExceeded", spot_scope)})
    chosen, _ = run({"aws": aws}, [offer("a", 1, spot=True), offer("b", 2, spot=True), offer("c", 3)], ledger)
    assert chosen.instance_type == "c" and [c[0] for c in aws.calls] == ["a", "c"]


def test_quota_without_a_scope_skips_the_whole_region(ledger):
    gcp = FakeBackend("gcp", ["us-central1", "us-east1"], {"a": err(ErrorKind.QUOTA, "QUOTA_EXCEEDED")})
    offers = [offer("a", 1, "gcp", "us-central1"), offer("b", 2, "gcp", "us-central1"),
              offer("c", 3, "gcp", "us-east1")]
    assert run({"gcp": gcp}, offers, ledger)[0].instance_type == "c"
    assert [c[0] for c in gcp.calls] == ["a", "c"]


def test_all_offers_failed_names_every_reason(ledger):
    aws = FakeBackend("aws", ["us-east-1"], {"a": err(ErrorKind.QUOTA, "VcpuLimitExceeded"),
                                             "b": err(ErrorKind.CAPACITY, "InsufficientInstanceCapacity")})
    with pytest.raises(OffersExhausted) as e:
        run({"aws": aws}, [offer("a", 1), offer("b", 2, region="us-west-2")], ledger)
    aws.regions.append("us-west-2")
    with pytest.raises(OffersExhausted) as e:
        run({"aws": aws}, [offer("a", 1), offer("c", 1.5), offer("b", 2, region="us-west-2")], ledger)
    assert str(e.value) == (
        "all offers failed: aws a in us-east-1 ($1/h): VcpuLimitExceeded: scripted; "
        "aws c in us-east-1 ($1.5/h): skipped, quota exceeded for aws us-east-1 (all); "
        "aws b in us-west-2 ($2/h): InsufficientInstanceCapacity: scripted")


@pytest.mark.parametrize("kind", [ErrorKind.FATAL, ErrorKind.TRANSIENT])
def test_fatal_and_transient_errors_stop_the_walk(ledger, kind):
    aws = FakeBackend("aws", ["us-east-1"], {"a": err(kind, "Boom")})
    with pytest.raises(CloudError) as e:
        run({"aws": aws}, [offer("a", 1), offer("b", 2)], ledger)
    assert e.value.kind is kind and [c[0] for c in aws.calls] == ["a"]
    key = provisioning_key("svc", "g", 1, 0, offer("a", 1))
    assert ledger.entries(key)[-1]["phase"] == ("intent" if kind is ErrorKind.TRANSIENT else "failed")


def test_unresolved_key_is_retried_first_even_if_a_cheaper_offer_works_now(ledger):
    aws = FakeBackend("aws", ["us-east-1"], {"b": err(ErrorKind.TRANSIENT, "Timeout")})
    aws.errors["a"] = err(ErrorKind.CAPACITY, "X")
    with pytest.raises(CloudError):
        run({"aws": aws}, [offer("a", 1), offer("b", 2)], ledger)
    aws.errors.clear()
    chosen, _ = run({"aws": aws}, [offer("a", 1), offer("b", 2)], ledger)
    assert chosen.instance_type == "b" and [c[0] for c in aws.calls] == ["a", "b", "b"]


def test_an_instance_of_an_earlier_attempt_is_adopted_without_a_call(ledger):
    aws = FakeBackend("aws", ["us-east-1"])
    first_offer, first = run({"aws": aws}, [offer("b", 2)], ledger)
    chosen, again = run({"aws": aws}, [offer("a", 1), offer("b", 2)], ledger)
    assert again == first and chosen == first_offer and len(aws.calls) == 1
    assert ledger.entries(first.key)[-1]["data"]["adopted"] is True


def test_a_stopped_instance_of_an_earlier_attempt_is_not_adopted(ledger):
    aws = FakeBackend("aws", ["us-east-1"])
    _, first = run({"aws": aws}, [offer("b", 2)], ledger)
    aws.instances[first.key] = first.model_copy(update={"state": "stopped"})
    chosen, again = run({"aws": aws}, [offer("a", 1), offer("b", 2)], ledger)
    assert chosen.instance_type == "a" and again.key != first.key


def test_terminate_replica_without_a_record(ledger):
    aws = FakeBackend("aws", ["us-east-1"])
    run({"aws": aws}, [offer("a", 1)], ledger)
    other = JOB.model_copy(update={"replica_num": 2})
    provision_cloud(other, ANY, [offer("a", 1)], backends={"aws": aws}, ledger=ledger)
    assert terminate_replica(JOB, backends={"aws": aws}, ledger=ledger) == 1
    assert [i.owner for i in aws.instances.values()] == [("svc", "g", "r2-s0")]


def test_progress_heartbeats_from_the_worker_thread(ledger):
    beats: list = []
    env = ActivityEnvironment()
    env.on_heartbeat = lambda *details: beats.append(details)

    async def activity_body():
        progress = heartbeat_from_thread()
        await asyncio.to_thread(provision_cloud, JOB, ANY, [offer("a", 1)], backends={"aws": FakeBackend("aws")},
                                ledger=ledger, progress=progress)
        for _ in range(100):  # the callbacks run on this loop; give them their turns (bounded)
            if len(beats) >= 3:
                break
            await asyncio.sleep(0)

    asyncio.run(env.run(activity_body))
    assert beats == [("reading the quotas of the offers' regions",), ("looking for an instance of an earlier attempt",),
                     ("trying aws a in us-east-1 ($1/h)",)]


def test_terminate_cloud_and_placement(ledger):
    aws = FakeBackend("aws", ["us-east-1"])
    chosen, inst = run({"aws": aws}, [offer("a", 1.5)], ledger)
    placement = placement_of(chosen, inst)
    assert (placement.backend, placement.instance_id, placement.price) == ("aws", inst.instance_id, 1.5)
    terminate_cloud(inst, backends={"aws": aws}, ledger=ledger)
    assert aws.instances == {} and ledger.entries(inst.key)[-1]["phase"] == "terminated"
    with pytest.raises(CloudError, match="backend aws is not configured"):
        terminate_cloud(inst, backends={})


def test_activity_error_mapping():
    fatal = activity_error(CloudError(ErrorKind.FATAL, "AuthFailure: bad"))
    assert fatal.non_retryable and fatal.type == "CloudFatal" and fatal.message == "AuthFailure: bad"
    transient = activity_error(CloudError(ErrorKind.TRANSIENT, "503"))
    assert not transient.non_retryable
    assert not activity_error(CloudError(ErrorKind.FATAL, "AuthFailure"), teardown=True).non_retryable


# --- keys, classes ----------------------------------------------------------------------------------

GCE_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
NAMES = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,40}\Z")


@settings(max_examples=200, deadline=None)
@given(service=NAMES, group=NAMES, replica=st.integers(0, 10**9), submission=st.integers(0, 10**6),
       instance_type=st.sampled_from(["g5.xlarge", "p6-b200.48xlarge", "n1-standard-96", "a3-megagpu-8g"]),
       region=st.sampled_from(["us-east-1", "ap-northeast-1", "asia-southeast1", "europe-west4"]))
def test_provisioning_key_is_a_valid_token_name_and_label(service, group, replica, submission, instance_type, region):
    o = offer(instance_type, 1, region=region)
    key = provisioning_key(service, group, replica, submission, o)
    assert key == provisioning_key(service, group, replica, submission, o)
    assert len(key) <= 63 and key.isascii() and GCE_NAME.match(key)


def test_provisioning_key_changes_with_every_input_but_not_the_attempt():
    base = offer("n1-standard-4", 1, "gcp", "us-central1", gpu="T4")
    key = provisioning_key("svc", "g", 1, 0, base)
    assert key.startswith("ds-svc-g-r1s0-n1-standard-4-us-central1-")
    variants = [provisioning_key("svc", "g", 1, 1, base), provisioning_key("svc", "g", 2, 0, base),
                provisioning_key("svc", "h", 1, 0, base), provisioning_key("Svc", "g", 1, 0, base),
                provisioning_key("svc", "g", 1, 0, base.model_copy(update={"spot": True})),
                provisioning_key("svc", "g", 1, 0, base.model_copy(update={"gpu_name": "V100"})),
                provisioning_key("svc", "g", 1, 0, base.model_copy(update={"gpu_count": 2})),
                provisioning_key("svc", "g", 1, 0, base.model_copy(update={"region": "us-east1"}))]
    assert len(set(variants + [key])) == len(variants) + 1
    # The price and zones may change between catalog versions; the key must not.
    assert provisioning_key("svc", "g", 1, 0, base.model_copy(update={"price": 9, "zones": []})) == key


@pytest.mark.parametrize("code,status,kind", [
    ("InsufficientInstanceCapacity", 500, ErrorKind.CAPACITY), ("SpotMaxPriceTooLow", 400, ErrorKind.CAPACITY),
    ("Unsupported", 400, ErrorKind.CAPACITY), ("VcpuLimitExceeded", 400, ErrorKind.QUOTA),
    ("InstanceLimitExceeded", 400, ErrorKind.QUOTA), ("MaxSpotInstanceCountExceeded", 400, ErrorKind.QUOTA),
    ("RequestLimitExceeded", 503, ErrorKind.TRANSIENT), ("InternalError", 500, ErrorKind.TRANSIENT),
    ("SomethingNew", 502, ErrorKind.TRANSIENT), ("AuthFailure", 401, ErrorKind.FATAL),
    ("UnauthorizedOperation", 403, ErrorKind.FATAL), ("InvalidAMIID.NotFound", 400, ErrorKind.FATAL),
    ("IdempotentParameterMismatch", 400, ErrorKind.FATAL), ("IdempotentInstanceTerminated", 400, ErrorKind.CAPACITY),
    ("ReservationCapacityExceeded", 400, ErrorKind.CAPACITY),
    ("InvalidCapacityReservationId.NotFound", 400, ErrorKind.CAPACITY),
    ("InvalidCapacityReservationId.Malformed", 400, ErrorKind.FATAL)])
def test_classify_aws(code, status, kind):
    assert classify_aws(code, status) is kind


@pytest.mark.parametrize("codes,status,kind", [
    (["ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"], 503, ErrorKind.CAPACITY),
    (["QUOTA_EXCEEDED"], 403, ErrorKind.QUOTA),
    (["quotaExceeded"], 403, ErrorKind.QUOTA), (["forbidden"], 403, ErrorKind.FATAL), ([], 503, ErrorKind.TRANSIENT),
    (["rateLimitExceeded"], 403, ErrorKind.TRANSIENT), (["invalid"], 400, ErrorKind.FATAL)])
def test_classify_gcp(codes, status, kind):
    assert classify_gcp(codes, status) is kind


@pytest.mark.parametrize("message,kind", [
    ("Specified reservation 'r1' does not have available resources for the request.", ErrorKind.CAPACITY),
    ("Specified reservation 'r1' does not exist.", ErrorKind.CAPACITY),
    ("No available resources in specified reservations 'r1'", ErrorKind.CAPACITY),
    ("Cannot insert instance to a reservation with status: CREATING, as it requires reservation to be in READY "
     "state.", ErrorKind.CAPACITY),
    # The same code for an organisation policy: no other zone or offer can help.
    ("Instance 'x' creation failed: Constraint constraints/compute.vmExternalIpAccess violated for project 1.",
     ErrorKind.FATAL)])
def test_classify_gcp_tells_a_reservations_refusal_from_another_unmet_condition(message, kind):
    assert classify_gcp(["CONDITION_NOT_MET"], 412, (message,)) is kind


def test_aws_quota_classes():
    assert [aws_quota_class(offer(t, 1)) for t in ("p5.48xlarge", "g6e.xlarge", "m5.large")] == \
        ["on-demand:P", "on-demand:G", "on-demand:standard"]
    assert aws_quota_class(offer("g5.xlarge", 1, spot=True)) == "spot:G"


def test_owner_and_labels():
    assert owner("gcp", "My.Svc", "Group_1", 3, 2) == ("my-svc", "group-1", "r3-s2")
    assert owner("aws", "My.Svc", "Group_1", 3, 2) == ("My.Svc", "Group_1", "r3-s2") and replica_label(0, 1) == "r0-s1"


# --- configuration ----------------------------------------------------------------------------------

def test_nothing_configured_means_local_only(tmp_path):
    config = load_backends_config({"DURASTACK_HOME": str(tmp_path)})
    assert config.configured() == ["local"] and config.max_offers == 25
    assert config.summary() == "backends: local only (no aws or gcp in config.yml)"
    assert config.allows(offer("local", 0, backend="local", region="local"))
    assert not config.allows(offer("g5.xlarge", 1))


def test_config_file_and_env_overrides(tmp_path):
    (tmp_path / "config.yml").write_text(
        "backends:\n  aws:\n    regions: [us-east-1]\n  gcp:\n    project_id: proj\n    regions: [us-central1]\n"
        "max_offers: 7\nother_setting: ignored\n")
    env = {"DURASTACK_HOME": str(tmp_path)}
    config = load_backends_config(env)
    assert config.configured() == ["aws", "gcp", "local"] and config.max_offers == 7
    assert config.summary() == "backends: aws (us-east-1), gcp (proj: us-central1), local"
    assert config.allows(offer("g5.xlarge", 1)) and not config.allows(offer("g5.xlarge", 1, region="eu-west-1"))
    env.update(DURASTACK_AWS_REGIONS="us-west-2, eu-west-1", DURASTACK_GCP_ENDPOINT="http://127.0.0.1:1",
               DURASTACK_MAX_OFFERS="3", DURASTACK_AWS_AMI="ami-123")
    config = load_backends_config(env)
    assert config.aws == AWSConfig(regions=["us-west-2", "eu-west-1"], ami_id="ami-123")
    assert config.gcp.endpoint == "http://127.0.0.1:1" and config.max_offers == 3
    assert load_backends_config({**env, "DURASTACK_BACKENDS": "gcp"}).configured() == ["gcp", "local"]


def test_installation_from_config_env_or_derived(tmp_path):
    assert backends_config_from({"installation": "prod-eu"}, {}).installation == "prod-eu"
    assert backends_config_from({"installation": "prod-eu"}, {"DURASTACK_INSTALLATION": "dev"}).installation == "dev"
    with pytest.raises(ValueError, match="installation"):  # it must be a tag value and a GCP label value
        backends_config_from({}, {"DURASTACK_INSTALLATION": "Prod EU"})
    # An external Temporal: every worker of the deployment derives the same id, another deployment another.
    cluster = installation_id("temporal.prod:7233", "durastack", tmp_path / "a")
    assert cluster == installation_id("temporal.prod:7233", "durastack", tmp_path / "b")
    assert cluster != installation_id("temporal.prod:7233", "default", tmp_path / "a")
    assert re.match(INSTALLATION_PATTERN, cluster) and not (tmp_path / "a").exists()
    # The embedded Temporal: random, kept in the home, the same for every worker of that home.
    homes = [tmp_path / "laptop1", tmp_path / "laptop2"]
    for home in homes:
        home.mkdir()
    first = installation_id(None, "default", homes[0])
    assert first == installation_id(None, "default", homes[0]) == (homes[0] / "installation").read_text().strip()
    assert first != installation_id(None, "default", homes[1]) and re.match(INSTALLATION_PATTERN, first)
    fresh = tmp_path / "together"
    fresh.mkdir()
    with ThreadPoolExecutor(8) as pool:  # workers starting at once agree on one id
        assert len(set(pool.map(lambda _: installation_id(None, "default", fresh), range(32)))) == 1
    assert sorted(p.name for p in fresh.iterdir()) == ["installation"]


def test_env_alone_enables_a_cloud():
    config = backends_config_from({}, {"DURASTACK_GCP_PROJECT": "p", "DURASTACK_GCP_REGIONS": "us-east1"})
    assert config.gcp == GCPConfig(project_id="p", regions=["us-east1"]) and config.aws is None
    assert backends_config_from({"backends": {"aws": None}}, {}).aws == AWSConfig()  # `aws:` with no settings


def test_bad_config_is_rejected(tmp_path):
    (tmp_path / "config.yml").write_text("backends:\n  aws:\n    regionz: [us-east-1]\n")
    with pytest.raises(ValueError, match="regionz"):
        load_backends_config({"DURASTACK_HOME": str(tmp_path)})
    (tmp_path / "config.yml").write_text("- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        load_backends_config({"DURASTACK_HOME": str(tmp_path)})
    with pytest.raises(ValueError):
        BackendsConfig.model_validate({"gcp": {"project_id": ""}})
