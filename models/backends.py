"""Cloud backends (AWS, GCP): their configuration, provisioning keys and instances.

Pure: no I/O except ``load_backends_config`` reading ``$DURASTACK_HOME/config.yml``. The activities in
``backends/aws.py``, ``backends/gcp.py`` and ``activities/cloud.py`` do the cloud calls, and
``backends/cloud_errors.py`` classifies what they fail with.

Exactly-once provisioning rests on ``provisioning_key``: derived from (service, group, replica,
submission, offer) and never from the attempt, it is the AWS ClientToken and the GCE instance name,
so a retry after a lost response finds the instance the first attempt made.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from models.offers import InstanceOffer

CloudName = Literal["aws", "gcp"]
CLOUDS: tuple[CloudName, ...] = ("aws", "gcp")
DEFAULT_MAX_OFFERS = 25  # dstack's DSTACK_SERVER_MAX_OFFERS_TRIED
INSTALLATION_PATTERN = r"^[a-z0-9][a-z0-9-]{0,30}$"  # an AWS tag value and a GCP label value alike

# --- configuration ------------------------------------------------------------------------------

DataPath = Literal["ssh", "private"]
DATA_PATH_HELP = (
    "How the gateway reaches replicas. `ssh` (default): through an SSH tunnel; the firewall admits SSH (22) only. "
    "`private`: for a control plane inside the VPC (infra/): the gateway connects to `<private IP>:<port>` with no "
    "tunnel, and the firewall also admits the service port from `gateway_cidrs` (on AWS, or "
    "`gateway_security_group`) only; SSH still sends the job and its env, and serves exec and logs.")


# Where a VPC's addresses are: RFC 1918, the shared address space (100.64.0.0/10, which VPCs may use), IPv6 ULA.
PRIVATE_RANGES = tuple(ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
                                                         "100.64.0.0/10", "fc00::/7"))


def _private_cidrs(cloud: str, data_path: str, cidrs: list[str]) -> None:
    """``data_path: private`` cannot work from outside the VPC: every ``gateway_cidrs`` entry must be a private
    range (a public address, or 0.0.0.0/0, would also open the service port to the internet)."""
    if data_path != "private":
        return
    for cidr in cidrs:
        try:
            net = ipaddress.ip_network(cidr, strict=False)
        except ValueError as e:
            raise ValueError(f"backends.{cloud}.gateway_cidrs: {e}") from None
        if not any(net.version == r.version and net.subnet_of(r) for r in PRIVATE_RANGES):
            raise ValueError(f"backends.{cloud}.data_path: private needs the gateway inside the VPC, but "
                             f"gateway_cidrs has {cidr}, not within a private range (RFC 1918, 100.64.0.0/10); "
                             "use data_path: ssh for a gateway outside it")


class AWSConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    regions: list[str] = Field(default_factory=list, description="Regions to use; empty means every catalog region.")
    profile: Optional[str] = Field(None, description="AWS profile name; default is the standard credential chain.")
    ami_id: Optional[str] = Field(None, description="Use this AMI everywhere instead of looking one up by name.")
    gpu_ami_name: str = Field("Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) *", description=(
        "Name pattern of the AMI for x86 GPU instances (newest wins). AWS's Deep Learning Base OSS AMIs carry the "
        "NVIDIA driver, Docker and the NVIDIA Container Toolkit; the driver follows their releases (R580, then "
        "R595 in 2026: CUDA 12.8, 12.9 and 13.x images run on either). Pin one with "
        "`ami_id`; each cloud replica's events say which image it booted and which driver it runs."))
    gpu_arm_ami_name: str = Field("Deep Learning ARM64 Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) *",
                                  description="Name pattern of the AMI for arm GPU instances (as `gpu_ami_name`).")
    cpu_ami_name: str = Field("ubuntu/images/hvm-ssd/ubuntu-jammy-22.04-amd64-server-*",
                              description="Name pattern of the AMI for x86 CPU instances.")
    cpu_arm_ami_name: str = Field("ubuntu/images/hvm-ssd/ubuntu-jammy-22.04-arm64-server-*",
                                  description="Name pattern of the AMI for arm CPU instances.")
    ami_owners: list[str] = Field(["amazon", "099720109477"],
                                  description="Owners searched for AMIs (Amazon's DLAMI account, Canonical).")
    gateway_cidrs: list[str] = Field(default_factory=list, description=(
        "Where the gateway connects from (its SSH tunnels): SSH (22) is open to these only, and the service port "
        "to nobody. Empty: with `public_ip` (the default) SSH is open to 0.0.0.0/0, as dstack does (key-only "
        "login, host keys pinned), since the gateway reaches the public address from wherever it runs; set its "
        "public address, `[203.0.113.7/32]`, to narrow that. Empty with `public_ip: false`: the VPC's own CIDR "
        "(a gateway inside the VPC)."))
    ssh_cidrs: list[str] = Field(default_factory=list, description="Also admit SSH (22) from these (operators).")
    public_ip: bool = Field(True, description="Address replicas by public IP (else private IP).")
    vpc_id: Optional[str | dict[str, str]] = Field(None, description=(
        "The VPC to launch in: an id (`vpc-0abc…`) when one region is configured, else a mapping region → id. "
        "Unset (or a region it does not name): the region's default VPC, and an error naming this setting in a "
        "region without one."))
    subnet_ids: list[str] = Field(default_factory=list, description=(
        "Subnets to launch in (ids of any configured region; each region uses those of its VPC), one zone after "
        "another on a capacity error. Empty: the default subnet of each zone in the default VPC, or every subnet "
        "of a configured `vpc_id`. With `public_ip`, their route table needs an internet gateway."))

    # --- the private data path (a control plane inside the VPC) ---
    data_path: DataPath = Field("ssh", description=DATA_PATH_HELP)
    gateway_security_group: Optional[str] = Field(None, pattern=r"^sg-[0-9a-f]{1,32}$", description=(
        "With `data_path: private`: the gateway's security group (sg-…), admitted to the service port "
        "(with `gateway_cidrs`, if any)."))

    @model_validator(mode="after")
    def _private_path(self) -> "AWSConfig":
        if self.data_path == "private" and not (self.gateway_cidrs or self.gateway_security_group):
            raise ValueError("backends.aws.data_path: private needs gateway_cidrs or gateway_security_group: the "
                             "service port is opened to the gateway alone, never to the whole VPC")
        if self.gateway_security_group and self.data_path != "private":
            raise ValueError("backends.aws.gateway_security_group is used only with data_path: private (the SSH "
                             "data path admits gateway_cidrs)")
        _private_cidrs("aws", self.data_path, self.gateway_cidrs)
        return self

    @model_validator(mode="after")
    def _one_region_for_a_bare_vpc_id(self) -> "AWSConfig":
        if isinstance(self.vpc_id, str) and len(self.regions) != 1:
            raise ValueError("backends.aws.vpc_id: a VPC id belongs to one region; configure exactly one region "
                             "in `regions`, or give a mapping region → VPC id")
        return self

    def vpc_for(self, region: str) -> Optional[str]:
        """The configured VPC of ``region``; None: its default VPC."""
        if isinstance(self.vpc_id, dict):
            return self.vpc_id.get(region)
        return self.vpc_id if self.vpc_id and region in self.regions else None


# A Compute image as the API takes it: its URL, `projects/P/global/images/[family/]N`, or `global/images/…` (the
# instance's own project).
_IMAGE = re.compile(r"^(?:https://[a-z.]+/compute/v1/)?(?:projects/(?P<project>[a-z][-a-z0-9.:]*)/)?global/images/"
                    r"(?P<family>family/)?(?P<name>[a-z](?:[-a-z0-9]*[a-z0-9])?)$")


def image_ref(value: str, project: str) -> Optional[tuple[str, Optional[str], Optional[str]]]:
    """(project, family, image) of a Compute image reference (one of family and image set); None: not one."""
    m = _IMAGE.match(value)
    if m is None:
        return None
    name = m.group("name")
    return (m.group("project") or project, name if m.group("family") else None, None if m.group("family") else name)


class GCPConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    project_id: str = Field(min_length=1, description="GCP project to create instances in.")
    regions: list[str] = Field(default_factory=list, description="Regions to use; empty means every catalog region.")
    endpoint: Optional[str] = Field(None, description=(
        "Compute API endpoint, e.g. http://127.0.0.1:PORT for a fake (DURASTACK_GCP_ENDPOINT); unset for Google."))
    gpu_image: str = Field(
        "projects/deeplearning-platform-release/global/images/family/common-cu129-ubuntu-2404-nvidia-580", description=(
            "Boot image of GPU instances: `projects/P/global/images/family/F` (the family's newest image that is "
            "not deprecated, looked up before each launch) or `projects/P/global/images/NAME` (that image). "
            "The default, a Deep Learning VM family, names its NVIDIA driver branch: R580, a long-term branch "
            "supported until August 2028, which runs CUDA 12.x and 13.0 images. A family or image that does not "
            "exist fails the launch naming this setting. Each cloud replica's events say which image it booted "
            "and which driver it runs."))
    cpu_image: str = Field("projects/ubuntu-os-cloud/global/images/family/ubuntu-2204-lts",
                           description="Boot image of CPU instances (as `gpu_image`).")
    network: str = Field("global/networks/default", description="VPC network of the instances.")
    gateway_cidrs: list[str] = Field(default_factory=list, description=(
        "Where the gateway connects from: the firewall rule for durastack's network tag opens SSH (22) to these "
        "only, and the service port to nobody. Empty: with `public_ip` (the default) 0.0.0.0/0, as dstack does "
        "(key-only login, host keys pinned), since the gateway reaches the external address from wherever it "
        "runs; set its public address, `[203.0.113.7/32]`, to narrow that. Empty with `public_ip: false`: the "
        "private ranges of the VPC (10.0.0.0/8)."))
    public_ip: bool = Field(True, description="Give instances an external IP and address replicas by it.")
    operation_timeout: float = Field(300.0, gt=0, description="Seconds to wait for an insert/delete operation.")
    # --- the private data path (a control plane inside the VPC) ---
    data_path: DataPath = Field("ssh", description=DATA_PATH_HELP)

    @field_validator("gpu_image", "cpu_image")
    @classmethod
    def _an_image(cls, value: str, info) -> str:
        if image_ref(value, "-") is None:
            raise ValueError(f"backends.gcp.{info.field_name}: {value!r} names no Compute image: give "
                             "projects/PROJECT/global/images/family/FAMILY or projects/PROJECT/global/images/NAME")
        return value

    @model_validator(mode="after")
    def _private_path(self) -> "GCPConfig":
        if self.data_path == "private" and not self.gateway_cidrs:
            raise ValueError("backends.gcp.data_path: private needs gateway_cidrs (the gateway's private "
                             "addresses): the service port is opened to the gateway alone, never to the whole VPC")
        _private_cidrs("gcp", self.data_path, self.gateway_cidrs)
        return self


class BackendsConfig(BaseModel):
    """The ``backends:`` of ``$DURASTACK_HOME/config.yml`` (plus ``max_offers``), after env overrides."""

    model_config = ConfigDict(extra="forbid")

    aws: Optional[AWSConfig] = Field(None, description="AWS EC2; None when not configured.")
    gcp: Optional[GCPConfig] = Field(None, description="GCP Compute Engine; None when not configured.")
    max_offers: int = Field(DEFAULT_MAX_OFFERS, ge=1, description="Offers tried per replica before giving up.")
    installation: Optional[str] = Field(
        None, pattern=INSTALLATION_PATTERN,
        description="This control plane's id (DURASTACK_INSTALLATION), tagged on every instance it makes: it "
                    "adopts, stops and reaps only its own instances (and untagged ones from older versions), so "
                    "several control planes can share a cloud account. Unset: see `connect.installation`.")

    def configured(self) -> list[str]:
        """Backends in use: the configured clouds, then ``local`` (always available)."""
        return [c for c in CLOUDS if getattr(self, c) is not None] + ["local"]

    def allows(self, offer: InstanceOffer) -> bool:
        """Whether ``offer`` is on a configured backend and, if regions are configured, in one of them."""
        if offer.backend == "local":
            return True
        cfg = getattr(self, offer.backend, None)
        return cfg is not None and (not cfg.regions or offer.region in cfg.regions)

    def summary(self) -> str:
        """One line for ``durastack offers``, e.g. ``backends: aws (us-east-1), gcp (my-proj: all regions), local``."""
        parts = []
        if self.aws:
            parts.append(f"aws ({', '.join(self.aws.regions) or 'all regions'})")
        if self.gcp:
            parts.append(f"gcp ({self.gcp.project_id}: {', '.join(self.gcp.regions) or 'all regions'})")
        if not parts:
            return "backends: local only (no aws or gcp in config.yml)"
        return "backends: " + ", ".join(parts + ["local"])


def gpu_image_lines(config: BackendsConfig) -> list[str]:
    """What each configured cloud's GPU instances boot, one line each (``durastack offers``)."""
    lines = []
    if config.aws:
        a = config.aws
        lines.append(f"aws GPU instances boot {a.ami_id}" if a.ami_id else
                     f"aws GPU instances boot the newest AMI named {a.gpu_ami_name!r} (arm: {a.gpu_arm_ami_name!r}) "
                     "with the NVIDIA driver its release ships")
    if config.gcp:
        project, family, name = image_ref(config.gcp.gpu_image, config.gcp.project_id) or ("", None, None)
        branch = re.search(r"-nvidia-(\d+)", family or name or "")
        lines.append(f"gcp GPU instances boot {'the newest image of family ' + family if family else name} of "
                     f"project {project}" + (f" (NVIDIA driver R{branch.group(1)})" if branch else ""))
    return lines


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def config_path(environ: Mapping[str, str]) -> Path:
    home = environ.get("DURASTACK_HOME") or str(Path.home() / ".durastack")
    return Path(home).expanduser() / "config.yml"


