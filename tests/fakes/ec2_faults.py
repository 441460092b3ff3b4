"""moto's EC2 server behind a WSGI middleware that adds what moto lacks (cloud-testing.md 1.3).

* a RunInstances fault table: an EC2 XML error for matching instance type / region, N times or forever;
* real ClientToken semantics: same token + same params → the original reservation; other params →
  IdempotentParameterMismatch; instance terminated → IdempotentInstanceTerminated; > 64 chars → invalid;
* "lost responses": the instance is launched, then the client gets a 503 (as if the reply never came);
* RunInstances naming a security group that does not exist gets InvalidGroup.NotFound, and DeleteSecurityGroup of
  a group an instance still holds gets DependencyViolation, as from EC2 (moto would launch into an empty group of
  that name, and delete a group in use); the two are served one after the other, so a launch and the deletion
  of its group never interleave;
* a log of RunInstances requests, so tests can count what reached EC2;
* Service Quotas' GetServiceQuota for EC2's vCPU quotas, which moto answers for ``vpc`` only
  (NoSuchResourceException for ``ec2``): each region's six codes answer a settable value (``set_quota``; a generous
  2048 vCPUs otherwise), in AWS's response shape, and ``deny_quotas`` answers AccessDeniedException as for a
  policy without ``servicequotas:GetServiceQuota``.
* EBS volumes as EC2 attaches them, where moto attaches anything anywhere: AttachVolume of a volume attached to an
  instance (VolumeInUse), in another zone (InvalidVolume.ZoneMismatch), to an instance that is not running
  (IncorrectState) or at a device name in use (InvalidParameterValue) is refused with EC2's code and message;
  DetachVolume of a volume attached nowhere is IncorrectState; CreateVolume honours its ClientToken (the same token
  and parameters: the same volume; other parameters: IdempotentParameterMismatch). (Terminating an instance detaches
  its volumes in moto already, as in EC2.)
* Capacity Reservations and Capacity Blocks, which moto lacks: DescribeCapacityReservations answers as EC2 does,
  and a RunInstances targeting one (CapacityReservationSpecification) is refused with EC2's codes when the id is
  malformed or unknown, or when the reservation cannot take it (not active, another instance type, zone or
  tenancy, a Capacity Block without its `capacity-block` market type or the reverse, or no free instance:
  ReservationCapacityExceeded, whose one message EC2 gives for all of these); an instance launched into one holds
  it until terminated, and is described with its CapacityReservationId (and a Capacity Block's lifecycle).

Served by werkzeug on 127.0.0.1:<ephemeral> in a thread; ``ec2_server`` (session) and ``fake_ec2`` (per test:
reset + env) are the fixtures. Import both into a test module to use them.
"""

from __future__ import annotations

import io
import json
import re
import threading
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import parse_qs
from xml.sax.saxutils import escape

import boto3
import pytest
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server
from tests.fakes import ServedInThread

GPU_AMI = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) 20261006"
CPU_AMI = "ubuntu/images/hvm-ssd/ubuntu-jammy-22.04-amd64-server-20250101"
_STATUS = {"InsufficientInstanceCapacity": 500, "InternalError": 500, "ServiceUnavailable": 503,
           "RequestLimitExceeded": 503}
_REGION = re.compile(r"Credential=[^/]+/\d+/([a-z0-9-]+)/[a-z0-9-]+/aws4_request")
ACCOUNT = "123456789012"  # moto's default account
QUOTAS_TARGET = "ServiceQuotasV20190624."
DEFAULT_VCPU_QUOTA = 2048.0
# EC2's vCPU quotas as the Service Quotas console and AWS's EC2 documentation name them: code → (name, the usage
# metric's Class dimension).
EC2_VCPU_QUOTAS = {
    "L-1216C47A": ("Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances", "Standard/OnDemand"),
    "L-DB2E81BA": ("Running On-Demand G and VT instances", "G/OnDemand"),
    "L-417A185B": ("Running On-Demand P instances", "P/OnDemand"),
    "L-34B43A08": ("All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests", "Standard/Spot"),
    "L-3819A6DF": ("All G and VT Spot Instance Requests", "G/Spot"),
    "L-7212CCBC": ("All P Spot Instance Requests", "P/Spot"),
}
_RESERVATION_ID = re.compile(r"^cr-[0-9a-z]{17}$")  # the form EC2's Malformed message gives: cr-xxxxxxxxxxxxxxxxx
_TARGET = "CapacityReservationSpecification.CapacityReservationTarget.CapacityReservationId"
_HOLDING = ("pending", "running", "stopping")  # an instance in these holds its place in a reservation
_launching = threading.local()  # what the RunInstances being served adds to the instance moto makes
_GROUP_PARAM = re.compile(r"(NetworkInterface\.\d+\.)?SecurityGroupId\.\d+")


