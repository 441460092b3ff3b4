"""AWS EC2 backend (boto3): launch, find, list and terminate replica instances. Blocking; call via to_thread.

Exactly once: RunInstances carries ``ClientToken=key`` (``models.backends.provisioning_key``), so a retry
after a lost response returns the instance the first call made. botocore's own retries are off for
RunInstances (``total_max_attempts: 1``): capacity errors come back as HTTP 500 and must reach the offer
walker at once, and every other retry belongs to Temporal. Credentials come from the standard chain; the
endpoints from ``AWS_ENDPOINT_URL_EC2`` and ``AWS_ENDPOINT_URL_SERVICE_QUOTAS`` when set (tests point them at moto).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from typing import Any, Iterator, Optional

import boto3
from botocore.config import Config
from botocore.exceptions import (BotoCoreError, ClientError, NoCredentialsError, NoRegionError,
                                 PartialCredentialsError, ProfileNotFound)

from backends.cloud import CloudBackend
from backends.cloud_errors import AWS_HINTS, CloudError, ErrorKind, QuotaScope, aws_quota_class, classify_aws
from backends.quota import AWS_VCPU_QUOTAS, RegionQuotas
from backends.ssh_keys import SSHKeys
from backends.userdata import BootKeys, cloud_init
from models.backends import HOST_KEY_AFTER_BOOT, TAG_NAMES, AWSConfig, CloudInstance, belongs, replica_label
from models.offers import InstanceOffer
from models.replica import JobSpec
from models.reservations import AWS_ID, Reservation, ReservationLookup

TAGS = TAG_NAMES["aws"]
log = logging.getLogger(__name__)
QUOTA_CLIENT = Config(retries={"mode": "standard", "total_max_attempts": 2}, connect_timeout=5, read_timeout=10)
AMI_TTL = 600.0  # dstack caches AMI lookups for 10 minutes too
LIVE_STATES = ["pending", "running", "stopping", "stopped"]
_STATES = {"pending": "pending", "running": "running", "stopping": "stopping", "shutting-down": "stopping",
           "stopped": "stopped", "terminated": "terminated"}
_FATAL_BOTO = (NoCredentialsError, PartialCredentialsError, ProfileNotFound, NoRegionError)
_GONE = {"InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"}
_NO_RESERVATION = {"InvalidCapacityReservationId.NotFound", "InvalidCapacityReservationId.Malformed"}
_RESERVATION_KINDS = {"default": "capacity-reservation", "capacity-block": "capacity-block"}


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


@contextlib.contextmanager
def api_errors(what: str) -> Iterator[None]:
    """ClientError / botocore errors → CloudError with a kind. Messages carry codes, never credentials."""
    try:
        yield
    except ClientError as e:
        err, meta = e.response.get("Error", {}), e.response.get("ResponseMetadata", {})
        code = err.get("Code", "Unknown")
        hint = f" — {AWS_HINTS[code]}" if code in AWS_HINTS else ""
        raise CloudError(classify_aws(code, int(meta.get("HTTPStatusCode") or 400)),
                         _short(f"{what}: {code}: {err.get('Message', '')}") + hint, code=code) from e
    except _FATAL_BOTO as e:
        raise CloudError(ErrorKind.FATAL, f"{what}: AWS credentials/configuration: {e}", code=type(e).__name__) from e
    except BotoCoreError as e:  # connection, timeout, unparsable response: the call may have happened
        raise CloudError(ErrorKind.TRANSIENT, _short(f"{what}: {e}"), code=type(e).__name__) from e


class AWSBackend(CloudBackend):
    name = "aws"

    def __init__(self, config: AWSConfig, *, regions: Optional[list[str]] = None,
                 session: Optional[boto3.session.Session] = None, installation: Optional[str] = None,
                 ssh_keys: Optional[SSHKeys] = None):
        """``regions``: used when the config names none (the catalog's AWS regions). ``installation``: the
        control plane's id (``BackendsConfig.installation``). ``ssh_keys``: the home's (backends.ssh_keys)."""
        self.config = config
        self.ssh_keys = ssh_keys
        self.installation = installation
        self.regions = list(config.regions or regions or [])
        self._session = session
        self._lock = threading.Lock()  # boto3 sessions are not thread-safe; the clients they make are
        self._clients: dict[tuple[str, bool, str], Any] = {}
        self._amis: dict[tuple[str, str], tuple[float, dict]] = {}
        self._groups: dict[tuple, str] = {}
        self._vpcs: dict[str, dict] = {}
        self.quotas = RegionQuotas("aws", self.quota_limits)

    # --- clients, AMIs, security groups -----------------------------------------------------------

    def client(self, region: str, run: bool = False, service: str = "ec2"):
        with self._lock:
            if (region, run, service) not in self._clients:
                if self._session is None:
                    self._session = boto3.session.Session(profile_name=self.config.profile)
                retries = {"total_max_attempts": 1} if run else {"mode": "standard", "total_max_attempts": 3}
                config = Config(retries=retries, connect_timeout=10, read_timeout=60) if service == "ec2" else \
                    QUOTA_CLIENT  # a quota read that hangs would only delay the launch it cannot block
                self._clients[(region, run, service)] = self._session.client(service, region_name=region,
                                                                             config=config)
            return self._clients[(region, run, service)]

    def quota_limits(self, region: str) -> dict[str, float]:
        """The region's EC2 vCPU quotas (backends/quota.py), by quota code; a code Service Quotas does not know
        there is left out (unknown). Needs ``servicequotas:GetServiceQuota``; the caller treats any error as
        unknown."""
        quotas = self.client(region, service="service-quotas")
        limits = {}
        for code, _ in AWS_VCPU_QUOTAS.values():
            try:
                with api_errors(f"GetServiceQuota {code} in {region}"):
                    limits[code] = float(quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"])
            except CloudError as e:
                if e.code != "NoSuchResourceException":
                    raise
        return limits

    def _ami(self, region: str, offer: InstanceOffer) -> dict:
        """The configured AMI, or the newest available one whose name matches the pattern for the offer."""
        c = self.config
        if c.ami_id:
            cache_key, query = c.ami_id, {"ImageIds": [c.ami_id]}
        else:
            arm = offer.cpu_arch == "arm"
            pattern = (c.gpu_arm_ami_name if arm else c.gpu_ami_name) if offer.gpu_count else \
                (c.cpu_arm_ami_name if arm else c.cpu_ami_name)
            cache_key = pattern
            query = {"Owners": c.ami_owners, "Filters": [{"Name": "name", "Values": [pattern]},
                                                         {"Name": "state", "Values": ["available"]}]}
        hit = self._amis.get((region, cache_key))
        if hit and hit[0] > time.monotonic():
            return hit[1]
        with api_errors("DescribeImages"):
            images = self.client(region).describe_images(**query)["Images"]
        if not images:
            raise CloudError(ErrorKind.FATAL, f"no AMI {cache_key!r} in {region} (owners {', '.join(c.ami_owners)}); "
                             "set backends.aws.ami_id or the AMI name patterns", code="NoAMI")
        # Newest first; AMIs registered in the same second go by name, whose DLAMI releases end in their date.
        image = max(images, key=lambda i: (i.get("CreationDate", ""), i.get("Name", ""), i["ImageId"]))
        self._amis[(region, cache_key)] = (time.monotonic() + AMI_TTL, image)
        return image

    def _vpc(self, region: str) -> dict:
        """The region's VPC: ``backends.aws.vpc_id``'s, else the default one; none is a FATAL error naming the
        setting (a retry cannot make a VPC appear)."""
        if region in self._vpcs:
            return self._vpcs[region]
        ec2 = self.client(region)
        configured = self.config.vpc_for(region)
        try:
            with api_errors("DescribeVpcs"):
                vpcs = ec2.describe_vpcs(**({"VpcIds": [configured]} if configured else
                                            {"Filters": [{"Name": "isDefault", "Values": ["true"]}]}))["Vpcs"]
        except CloudError as e:
            if not configured or not e.code.startswith("InvalidVpcID"):
                raise
            vpcs = []
        if not vpcs:
            if configured:
                raise CloudError(ErrorKind.FATAL, f"VPC {configured} not found in {region}: fix backends.aws.vpc_id "
                                 f"in {_config_file()}", code="NoVpc")
            raise CloudError(ErrorKind.FATAL, f"no default VPC in {region}: set backends.aws.vpc_id in "
                             f"{_config_file()} (an id with one region, else a mapping region → VPC id), or drop "
                             f"{region} from backends.aws.regions", code="NoDefaultVpc")
        self._vpcs[region] = vpcs[0]
        return vpcs[0]

    def ssh_sources(self, vpc: dict) -> list[str]:
        """Where SSH (22) is admitted from: ``gateway_cidrs`` (and ``ssh_cidrs``); with neither narrowing it and a
        public IP, anywhere, as dstack does: the gateway reaches the public address from wherever it runs (key-only
        login, host keys pinned); without a public IP, the VPC's own range."""
        if self.config.gateway_cidrs:
            base = list(self.config.gateway_cidrs)
        elif self.config.public_ip:
            base = ["0.0.0.0/0"]
        else:
            base = [vpc["CidrBlock"]]
        return sorted(set(base) | set(self.config.ssh_cidrs))

    def _security_group(self, region: str, vpc: dict, job: JobSpec) -> str:
        """The service's group: SSH (22) from ``ssh_sources``, everything from the group itself (the service's
        instances reach each other on their private IPs, on any port: one network per service), and nothing
        else — never the service port from outside, which the gateway reaches through an SSH tunnel (with
        ``data_path: private``, the gateway alone: ``_admit_gateway``). Created once, per control plane: another
        one's gateway must not be let in to a service of the same name."""
        cache_key = (region, job.service, 22, job.port if self.config.data_path == "private" else None)
        if cache_key in self._groups:
            return self._groups[cache_key]
        ec2 = self.client(region)
        name = self._group_name(job.service)
        sources = self.ssh_sources(vpc)
        if "0.0.0.0/0" in sources:
            log.warning("AWS %s: SSH (22) to %s's instances is open to 0.0.0.0/0 (key-only login, host keys "
                        "pinned); set backends.aws.gateway_cidrs to the gateway's address to narrow it",
                        region, job.service)
        with api_errors("security group"):
            group_id = self._find_group(ec2, name, vpc["VpcId"])
            if group_id is None:
                try:
                    group_id = ec2.create_security_group(
                        GroupName=name, VpcId=vpc["VpcId"], Description=f"durastack service {job.service}",
                        TagSpecifications=[{"ResourceType": "security-group",
                                            "Tags": [{"Key": TAGS["service"], "Value": job.service}]}])["GroupId"]
                except ClientError as e:  # another replica created it first
                    if e.response["Error"]["Code"] != "InvalidGroup.Duplicate":
                        raise
                    group_id = self._find_group(ec2, name, vpc["VpcId"])
            # An existing group is brought to these sources: a gateway_cidrs set later narrows SSH at once (and
            # EC2 refuses a whole authorize when one of its ranges is there already).
            (group,) = ec2.describe_security_groups(GroupIds=[group_id])["SecurityGroups"]
            ssh = {r["CidrIp"] for p in group["IpPermissions"] if p.get("IpProtocol") == "tcp"
                   and p.get("FromPort") == 22 and p.get("ToPort") == 22 for r in p.get("IpRanges", [])}
            itself = any(p.get("IpProtocol") == "-1" and any(g.get("GroupId") == group_id
                                                             for g in p.get("UserIdGroupPairs", []))
                         for p in group["IpPermissions"])
            if ssh - set(sources):
                ec2.revoke_security_group_ingress(GroupId=group_id, IpPermissions=[{
                    "IpProtocol": "tcp", "FromPort": 22, "ToPort": 22,
                    "IpRanges": [{"CidrIp": cidr} for cidr in sorted(ssh - set(sources))]}])
            wanted = []
            if set(sources) - ssh:
                wanted.append({"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22,
                               "IpRanges": [{"CidrIp": cidr} for cidr in sorted(set(sources) - ssh)]})
            if not itself:
                wanted.append({"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group_id}]})
            for permission in wanted:
                try:
                    ec2.authorize_security_group_ingress(GroupId=group_id, IpPermissions=[permission])
                except ClientError as e:  # another worker added it meanwhile
                    if e.response["Error"]["Code"] != "InvalidPermission.Duplicate":
                        raise
            self._admit_gateway(ec2, group_id, job.port)
        self._groups[cache_key] = group_id
        return group_id

    def _admit_gateway(self, ec2, group_id: str, port: int) -> None:
        """``data_path: private``: the service port from the gateway alone (``gateway_cidrs``, its security group),
        which connects to the replica's private address with no tunnel. Nothing with the SSH data path."""
        if self.config.data_path != "private":
            return
        permission: dict[str, Any] = {"IpProtocol": "tcp", "FromPort": port, "ToPort": port,
                                      "IpRanges": [{"CidrIp": c} for c in sorted(set(self.config.gateway_cidrs))]}
        if self.config.gateway_security_group:
            permission["UserIdGroupPairs"] = [{"GroupId": self.config.gateway_security_group}]
        try:
            ec2.authorize_security_group_ingress(GroupId=group_id, IpPermissions=[permission])
        except ClientError as e:
            if e.response["Error"]["Code"] != "InvalidPermission.Duplicate":
                raise

    def _group_name(self, service: str) -> str:
        return f"durastack-{self.installation}-{service}" if self.installation else f"durastack-{service}"

    def release(self, service: str) -> None:
        """Delete the service's security groups in the regions where none of its instances is left. A group still
        held by an instance that is shutting down (real EC2 keeps its interface, and answers DependencyViolation,
        for up to a few minutes after TerminateInstances) raises TRANSIENT: the teardown is retried until it goes,
        since nothing else (neither the reaper nor a later stop) would delete it."""
        for region in self.regions:
            if self.list_tagged([region], service=service):
                continue
            ec2 = self.client(region)
            with api_errors("security group"):
                groups = ec2.describe_security_groups(
                    Filters=[{"Name": "group-name", "Values": [self._group_name(service)]}])["SecurityGroups"]
            for group in groups:
                try:
                    with api_errors(f"DeleteSecurityGroup {group['GroupId']}"):
                        ec2.delete_security_group(GroupId=group["GroupId"])
                except CloudError as e:
                    if e.code == "DependencyViolation":
                        raise CloudError(ErrorKind.TRANSIENT, f"{e.message} (an instance still shutting down; "
                                         "retried)", code=e.code) from e
                    if e.code != "InvalidGroup.NotFound":
                        raise
            self._forget_groups(region, service)

    def _forget_groups(self, region: str, service: str) -> None:
        self._groups = {k: v for k, v in self._groups.items() if not (k[0] == region and k[1] == service)}

    @staticmethod
    def _find_group(ec2, name: str, vpc_id: str) -> Optional[str]:
        groups = ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": [name]},
                                                       {"Name": "vpc-id", "Values": [vpc_id]}])["SecurityGroups"]
        return groups[0]["GroupId"] if groups else None

    # --- capacity reservations -------------------------------------------------------------------

    def find_reservation(self, value: str, regions: Optional[list[str]] = None) -> ReservationLookup:
        """The Capacity Reservation or Capacity Block ``value`` (``cr-…``), looked for in ``regions`` (default:
        configured), whatever its state: the matching says why one cannot be used."""
        regions = list(regions or self.regions)
        if not AWS_ID.match(value):
            return ReservationLookup(name=value, notes=["aws: not an EC2 Capacity Reservation id (cr-…)"])
        found = [r for r in (self.reservation(region, value) for region in regions) if r is not None]
        return ReservationLookup(name=value, found=found,
                                 notes=[] if found else [f"aws: not found in {', '.join(regions) or 'any region'}"])

    def reservation(self, region: str, reservation_id: str) -> Optional[Reservation]:
        """The reservation as EC2 describes it now; None if ``region`` has none of that id."""
        try:
            with api_errors(f"DescribeCapacityReservations {reservation_id} in {region}"):
                raws = self.client(region).describe_capacity_reservations(
                    CapacityReservationIds=[reservation_id])["CapacityReservations"]
        except CloudError as e:
            if e.code in _NO_RESERVATION:
                return None
            raise
        if not raws:
            return None
        raw = raws[0]
        total, free = raw.get("TotalInstanceCount", 0), raw.get("AvailableInstanceCount", 0)
        return Reservation(backend="aws", name=reservation_id, region=region, zone=raw["AvailabilityZone"],
                           instance_type=raw["InstanceType"], tenancy=raw.get("Tenancy") or "default",
                           kind=_RESERVATION_KINDS.get(raw.get("ReservationType") or "default", "capacity-reservation"),
                           state=raw["State"], total=total, in_use=max(total - free, 0))

    # --- the backend interface ------------------------------------------------------------------

    def create(self, job: JobSpec, offer: InstanceOffer, key: str, *, nvcc: bool = False) -> CloudInstance:
        """RunInstances for one offer under ``key``, in each of the offer's zones (its default subnet there) until
        one has capacity; raises CloudError (capacity once every zone lacked it; quota, transient, fatal at once).

        One key in every zone is safe: RunInstances' idempotency is zonal when a zone is given, and a retry walks
        the zones in the same order, so it meets the zone whose launch it repeats before any other."""
        region = offer.region
        reserved = self._reserved(offer)
        image = self._ami(region, offer)
        vpc = self._vpc(region)
        group_id = self._security_group(region, vpc, job)
        zones = self._subnets(region, vpc, [reserved.zone] if reserved else offer.zones)
        exhausted = []
        for zone, subnet in zones or [(None, None)]:
            try:
                return self._create_in(job, offer, key, image, group_id, zone, subnet, reserved)
            except CloudError as e:
                if e.kind is not ErrorKind.CAPACITY or e.code == "IdempotentInstanceTerminated":
                    raise
                exhausted.append(f"{zone}: {e.code}")
                if len(zones) <= 1:
                    raise
        raise CloudError(ErrorKind.CAPACITY, _short(f"no capacity for {offer.instance_type} in any zone of {region} "
                                                    f"({'; '.join(exhausted)})"),
                         code=exhausted[-1].split(": ", 1)[-1] if exhausted else "NoZones")

    def _reserved(self, offer: InstanceOffer) -> Optional[Reservation]:
        """The offer's reservation as EC2 describes it now: its zone, its kind and its tenancy decide the launch.
        Gone meanwhile: CAPACITY, with EC2's code (the walk moves on, and ends saying so)."""
        if not offer.reservation:
            return None
        found = self.reservation(offer.region, offer.reservation)
        if found is None:
            raise CloudError(ErrorKind.CAPACITY, f"capacity reservation {offer.reservation} not found in "
                             f"{offer.region}", code="InvalidCapacityReservationId.NotFound")
        return found

    def _subnets(self, region: str, vpc: dict, zones: list[str]) -> list[tuple[str, str]]:
        """(zone, subnet) to try, one subnet per zone (RunInstances' idempotency is zonal), in the offer's zone
        order (or, for an offer without zones, by zone): the configured ``subnet_ids`` of the VPC; else its
        subnets — in the default VPC the default subnet of each zone. Empty, in the default VPC without
        ``subnet_ids``: launch without a subnet (EC2 picks). A configured VPC or subnets with none in these zones
        raise CAPACITY (``NoSubnet``): the walk moves to an offer elsewhere."""
        configured = bool(self.config.subnet_ids) or not vpc.get("IsDefault", False)
        if not zones and not configured:
            return []
        filters = [{"Name": "vpc-id", "Values": [vpc["VpcId"]]}]
        if zones:
            filters.append({"Name": "availability-zone", "Values": list(zones)})
        if not configured:
            filters.append({"Name": "default-for-az", "Values": ["true"]})
        with api_errors("DescribeSubnets"):
            subnets = self.client(region).describe_subnets(Filters=filters)["Subnets"]
        if self.config.subnet_ids:
            rank = {s: n for n, s in enumerate(self.config.subnet_ids)}
            subnets = sorted((s for s in subnets if s["SubnetId"] in rank), key=lambda s: rank[s["SubnetId"]])
        else:
            subnets = sorted(subnets, key=lambda s: s["SubnetId"])
        by_zone: dict[str, str] = {}
        for subnet in subnets:
            by_zone.setdefault(subnet["AvailabilityZone"], subnet["SubnetId"])
        found = [(z, by_zone[z]) for z in (zones or sorted(by_zone)) if z in by_zone]
        if configured and not found:
            setting = "backends.aws.subnet_ids" if self.config.subnet_ids else "backends.aws.vpc_id"
            raise CloudError(ErrorKind.CAPACITY, f"no subnet of {vpc['VpcId']} ({setting}) in "
                             f"{', '.join(zones) if zones else region}", code="NoSubnet")
        return found

    def _create_in(self, job: JobSpec, offer: InstanceOffer, key: str, image: dict, group_id: str,
                   zone: Optional[str], subnet: Optional[str], reserved: Optional[Reservation] = None
                   ) -> CloudInstance:
        region = offer.region
        tags = [{"Key": k, "Value": v} for k, v in self._tags(job, key, image["ImageId"]).items()]
        # The root volume is at least the AMI's own snapshot (a smaller one is refused).
        root = image.get("RootDeviceName") or "/dev/sda1"
        snapshot = next((m.get("Ebs", {}).get("VolumeSize") or 0 for m in image.get("BlockDeviceMappings", [])
                         if m.get("DeviceName") == root), 0)
        params: dict[str, Any] = dict(
            ImageId=image["ImageId"], InstanceType=offer.instance_type, MinCount=1, MaxCount=1, ClientToken=key,
            UserData=cloud_init(job, gpu=offer.gpu_count > 0, keys=self._boot_keys(key)),
            # IMDSv2 only, one hop: the container (one hop further) cannot reach the metadata service.
            MetadataOptions={"HttpTokens": "required", "HttpPutResponseHopLimit": 1, "HttpEndpoint": "enabled"},
            BlockDeviceMappings=[{"DeviceName": root,
                                  "Ebs": {"VolumeSize": max(8, math.ceil(offer.disk_gb), int(snapshot)),
                                          "VolumeType": "gp3", "DeleteOnTermination": True}}],
            # A shutdown from inside must not leave a stopped instance (and its disk) behind.
            InstanceInitiatedShutdownBehavior="terminate",
            TagSpecifications=[{"ResourceType": "instance", "Tags": tags}, {"ResourceType": "volume", "Tags": tags}])
        if subnet:
            # The zone's subnet, and a public IP exactly when configured (not the subnet's default).
            params["Placement"] = {"AvailabilityZone": zone}
            params["NetworkInterfaces"] = [{"DeviceIndex": 0, "SubnetId": subnet, "Groups": [group_id],
                                            # An interface made at launch goes with the instance by default.
                                            "AssociatePublicIpAddress": self.config.public_ip}]
        else:
            params["SecurityGroupIds"] = [group_id]
        if offer.spot:
            params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
                "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
        if reserved is not None:
            params.update(_reservation_params(reserved, params.get("Placement", {})))
        try:
            with api_errors(f"RunInstances {offer.instance_type} in {zone or region}"):
                raw = self.client(region, run=True).run_instances(**params)["Instances"][0]
        except CloudError as e:
            if e.code == "IdempotentParameterMismatch":
                # Same key, other parameters: e.g. a newer AMI was published between a lost response and this
                # retry. The key is ours alone, so the instance under it is the one we launched: adopt it.
                found = self.find_key(region, key)
                if found:
                    return found.model_copy(update={"price": offer.price})
            if e.code == "InvalidGroup.NotFound":
                # The service's last teardown released its group after this launch had looked it up: the retry
                # makes it again.
                self._forget_groups(region, job.service)
                raise CloudError(ErrorKind.TRANSIENT, f"{e.message} (released by a teardown meanwhile; made again "
                                 "on the retry)", code=e.code) from e
            if e.kind is ErrorKind.QUOTA:
                e.scope = QuotaScope(backend="aws", region=region, spot_only=True) \
                    if e.code == "MaxSpotInstanceCountExceeded" else \
                    QuotaScope(backend="aws", region=region, quota_class=aws_quota_class(offer))
            raise
        return self._instance(raw, region, price=offer.price)

    def find_key(self, region: str, key: str) -> Optional[CloudInstance]:
        found = self._describe(region, [{"Name": f"tag:{TAGS['key']}", "Values": [key]}])
        return found[0] if found else None

    def find_replica(self, job: JobSpec, regions: Optional[list[str]] = None) -> list[CloudInstance]:
        """Live instances of this replica submission (any offer) in ``regions`` (default: all configured)."""
        filters = [{"Name": f"tag:{TAGS['service']}", "Values": [job.service]},
                   {"Name": f"tag:{TAGS['group']}", "Values": [job.group]},
                   {"Name": f"tag:{TAGS['replica']}", "Values": [replica_label(job.replica_num, job.submission_num)]}]
        return [i for r in (regions or self.regions) for i in self._describe(r, filters)]

    def list_tagged(self, regions: Optional[list[str]] = None, *, service: Optional[str] = None) -> list[CloudInstance]:
        """Every live durastack instance (of ``service`` if given) in ``regions`` (default: all configured)."""
        filters = [{"Name": "tag-key", "Values": [TAGS["key"]]}]
        if service:
            filters.append({"Name": f"tag:{TAGS['service']}", "Values": [service]})
        return [i for r in (regions or self.regions) for i in self._describe(r, filters)]

    def get(self, instance: CloudInstance) -> Optional[CloudInstance]:
        """The instance as it is now; None once it is gone (terminated or unknown)."""
        try:
            with api_errors("DescribeInstances"):
                res = self.client(instance.region).describe_instances(InstanceIds=[instance.instance_id])
        except CloudError as e:
            if e.code in _GONE:
                return None
            raise
        raws = [i for r in res["Reservations"] for i in r["Instances"]]
        if not raws or raws[0]["State"]["Name"] == "terminated":
            return None
        return self._instance(raws[0], instance.region, price=instance.price)

    def retag(self, instance: CloudInstance, job: JobSpec) -> None:
        """Tag a running instance for another submission of its service's group (an idle instance reused): from
        now on its replica owns it, and a retried launch adopts it by these tags."""
        label = replica_label(job.replica_num, job.submission_num)
        with api_errors(f"CreateTags on {instance.instance_id}"):
            self.client(instance.region).create_tags(Resources=[instance.instance_id], Tags=[
                {"Key": TAGS["replica"], "Value": label},
                {"Key": "Name", "Value": f"durastack-{job.service}-{job.group}-{label}"}])

    def terminate(self, instance: CloudInstance) -> None:
        """Terminate; an instance that is already gone is success."""
        try:
            with api_errors("TerminateInstances"):
                self.client(instance.region).terminate_instances(InstanceIds=[instance.instance_id])
        except CloudError as e:
            if e.code not in _GONE:
                raise

    # --- helpers ----------------------------------------------------------------------------------

    def _boot_keys(self, key: str) -> BootKeys:
        keys = self.ssh_keys or SSHKeys.of_home(_home())
        host = keys.host_key(key)
        return BootKeys(host_key=host.private_openssh, host_key_public=host.public_openssh,
                        authorized_key=keys.client_public())

    def _tags(self, job: JobSpec, key: str, image_id: str) -> dict[str, str]:
        return {"Name": f"durastack-{job.service}-{job.group}-r{job.replica_num}-s{job.submission_num}",
                TAGS["service"]: job.service, TAGS["group"]: job.group,
                TAGS["replica"]: replica_label(job.replica_num, job.submission_num), TAGS["key"]: key,
                TAGS["port"]: str(job.port), TAGS["host_key"]: HOST_KEY_AFTER_BOOT, TAGS["image"]: image_id} | \
            ({TAGS["installation"]: self.installation} if self.installation else {})

    def _describe(self, region: str, filters: list[dict]) -> list[CloudInstance]:
        filters = filters + [{"Name": "instance-state-name", "Values": LIVE_STATES}]
        with api_errors(f"DescribeInstances in {region}"):
            pages = self.client(region).get_paginator("describe_instances").paginate(Filters=filters)
            raws = [i for page in pages for r in page["Reservations"] for i in r["Instances"]]
        mine = (self._instance(raw, region) for raw in raws)  # another control plane's instances are not listed
        return sorted((i for i in mine if belongs(i.tags, "aws", self.installation)),
                      key=lambda i: (i.launched_at is None, i.launched_at, i.instance_id))

    def _instance(self, raw: dict, region: str, *, price: float = 0.0) -> CloudInstance:
        tags = {t["Key"]: t["Value"] for t in raw.get("Tags", [])}
        public, private = raw.get("PublicIpAddress") or "", raw.get("PrivateIpAddress") or ""
        # The address the gateway reaches, exec and logs too: the private one with data_path: private.
        ip = (public or private) if self.config.public_ip and self.config.data_path != "private" else private
        port = tags.get(TAGS["port"], "")
        return CloudInstance(
            backend="aws", instance_id=raw["InstanceId"], region=region,
            zone=raw.get("Placement", {}).get("AvailabilityZone", ""), instance_type=raw["InstanceType"],
            key=tags.get(TAGS["key"], ""), state=_STATES.get(raw["State"]["Name"], "pending"),
            spot=raw.get("InstanceLifecycle") == "spot", price=price,
            address=f"{ip}:{port}" if ip and port else "", private_ip=private, public_ip=public,
            launched_at=raw.get("LaunchTime"), tags=tags)


def _reservation_params(reserved: Reservation, placement: dict) -> dict[str, Any]:
    """Into that reservation only (EC2 refuses the launch if it cannot take it, rather than launching elsewhere); a
    Capacity Block with its own market type; the reservation's tenancy, which its instances must have."""
    params: dict[str, Any] = {"CapacityReservationSpecification": {
        "CapacityReservationTarget": {"CapacityReservationId": reserved.name}}}
    if reserved.kind == "capacity-block":
        params["InstanceMarketOptions"] = {"MarketType": "capacity-block"}
    if reserved.tenancy != "default":
        params["Placement"] = {**placement, "Tenancy": reserved.tenancy}
    return params


def _home():
    from backends.catalog import durastack_home
    return durastack_home()


def _config_file() -> str:
    import os

    from models.backends import config_path
    return str(config_path(os.environ))


__all__ = ["AWSBackend", "AMI_TTL"]