def backends_config_from(data: Mapping[str, Any], environ: Mapping[str, str]) -> BackendsConfig:
    """Build the config from the parsed config.yml and apply env overrides.

    DURASTACK_AWS_REGIONS / DURASTACK_GCP_PROJECT (enable a cloud), DURASTACK_GCP_REGIONS, DURASTACK_GCP_ENDPOINT,
    DURASTACK_AWS_AMI, DURASTACK_MAX_OFFERS, and DURASTACK_BACKENDS (comma list; keeps only these).
    """
    backends = dict(data.get("backends") or {})
    aws = dict(backends.get("aws") or {}) if "aws" in backends else None
    gcp = dict(backends.get("gcp") or {}) if "gcp" in backends else None
    if environ.get("DURASTACK_AWS_REGIONS"):
        aws = {**(aws or {}), "regions": _csv(environ["DURASTACK_AWS_REGIONS"])}
    if aws is not None and environ.get("DURASTACK_AWS_AMI"):
        aws["ami_id"] = environ["DURASTACK_AWS_AMI"]
    if environ.get("DURASTACK_GCP_PROJECT"):
        gcp = {**(gcp or {}), "project_id": environ["DURASTACK_GCP_PROJECT"]}
    if gcp is not None:
        if environ.get("DURASTACK_GCP_REGIONS"):
            gcp["regions"] = _csv(environ["DURASTACK_GCP_REGIONS"])
        if environ.get("DURASTACK_GCP_ENDPOINT"):
            gcp["endpoint"] = environ["DURASTACK_GCP_ENDPOINT"]
    if environ.get("DURASTACK_BACKENDS"):
        keep = set(_csv(environ["DURASTACK_BACKENDS"]))
        aws = aws if "aws" in keep else None
        gcp = gcp if "gcp" in keep else None
    max_offers = environ.get("DURASTACK_MAX_OFFERS") or data.get("max_offers") or DEFAULT_MAX_OFFERS
    installation = environ.get("DURASTACK_INSTALLATION") or data.get("installation")
    return BackendsConfig.model_validate({"aws": aws, "gcp": gcp, "max_offers": max_offers,
                                          "installation": installation})