@dataclass
class Fault:
    code: str
    instance_type: Optional[str] = None
    region: Optional[str] = None
    times: Optional[int] = None  # None: forever
    message: str = ""
    zone: Optional[str] = None

    def matches(self, params: dict, region: str) -> bool:
        return (self.times is None or self.times > 0) and \
            self.instance_type in (None, params.get("InstanceType")) and self.region in (None, region) and \
            self.zone in (None, params.get("Placement.AvailabilityZone"))


@dataclass
class _Launch:
    fingerprint: tuple
    body: bytes
    headers: list
    instance_ids: list[str] = field(default_factory=list)


@dataclass
class CapacityReservation:
    id: str
    region: str
    zone: str
    instance_type: str
    total: int
    kind: str = "default"  # or capacity-block (EC2's ReservationType)
    state: str = "active"
    tenancy: str = "default"
    instance_ids: list[str] = field(default_factory=list)

    def in_use(self) -> int:
        return sum(1 for i in self.instance_ids if _moto_state(self.region, i) in _HOLDING)

    def takes(self, params: dict, zone: Optional[str]) -> bool:
        """Whether this launch fits it: active, the same type, zone and tenancy, the market type of its kind, and
        room for the instances asked."""
        block = params.get("InstanceMarketOptions.MarketType") == "capacity-block"
        return (self.state == "active" and params.get("InstanceType") == self.instance_type
                and zone in (None, self.zone) and params.get("Placement.Tenancy", "default") == self.tenancy
                and block == (self.kind == "capacity-block")
                and self.total - self.in_use() >= int(params.get("MinCount") or 1))

    def xml(self) -> str:
        block = self.kind == "capacity-block"
        fields = [("capacityReservationId", self.id), ("ownerId", "123456789012"),
                  ("capacityReservationArn", f"arn:aws:ec2:{self.region}:123456789012:capacity-reservation/{self.id}"),
                  ("instanceType", self.instance_type), ("instancePlatform", "Linux/UNIX"),
                  ("availabilityZone", self.zone), ("tenancy", self.tenancy),
                  ("totalInstanceCount", self.total), ("availableInstanceCount", max(self.total - self.in_use(), 0)),
                  ("ebsOptimized", "false"), ("ephemeralStorage", "false"), ("state", self.state),
                  ("startDate", "2026-01-01T00:00:00.000Z"), ("endDateType", "limited" if block else "unlimited"),
                  ("instanceMatchCriteria", "targeted"), ("createDate", "2026-01-01T00:00:00.000Z"),
                  ("reservationType", self.kind)] + ([("endDate", "2026-01-08T11:30:00.000Z")] if block else [])
        return "<item>" + "".join(f"<{k}>{escape(str(v))}</{k}>" for k, v in fields) + "<tagSet/></item>"


def _error(code: str, message: str, status: Optional[int] = None) -> tuple[int, list, bytes]:
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error><Code>{escape(code)}</Code>'
            f'<Message>{escape(message or code)}</Message></Error></Errors>'
            f'<RequestID>{uuid.uuid4()}</RequestID></Response>').encode()
    return status or _STATUS.get(code, 400), [("Content-Type", "text/xml")], body


def _json_headers() -> list:
    return [("Content-Type", "application/x-amz-json-1.1"), ("x-amzn-RequestId", str(uuid.uuid4()))]


def _json_error(kind: str, message: str) -> tuple[int, list, bytes]:
    return 400, _json_headers(), json.dumps({"__type": kind, "Message": message}).encode()