def belongs(tags: Mapping[str, str], backend: str, installation: Optional[str]) -> bool:
    """Whether an instance with these tags/labels is this control plane's: tagged with its id, or untagged
    (made before installations were tagged). A backend made without an id sees every instance."""
    tagged = tags.get(TAG_NAMES[backend]["installation"])
    return not installation or tagged is None or tagged == installation


def load_backends_config(environ: Mapping[str, str], path: Optional[Path] = None) -> BackendsConfig:
    """Read config.yml (``path`` or ``$DURASTACK_HOME/config.yml``; missing means none) and apply ``environ``."""
    from ruamel.yaml import YAML

    path = path or config_path(environ)
    data: Any = {}
    if path.is_file():
        data = YAML(typ="safe").load(path.read_text(encoding="utf-8")) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
    return backends_config_from(data, environ)


# --- provisioning key, tags ---------------------------------------------------------------------

KEY_MAX = 63  # GCE names and label values: [a-z]([-a-z0-9]{0,61}[a-z0-9])?; the ClientToken limit is 64
_HASH_LEN = 12


def slug(value: str, limit: int = 63) -> str:
    """Lowercase ``[a-z0-9-]``, as GCE names and labels allow; ``x`` if nothing is left."""
    s = re.sub(r"-+", "-", re.sub(r"[^a-z0-9]", "-", value.lower())).strip("-")
    return s[:limit].rstrip("-") or "x"


def provisioning_key(service: str, group: str, replica_num: int, submission_num: int,
                     offer: InstanceOffer, installation: Optional[str] = None) -> str:
    """``ds-<service>-<group>-r<N>s<M>-<type>-<region>-<hash>``: deterministic, ≤ 63 chars of ``[a-z0-9-]``.

    The hash covers every input exactly (the readable parts are lossy), including what tells two offers of
    one type apart (GPU model and count for GCP N1, spot). The zone is not in it: one key per offer, and the
    backends look the key up in every zone before creating, so at most one instance exists per key.
    ``installation`` keeps two control planes' same-named services apart (absent: the keys of older versions).
    """
    parts = [service, group, replica_num, submission_num, offer.backend, offer.instance_type,
             offer.region, offer.spot, offer.gpu_name, offer.gpu_count] + ([installation] if installation else [])
    ident = json.dumps(parts, separators=(",", ":"))
    digest = hashlib.sha256(ident.encode()).hexdigest()[:_HASH_LEN]
    head = "-".join(["ds", slug(service, 10), slug(group, 8), f"r{replica_num}s{submission_num}",
                     slug(offer.instance_type, 14), slug(offer.region, 12)])
    head = head[:KEY_MAX - _HASH_LEN - 1].rstrip("-")
    return f"{head}-{digest}"