class EC2FaultMiddleware:
    def __init__(self, app):
        self.app = app
        self.lock = threading.Lock()  # RunInstances are serialised, as EC2 serialises one token's requests
        self.reset_state()

    def reset_state(self) -> None:
        self.faults: list[Fault] = []
        self.launches: dict[tuple, _Launch] = {}
        self.requests: list[dict] = []  # RunInstances params
        self.actions: list[str] = []  # every EC2 Action, in order
        self.lose = 0
        self.quotas: dict[tuple[str, str], float] = {}  # (region, quota code) → value, over DEFAULT_VCPU_QUOTA
        self.quota_reads: list[tuple[str, str]] = []  # (region, quota code) of each GetServiceQuota
        self.deny_quotas = False
        self.capacity: dict[str, CapacityReservation] = {}

    def __call__(self, environ, start_response):
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        environ["wsgi.input"] = io.BytesIO(body)
        if environ.get("PATH_INFO") == "/moto-api/reset":
            with self.lock:
                self.reset_state()
            return self.app(environ, start_response)
        m = _REGION.search(environ.get("HTTP_AUTHORIZATION", ""))
        region = m.group(1) if m else "us-east-1"
        target = environ.get("HTTP_X_AMZ_TARGET", "")
        if target == QUOTAS_TARGET + "GetServiceQuota" and json.loads(body or b"{}").get("ServiceCode") == "ec2":
            with self.lock:
                status, headers, out = self._get_service_quota(json.loads(body), region)
            start_response(f"{status} {'OK' if status == 200 else 'ERROR'}", headers)
            return [out]
        params = {k: v[0] for k, v in parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True).items()}
        with self.lock:
            self.actions.append(params.get("Action", ""))
        handlers = {"RunInstances": self._run_instances, "DeleteSecurityGroup": self._delete_group,
                    "DescribeCapacityReservations": lambda _, p, r: self._describe_reservations(p, r),
                    "AttachVolume": self._attach_volume, "DetachVolume": self._detach_volume,
                    "CreateVolume": self._create_volume}
        if params.get("Action") not in handlers:
            return self.app(environ, start_response)
        with self.lock:  # one after the other, as EC2 orders a launch into a group and that group's deletion
            status, headers, out = handlers[params["Action"]](environ, params, region)
        start_response(f"{status} {'OK' if status == 200 else 'ERROR'}", headers)
        return [out]

    def _run_instances(self, environ, params: dict, region: str) -> tuple[int, list, bytes]:
        self.requests.append({"region": region, **params})
        token = params.get("ClientToken", "")
        if len(token) > 64:
            return _error("InvalidParameterValue", "ClientToken must be at most 64 characters")
        fingerprint = tuple(sorted((k, v) for k, v in params.items()
                                   if k not in ("ClientToken", "Placement.AvailabilityZone")))
        cache_key = (region, token, params.get("Placement.AvailabilityZone"))  # zonal idempotency when an AZ is given
        if token and cache_key in self.launches:
            launch = self.launches[cache_key]
            if launch.fingerprint != fingerprint:
                return _error("IdempotentParameterMismatch", "The client token was used with other parameters")
            if any(_moto_state(region, i) == "terminated" for i in launch.instance_ids):
                return _error("IdempotentInstanceTerminated", "The instance launched with this token is terminated")
            return self._maybe_lose(200, launch.headers, launch.body)
        missing = [g for k, g in params.items() if _GROUP_PARAM.fullmatch(k) and not _moto_group(region, g)]
        if missing:  # moto would make an empty group of that name; EC2 refuses
            return _error("InvalidGroup.NotFound", f"The security group '{missing[0]}' does not exist")
        reservation = self.capacity.get(params.get(_TARGET, ""))
        if _TARGET in params:
            refused = self._reservation_refusal(params, region)
            if refused:
                return refused
        for fault in self.faults:
            if fault.matches(params, region):
                if fault.times is not None:
                    fault.times -= 1
                return _error(fault.code, fault.message or f"{fault.code} for {params.get('InstanceType')} "
                                                           f"in {region} (injected)")
        _launching.reservation = reservation
        try:
            status, headers, out = self._moto_answer(environ)
        finally:
            _launching.reservation = None
        if status == 200:
            ids = [i.decode() for i in re.findall(rb"<instanceId>(i-[0-9a-f]+)</instanceId>", out)]
            if reservation is not None:
                reservation.instance_ids += ids
            if token:
                self.launches[cache_key] = _Launch(fingerprint, out, headers, ids)
            return self._maybe_lose(200, headers, out)
        return status, headers, out

    def _get_service_quota(self, params: dict, region: str) -> tuple[int, list, bytes]:
        """As Service Quotas answers GetServiceQuota for EC2 (JSON 1.1 protocol, errors by ``__type``)."""
        code = params.get("QuotaCode", "")
        self.quota_reads.append((region, code))
        arn = f"arn:aws:servicequotas:{region}:{ACCOUNT}:ec2/{code}"
        if self.deny_quotas:
            return _json_error("AccessDeniedException", f"User: arn:aws:iam::{ACCOUNT}:user/durastack is not "
                               f"authorized to perform: servicequotas:GetServiceQuota on resource: {arn} because no "
                               "identity-based policy allows the servicequotas:GetServiceQuota action")
        if code not in EC2_VCPU_QUOTAS:
            return _json_error("NoSuchResourceException", "The request failed because the specified quota does "
                                                          "not exist.")
        name, cls = EC2_VCPU_QUOTAS[code]
        quota = {"ServiceCode": "ec2", "ServiceName": "Amazon Elastic Compute Cloud (Amazon EC2)", "QuotaArn": arn,
                 "QuotaCode": code, "QuotaName": name, "Value": self.quotas.get((region, code), DEFAULT_VCPU_QUOTA),
                 "Unit": "None", "Adjustable": True, "GlobalQuota": False,
                 "UsageMetric": {"MetricNamespace": "AWS/Usage", "MetricName": "ResourceCount",
                                 "MetricDimensions": {"Class": cls, "Resource": "vCPU", "Service": "EC2",
                                                      "Type": "Resource"},
                                 "MetricStatisticRecommendation": "Maximum"}}
        return 200, _json_headers(), json.dumps({"Quota": quota}).encode()

    def _reservation_refusal(self, params: dict, region: str) -> Optional[tuple[int, list, bytes]]:
        target = params[_TARGET]
        unknown = self._unknown(target, region)
        if unknown:
            return unknown
        reservation = self.capacity[target]
        subnet = params.get("NetworkInterface.1.SubnetId") or params.get("SubnetId")
        zone = params.get("Placement.AvailabilityZone") or (_moto(region).get_subnet(subnet).availability_zone
                                                            if subnet else None)
        if not reservation.takes(params, zone):
            return _error("ReservationCapacityExceeded", "The requested reservation does not have sufficient "
                                                         "compatible and available capacity for this request.")
        return None

    def _unknown(self, target: str, region: str) -> Optional[tuple[int, list, bytes]]:
        """EC2's error for an id that is malformed or names no reservation of ``region``; None if it names one."""
        if not _RESERVATION_ID.match(target):
            return _error("InvalidCapacityReservationId.Malformed", "The ID for the Capacity Reservation is "
                          "malformed. Ensure that you specify the Capacity Reservation ID in the form "
                          "cr-xxxxxxxxxxxxxxxxx")
        if target not in self.capacity or self.capacity[target].region != region:
            return _error("InvalidCapacityReservationId.NotFound", f"The capacity reservation ID '{target}' was not "
                                                                   "found")
        return None

    def _describe_reservations(self, params: dict, region: str) -> tuple[int, list, bytes]:
        ids = [v for k, v in sorted(params.items()) if k.startswith("CapacityReservationId.")]
        unknown = next(filter(None, (self._unknown(target, region) for target in ids)), None)
        if unknown:
            return unknown
        found = [self.capacity[i] for i in ids] if ids else [r for r in self.capacity.values() if r.region == region]
        filters = {params[k]: [v for n, v in params.items() if n.startswith(k[:-len("Name")] + "Value.")]
                   for k in params if re.fullmatch(r"Filter\.\d+\.Name", k)}
        attrs = {"state": "state", "instance-type": "instance_type", "availability-zone": "zone",
                 "tenancy": "tenancy"}
        found = [r for r in found if all(getattr(r, attrs[n]) in values for n, values in filters.items()
                                         if n in attrs)]
        body = ('<?xml version="1.0" encoding="UTF-8"?>\n<DescribeCapacityReservationsResponse '
                'xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">'
                f'<requestId>{uuid.uuid4()}</requestId><capacityReservationSet>'
                + "".join(r.xml() for r in found) + "</capacityReservationSet></DescribeCapacityReservationsResponse>")
        return 200, [("Content-Type", "text/xml")], body.encode()

    def _attach_volume(self, environ, params: dict, region: str) -> tuple[int, list, bytes]:
        ebs = _moto(region)
        volume = ebs.volumes.get(params.get("VolumeId", ""))
        try:
            instance = ebs.get_instance(params.get("InstanceId", ""))
        except Exception:  # noqa: BLE001 — moto's own error for an unknown instance follows
            return self._moto_answer(environ)
        if volume is None:
            return self._moto_answer(environ)  # InvalidVolume.NotFound, as EC2
        if volume.attachment is not None:
            return _error("VolumeInUse", f"{volume.id} is already attached to an instance")
        if volume.zone.name != instance.placement.zone:
            return _error("InvalidVolume.ZoneMismatch", f"The volume '{volume.id}' is not in the same availability "
                                                        f"zone as instance '{instance.id}'")
        if instance.state not in ("running", "stopped"):
            return _error("IncorrectState", f"Instance '{instance.id}' is not 'running'.")
        device = params.get("Device", "")
        if device in instance.block_device_mapping:
            return _error("InvalidParameterValue", f"Invalid value '{device}' for unixDevice. Attachment point "
                                                   f"{device} is already in use")
        return self._moto_answer(environ)

    def _detach_volume(self, environ, params: dict, region: str) -> tuple[int, list, bytes]:
        volume = _moto(region).volumes.get(params.get("VolumeId", ""))
        if volume is not None and volume.attachment is None:
            return _error("IncorrectState", f"Volume '{volume.id}' is in the 'available' state.")
        return self._moto_answer(environ)

    def _create_volume(self, environ, params: dict, region: str) -> tuple[int, list, bytes]:
        """CreateVolume under a ClientToken: once (moto ignores the token and makes another volume each time)."""
        token = params.get("ClientToken", "")
        fingerprint = tuple(sorted((k, v) for k, v in params.items() if k != "ClientToken"))
        cache_key = (region, "CreateVolume", token)
        if token and cache_key in self.launches:
            done = self.launches[cache_key]
            if done.fingerprint != fingerprint:
                return _error("IdempotentParameterMismatch", "The client token was used with other parameters")
            return 200, done.headers, done.body
        status, headers, out = self._moto_answer(environ)
        if status == 200 and token:
            self.launches[cache_key] = _Launch(fingerprint, out, headers)
        return status, headers, out

    def _delete_group(self, environ, params: dict, region: str) -> tuple[int, list, bytes]:
        if _group_in_use(region, params.get("GroupId", "")):
            return _error("DependencyViolation", f"resource {params['GroupId']} has a dependent object")
        return self._moto_answer(environ)

    def _moto_answer(self, environ) -> tuple[int, list, bytes]:
        captured: dict = {}

        def capture(status, headers, exc_info=None):
            captured.update(status=int(status.split()[0]), headers=headers)

        out = b"".join(self.app(environ, capture))
        return captured["status"], captured["headers"], out

    def _maybe_lose(self, status: int, headers: list, body: bytes) -> tuple[int, list, bytes]:
        """The launch happened (or was found by its token), but the client is told 503."""
        if self.lose > 0:
            self.lose -= 1
            return _error("ServiceUnavailable", "response lost (injected; the instance was launched)", 503)
        return status, headers, body