def replica_label(replica_num: int, submission_num: int) -> str:
    return f"r{replica_num}-s{submission_num}"


# Tag (AWS) and label (GCP) names; GCP label keys cannot hold ':'.
TAG_NAMES: dict[str, dict[str, str]] = {
    "aws": {"service": "durastack:service", "group": "durastack:group", "replica": "durastack:replica",
            "key": "durastack:key", "port": "durastack:port", "installation": "durastack:installation",
            "host_key": "durastack:host-key", "image": "durastack:image"},
    "gcp": {"service": "durastack-service", "group": "durastack-group", "replica": "durastack-replica",
            "key": "durastack-key", "port": "durastack-port", "installation": "durastack-installation",
            "host_key": "durastack-host-key", "image": "durastack-image"},
}


# The tag value of an instance whose boot host key durastack replaces once it has booted (ssh.replace_host_key):
# from then on, only the replacement is trusted. Instances made before it have no such tag and keep their boot key.
HOST_KEY_AFTER_BOOT = "after-boot"


def owner(backend: str, service: str, group: str, replica_num: int, submission_num: int) -> tuple[str, str, str]:
    """(service, group, replica) as ``CloudInstance.owner`` reads them back from ``backend``'s tags/labels.

    GCP labels are lowercased slugs, so compare through this function, never with raw names.
    """
    if backend == "gcp":
        return slug(service), slug(group), replica_label(replica_num, submission_num)
    return service, group, replica_label(replica_num, submission_num)


# --- instances ----------------------------------------------------------------------------------

InstanceState = Literal["pending", "running", "stopping", "stopped", "terminated"]


class CloudInstance(BaseModel):
    """A cloud VM made for a replica. Travels through Temporal history: no secrets, no user-data."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["cloud"] = "cloud"
    backend: CloudName = Field(description="aws or gcp.")
    instance_id: str = Field(description="AWS instance id (i-…), or GCE instance name.")
    region: str = Field(description="Region, e.g. us-east-1 or us-central1.")
    zone: str = Field("", description="Availability zone / GCE zone.")
    instance_type: str = Field(description="Instance / machine type.")
    key: str = Field(description="Provisioning key (ClientToken / GCE name) it was created with.")
    state: InstanceState = Field(description="Normalised state: pending, running, stopping, stopped, terminated.")
    spot: bool = Field(False, description="Spot / SPOT provisioning model.")
    price: float = Field(0.0, description="Hourly price of the offer it came from, USD; 0 when unknown (listed).")
    address: str = Field("", description="ip:port the gateway reaches the app at (public IP if used, else private; "
                                         "private with data_path: private).")
    private_ip: str = Field("", description="Private IP, when assigned.")
    public_ip: str = Field("", description="Public IP, when assigned.")
    launched_at: Optional[datetime] = Field(None, description="Launch / creation time reported by the cloud.")
    tags: dict[str, str] = Field(default_factory=dict, description="AWS tags / GCE labels.")

    @property
    def host_key_after_boot(self) -> bool:
        """Whether its boot host key is replaced once it has booted (``HOST_KEY_AFTER_BOOT``)."""
        return self.tags.get(TAG_NAMES[self.backend]["host_key"]) == HOST_KEY_AFTER_BOOT

    @property
    def image(self) -> str:
        """What it booted, as tagged at launch: the AMI id, or the GCE image's name; '' when made without it."""
        return self.tags.get(TAG_NAMES[self.backend]["image"], "")

    @property
    def owner(self) -> tuple[str, str, str]:
        """(service, group, ``r<N>-s<M>``) from the tags; compare with ``owner(...)``."""
        names = TAG_NAMES[self.backend]
        service, group, replica = (self.tags.get(names[n], "") for n in ("service", "group", "replica"))
        return service, group, replica


__all__ = ["AWSConfig", "BackendsConfig", "CLOUDS", "CloudInstance", "GCPConfig", "HOST_KEY_AFTER_BOOT", "TAG_NAMES", "backends_config_from",
           "config_path", "gpu_image_lines", "image_ref", "load_backends_config", "owner", "provisioning_key",
           "replica_label", "slug"]