def _moto(region: str):
    """moto's EC2 backend of ``region``, in this process (the server runs in a thread here)."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ec2.models import ec2_backends

    return ec2_backends[DEFAULT_ACCOUNT_ID][region]


def _moto_group(region: str, group_id: str) -> bool:
    return _moto(region).get_security_group_from_id(group_id) is not None


def _group_in_use(region: str, group_id: str) -> bool:
    """Whether an instance not yet terminated holds the group (on itself or its interfaces)."""
    return any(inst.state != "terminated" and group_id in {g.id for g in inst.security_groups} |
               {g.id for nic in inst.nics.values() for g in nic.group_set}
               for inst in _moto(region).all_instances())


def _moto_state(region: str, instance_id: str) -> str:
    try:
        return _moto(region).get_instance(instance_id).state
    except Exception:  # unknown to moto: treat as gone
        return "terminated"


def _hook_launches() -> None:
    """moto makes the instance and writes its answer in one call: what a launch into a reservation adds to the
    instance (its reservation id, a Capacity Block's lifecycle, a dedicated tenancy) is set on it in that call."""
    from moto.ec2.models.instances import InstanceBackend

    if getattr(InstanceBackend.run_instances, "reservations_hooked", False):
        return
    run_instances = InstanceBackend.run_instances

    def hooked(self, *args, **kwargs):
        made = run_instances(self, *args, **kwargs)
        reservation = getattr(_launching, "reservation", None)
        for instance in made.instances if reservation is not None else ():
            instance.capacity_reservation_id = reservation.id
            # moto takes any market type for spot; EC2 calls this one's instances capacity-block
            instance.lifecycle = "capacity-block" if reservation.kind == "capacity-block" else None
            instance.placement.tenancy = reservation.tenancy
        return made

    hooked.reservations_hooked = True
    InstanceBackend.run_instances = hooked


class _QuietHandler(MotoRequestHandler):
    def log_request(self, *args, **kwargs):  # one line per request would drown the test output
        pass


class EC2FaultServer(ServedInThread):
    def __init__(self):
        _hook_launches()
        self.middleware = EC2FaultMiddleware(DomainDispatcherApplication(create_backend_app))
        self.server = make_server("127.0.0.1", 0, self.middleware, threaded=True, request_handler=_QuietHandler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="ec2-fake", daemon=True)


    def reset(self) -> None:
        urllib.request.urlopen(urllib.request.Request(self.url + "/moto-api/reset", method="POST"), timeout=10).read()

    # --- what tests use -----------------------------------------------------------------------------

    def fail(self, code: str, *, instance_type: Optional[str] = None, region: Optional[str] = None,
             times: Optional[int] = None, message: str = "", zone: Optional[str] = None) -> None:
        with self.middleware.lock:
            self.middleware.faults.append(Fault(code, instance_type, region, times, message, zone))

    def lose_responses(self, n: int) -> None:
        with self.middleware.lock:
            self.middleware.lose = n

    def set_quota(self, region: str, code: str, value: float) -> None:
        """The value GetServiceQuota answers for an EC2 vCPU quota code in ``region``."""
        with self.middleware.lock:
            self.middleware.quotas[(region, code)] = value

    def deny_quotas(self) -> None:
        """Answer GetServiceQuota with AccessDeniedException (a policy without servicequotas:GetServiceQuota)."""
        with self.middleware.lock:
            self.middleware.deny_quotas = True

    @property
    def quota_reads(self) -> list[tuple[str, str]]:
        with self.middleware.lock:
            return list(self.middleware.quota_reads)

    def count(self, action: str) -> int:
        with self.middleware.lock:
            return self.middleware.actions.count(action)

    @property
    def run_requests(self) -> list[dict]:
        with self.middleware.lock:
            return list(self.middleware.requests)

    def add_reservation(self, instance_type: str, zone: str, *, count: int = 1, kind: str = "default",
                        state: str = "active", tenancy: str = "default") -> str:
        """A Capacity Reservation (``kind`` default) or Capacity Block (``capacity-block``) of ``count`` instances
        of ``instance_type`` in ``zone``; its id."""
        reservation = CapacityReservation(f"cr-{uuid.uuid4().hex[:17]}", zone[:-1], zone, instance_type, count,
                                          kind, state, tenancy)
        with self.middleware.lock:
            self.middleware.capacity[reservation.id] = reservation
        return reservation.id

    def set_reservation_state(self, reservation_id: str, state: str) -> None:
        with self.middleware.lock:
            self.middleware.capacity[reservation_id].state = state

    def seed_amis(self, *regions: str) -> None:
        """Register AMIs under the real names the backend looks up (found with Owners=["self"])."""
        for region in regions:
            ec2 = boto3.client("ec2", region_name=region, endpoint_url=self.url)
            for name in (GPU_AMI, CPU_AMI):
                ec2.register_image(Name=name, Description=name)


@pytest.fixture(scope="session")
def ec2_server():
    server = EC2FaultServer().start()
    yield server
    server.stop()


@pytest.fixture
def fake_ec2(ec2_server, monkeypatch, tmp_path):
    """The shared server, reset, with this process's AWS env pointed at it (dummy credentials)."""
    import moto.settings

    env = {"AWS_ENDPOINT_URL_EC2": ec2_server.url, "AWS_ENDPOINT_URL_SERVICE_QUOTAS": ec2_server.url,
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
           "MOTO_EC2_ENABLE_INSTANCE_TYPE_VALIDATION": "true"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k, raising=False)
    # moto reads this setting at import time; the server runs in this process, so set the module value too.
    monkeypatch.setattr(moto.settings, "EC2_ENABLE_INSTANCE_TYPE_VALIDATION", True)
    ec2_server.reset()  # before, not after: a failing test leaves its state for inspection
    yield ec2_server
