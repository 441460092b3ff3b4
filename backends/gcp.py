"""GCP Compute Engine backend (google-cloud-compute, REST): launch, find, list, delete. Blocking.

Exactly once: the instance name *is* the provisioning key, and the insert's ``requestId`` is a uuid5 of it
and the zone, so a retried insert either returns the first operation or gets 409 and adopts the instance.
``insert_unary`` + our own ZoneOperationsClient, never ``insert().result()``: the latter polls
compute.googleapis.com whatever endpoint was configured (cloud-testing.md 2.1).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import threading
import time
import uuid
from datetime import datetime
from typing import Iterator, Optional

import requests
from google.api_core import exceptions as gexc
from google.api_core import retry as gretry
from google.api_core.client_options import ClientOptions
from google.auth import exceptions as auth_exc
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1

from backends.cloud import CloudBackend
from backends.cloud_errors import GCP_RESERVATION, CloudError, ErrorKind, QuotaScope, classify_gcp
from backends.quota import RegionQuotas
from backends.ssh_keys import SSHKeys
from backends.userdata import BootKeys, startup_script
from models.backends import (HOST_KEY_AFTER_BOOT, TAG_NAMES, CloudInstance, GCPConfig, belongs, image_ref,
                             replica_label, slug)
from models.offers import InstanceOffer
from models.replica import JobSpec
from models.reservations import N1_ACCELERATORS as ACCELERATORS
from models.reservations import Reservation, ReservationLookup, gcp_reservation

LABELS = TAG_NAMES["gcp"]
log = logging.getLogger(__name__)
REQUEST_NS = uuid.UUID("5b0c8a52-8a5e-4d0e-9a3c-6f1f1d2c7a10")  # durastack's uuid5 namespace for requestIds
IMAGE_TTL = 600.0  # a family's newest image is looked up again after this long (the AMI lookup's 10 minutes)
RESERVATION_KEY = "compute.googleapis.com/reservation-name"  # how an instance targets a specific reservation
_STATES = {"PROVISIONING": "pending", "STAGING": "pending", "RUNNING": "running", "REPAIRING": "running",
           "STOPPING": "stopping", "SUSPENDING": "stopping", "STOPPED": "stopped", "SUSPENDED": "stopped",
           "TERMINATED": "stopped"}  # GCE's TERMINATED is a stopped VM (its disk still bills)
_READ_RETRY = gretry.Retry(predicate=gretry.if_exception_type(gexc.ServiceUnavailable, gexc.DeadlineExceeded),
                           initial=0.5, maximum=5.0, timeout=30.0)


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _reasons(e: gexc.GoogleAPICallError) -> list[str]:
    return [str(err.get("reason", "")) for err in (e.errors or []) if isinstance(err, dict)]


@contextlib.contextmanager
def api_errors(what: str) -> Iterator[None]:
    """API/auth/network errors → CloudError, classified by reason strings first, then the HTTP status."""
    try:
        yield
    except gexc.GoogleAPICallError as e:
        reasons, status = _reasons(e), int(e.code or 500)
        code = next((r for r in reasons if r), type(e).__name__)
        # The REST transport prefixes the message with the method and URL; the error's own message is enough.
        message = next((err.get("message") for err in (e.errors or []) if isinstance(err, dict) and err.get("message")),
                       e.message)
        raise CloudError(classify_gcp(reasons, status, (message,)), _short(f"{what}: {code}: {message}"),
                         code=code) from e
    except (auth_exc.DefaultCredentialsError, auth_exc.RefreshError) as e:
        raise CloudError(ErrorKind.FATAL, f"{what}: GCP credentials: {e}", code=type(e).__name__) from e
    except (gexc.RetryError, requests.exceptions.RequestException, auth_exc.TransportError) as e:
        raise CloudError(ErrorKind.TRANSIENT, _short(f"{what}: {e}"), code=type(e).__name__) from e


def _zone_lacks_it(e: CloudError) -> bool:
    """The zone does not exist or lacks the machine or accelerator type (400 invalid; 404 notFound for a resource
    under zones/), or the project's network profile keeps it out of the zone: the next zone may have it."""
    return (e.code == "invalid" and ("Unknown zone" in e.message or "does not exist in zone" in e.message
                                     or "only allows resource creation in location" in e.message)) or \
        (e.code == "notFound" and "/zones/" in e.message)


def _zone_failure(e: CloudError) -> str:
    """What the walk says of a zone: the code, or for a reservation's refusal (whose codes other failures share)
    Compute's message."""
    if any(r in e.message for r in GCP_RESERVATION):
        return e.message.split(": ", 1)[-1]
    return e.code + (" (not in this zone)" if _zone_lacks_it(e) else "")


def _home():
    from backends.catalog import durastack_home
    return durastack_home()


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


class GCPBackend(CloudBackend):
    name = "gcp"

    def __init__(self, config: GCPConfig, *, regions: Optional[list[str]] = None, credentials=None,
                 installation: Optional[str] = None, ssh_keys: Optional[SSHKeys] = None):
        """``regions``: used when the config names none. ``credentials``: default is application default
        credentials — or anonymous for a plain-http endpoint (a fake), so real tokens never go over http.
        ``installation``: the control plane's id (``BackendsConfig.installation``)."""
        self.config = config
        self.installation = installation
        self.ssh_keys = ssh_keys
        self._firewall_ready = False
        self._service_rules: set[str] = set()  # services whose own rules are made
        self.project = config.project_id
        self.regions = list(config.regions or regions or [])
        self._credentials = credentials
        self._lock = threading.Lock()
        self._instances: Optional[compute_v1.InstancesClient] = None
        self._operations: Optional[compute_v1.ZoneOperationsClient] = None
        self._firewalls: Optional[compute_v1.FirewallsClient] = None
        self._global_operations: Optional[compute_v1.GlobalOperationsClient] = None
        self._regions: Optional[compute_v1.RegionsClient] = None
        self.quotas = RegionQuotas("gcp", self.quota_limits)
        self._images: Optional[compute_v1.ImagesClient] = None
        self._boot_images: dict[str, tuple[float, str]] = {}  # configured image → (until, the image it names)
        self._reservations: Optional[compute_v1.ReservationsClient] = None

    def clients(self) -> tuple[compute_v1.InstancesClient, compute_v1.ZoneOperationsClient]:
        with self._lock:
            if self._instances is None:
                endpoint = self.config.endpoint
                opts = ClientOptions(api_endpoint=endpoint) if endpoint else None
                creds = self._credentials
                if creds is None and endpoint and endpoint.startswith("http://"):
                    creds = AnonymousCredentials()
                with api_errors("GCP client"):
                    self._instances = compute_v1.InstancesClient(credentials=creds, transport="rest",
                                                                 client_options=opts)
                    self._operations = compute_v1.ZoneOperationsClient(credentials=creds, transport="rest",
                                                                       client_options=opts)
                    self._firewalls = compute_v1.FirewallsClient(credentials=creds, transport="rest",
                                                                 client_options=opts)
                    self._global_operations = compute_v1.GlobalOperationsClient(
                        credentials=creds, transport="rest", client_options=opts)
                    self._regions = compute_v1.RegionsClient(credentials=creds, transport="rest", client_options=opts)
                    self._images = compute_v1.ImagesClient(credentials=creds, transport="rest", client_options=opts)
                    self._reservations = compute_v1.ReservationsClient(credentials=creds, transport="rest",
                                                                       client_options=opts)
            return self._instances, self._operations

    def quota_limits(self, region: str) -> dict[str, float]:
        """The region's quota limits by metric (regions.get's ``quotas``; backends/quota.py). Needs
        ``compute.regions.get``; the caller treats any error as unknown."""
        self.clients()
        with api_errors(f"get region {region}"):
            raw = self._regions.get(project=self.project, region=region, retry=_READ_RETRY)
        return {q.metric: q.limit for q in raw.quotas}

    def _boot_image(self, gpu: bool) -> str:
        """``projects/P/global/images/NAME``: the image ``gpu_image`` (or ``cpu_image``) names now, a family's newest
        one that is not deprecated. One that does not exist (a retired family) is FATAL and names the setting: every
        launch would fail alike, and only a new setting mends it."""
        setting = "gpu_image" if gpu else "cpu_image"
        value = getattr(self.config, setting)
        hit = self._boot_images.get(value)
        if hit and hit[0] > time.monotonic():
            return hit[1]
        project, family, name = image_ref(value, self.project)
        self.clients()
        try:
            with api_errors(f"image {value}"):
                image = self._images.get_from_family(project=project, family=family, retry=_READ_RETRY) if family \
                    else self._images.get(project=project, image=name, retry=_READ_RETRY)
        except CloudError as e:
            if e.code != "notFound":
                raise
            image = None
        state = image.deprecated.state if image is not None and "deprecated" in image else ""
        if image is None or state in ("OBSOLETE", "DELETED"):
            what = f"image family {family}" if family else (f"image {name}" + (f" ({state.lower()})" if state else ""))
            raise CloudError(ErrorKind.FATAL, f"backends.gcp.{setting}: no {what} in project {project} (retired?): "
                             f"set backends.gcp.{setting} to a current one", code="NoImage")
        if state:
            log.warning("GCP: backends.gcp.%s is %s (%s)", setting, state.lower(), image.name)
        path = f"projects/{project}/global/images/{image.name}"
        self._boot_images[value] = (time.monotonic() + IMAGE_TTL, path)
        return path

    # --- the firewall rule for durastack's network tag ------------------------------------------------

    @property
    def network_tag(self) -> str:
        """The tag durastack's instances carry and its firewall rule targets (one per control plane)."""
        return slug(f"durastack-{self.installation}" if self.installation else "durastack-ssh", 63)

    @property
    def firewall_name(self) -> str:
        return slug(f"{self.network_tag}-ssh", 63)

    def gateway_sources(self) -> list[str]:
        """Where SSH (22) is admitted from: ``gateway_cidrs``; without them and with an external IP, anywhere, as
        dstack does (the gateway dials the external address from wherever it runs; key-only login, host keys
        pinned); without an external IP, the VPC's private ranges."""
        if self.config.gateway_cidrs:
            return sorted(set(self.config.gateway_cidrs))
        return ["0.0.0.0/0"] if self.config.public_ip else ["10.0.0.0/8"]

    def service_tag(self, service: str) -> str:
        """The network tag of ``service``'s instances, also the name of the rule that lets them reach each other:
        ``<network_tag>-<service>-<hash>``, at most 63 chars of [a-z0-9-] (GCE's rule for both), the hash telling
        apart services whose names slug alike or are cut."""
        digest = hashlib.sha256(service.encode()).hexdigest()[:8]
        return f"{slug(f'{self.network_tag}-{service}', 54)}-{digest}"

    def _put_rule(self, rule: compute_v1.Firewall) -> None:
        """Insert the rule, or bring an existing one to it."""
        self.clients()
        try:
            with api_errors(f"firewall {rule.name}"):
                op = self._firewalls.insert_unary(project=self.project, firewall_resource=rule)
        except CloudError as e:
            if e.code != "alreadyExists":
                raise
            with api_errors(f"firewall {rule.name}"):
                op = self._firewalls.patch_unary(project=self.project, firewall=rule.name, firewall_resource=rule)
        self._wait_global(op, f"firewall {rule.name}")

    def _delete_rule(self, name: str) -> None:
        """Delete the rule; one already gone is success."""
        self.clients()
        try:
            with api_errors(f"delete firewall {name}"):
                op = self._firewalls.delete_unary(project=self.project, firewall=name)
        except CloudError as e:
            if e.code == "notFound":
                return
            raise
        self._wait_global(op, f"delete firewall {name}")

    def ensure_firewall(self) -> None:
        """The rule that lets the gateway's SSH (22) in to durastack's instances — and nothing else: the
        service port is reached through the tunnel. Made once; an existing rule is brought to these sources."""
        if self._firewall_ready:
            return
        sources = self.gateway_sources()
        if "0.0.0.0/0" in sources:
            log.warning("GCP: SSH (22) to durastack's instances is open to 0.0.0.0/0 (key-only login, host keys "
                        "pinned); set backends.gcp.gateway_cidrs to the gateway's address to narrow it")
        self._put_rule(compute_v1.Firewall(
            name=self.firewall_name, network=self.config.network, direction="INGRESS", priority=1000,
            description="durastack: SSH from the gateway to its replicas",
            target_tags=[self.network_tag], source_ranges=sources,
            allowed=[compute_v1.Allowed(I_p_protocol="tcp", ports=["22"])]))
        self._firewall_ready = True

    def gateway_rule(self, service: str) -> str:
        """``data_path: private``: the name of the rule that opens ``service``'s port to the gateway alone."""
        digest = hashlib.sha256(service.encode()).hexdigest()[:8]
        return f"{slug(f'{self.network_tag}-{service}', 51)}-gw-{digest}"

    def ensure_service_firewall(self, service: str, port: int) -> None:
        """The rule that lets the service's instances reach each other on their private IPs, on any TCP/UDP port
        (one network per service), and no one else: from its tag to its tag. With ``data_path: private`` also the
        service port from ``gateway_cidrs`` alone (the gateway connects to the private address, no tunnel). Made
        with its first instance."""
        if service in self._service_rules:
            return
        tag = self.service_tag(service)
        self._put_rule(compute_v1.Firewall(
            name=tag, network=self.config.network, direction="INGRESS", priority=1000,
            description=f"durastack: service {service}'s instances to each other",
            source_tags=[tag], target_tags=[tag],
            allowed=[compute_v1.Allowed(I_p_protocol="tcp"), compute_v1.Allowed(I_p_protocol="udp")]))
        if self.config.data_path == "private":
            self._put_rule(compute_v1.Firewall(
                name=self.gateway_rule(service), network=self.config.network, direction="INGRESS",
                priority=1000, description=f"durastack: the gateway to service {service}'s port (data_path: private)",
                target_tags=[tag], source_ranges=sorted(set(self.config.gateway_cidrs)),
                allowed=[compute_v1.Allowed(I_p_protocol="tcp", ports=[str(port)])]))
        self._service_rules.add(service)

    def release(self, service: str) -> None:
        """Remove the service's rules once none of its instances is left, and the SSH rule once no durastack
        instance of this control plane is left. GCE deletes a rule whatever instances it targets, so a launch
        may have checked the rules just before they went: the instances are listed again after each deletion
        (and ``create`` looks at the rules again after its insert), so one of the two always sees the other."""
        if self.list_tagged(service=service):
            return
        self._delete_rule(self.service_tag(service))
        self._delete_rule(self.gateway_rule(service))  # data_path: private (gone already is success)
        self._service_rules.discard(service)
        late = self.list_tagged(service=service)
        if late:
            self.ensure_service_firewall(service, int(late[0].tags.get(LABELS["port"]) or 0))
            return
        if self.list_tagged():
            return
        self._delete_rule(self.firewall_name)
        self._firewall_ready = False
        if self.list_tagged():
            self.ensure_firewall()

    def _rules_after_insert(self, job: JobSpec) -> None:
        """The rules again, now that the instance exists (see ``release``): any gone is made again."""
        names = [self.firewall_name, self.service_tag(job.service)]
        if self.config.data_path == "private":
            names.append(self.gateway_rule(job.service))
        if all(self._rule_exists(name) for name in names):
            return
        self._firewall_ready = False
        self._service_rules.discard(job.service)
        self.ensure_firewall()
        self.ensure_service_firewall(job.service, job.port)

    def _rule_exists(self, name: str) -> bool:
        self.clients()
        try:
            with api_errors(f"firewall {name}"):
                self._firewalls.get(project=self.project, firewall=name)
        except CloudError as e:
            if e.code == "notFound":
                return False
            raise
        return True

    def _wait_global(self, op: compute_v1.Operation, what: str) -> None:
        deadline = time.monotonic() + self.config.operation_timeout
        while compute_v1.Operation.Status(op.status).name != "DONE":
            if time.monotonic() > deadline:
                raise CloudError(ErrorKind.TRANSIENT, f"{what}: operation {op.name} still running", code="Timeout")
            with api_errors(f"{what} (operation)"):
                op = self._global_operations.wait(project=self.project, operation=op.name)
        if op.error and op.error.errors:
            codes = [e.code for e in op.error.errors]
            raise CloudError(classify_gcp(codes, int(op.http_error_status_code or 500)),
                             _short(f"{what}: " + "; ".join(f"{e.code}: {e.message}" for e in op.error.errors)),
                             code=codes[0])

    # --- the backend interface --------------------------------------------------------------------

    def create(self, job: JobSpec, offer: InstanceOffer, key: str, *, nvcc: bool = False) -> CloudInstance:
        """Insert in each of the offer's zones until one has capacity; raises CloudError."""
        self.ensure_firewall()
        self.ensure_service_firewall(job.service, job.port)
        instance = self._insert_in_a_zone(job, offer, key, nvcc)
        self._rules_after_insert(job)
        return instance

    def _insert_in_a_zone(self, job: JobSpec, offer: InstanceOffer, key: str, nvcc: bool) -> CloudInstance:
        zones = offer.zones or [f"{offer.region}-{z}" for z in "abc"]
        exhausted, code = [], "NoZones"
        for zone in zones:
            try:
                return self._create_in_zone(job, offer, key, zone, nvcc)
            except CloudError as e:
                if e.kind is ErrorKind.CAPACITY or _zone_lacks_it(e):
                    # No capacity there, or the zone does not exist or lacks the machine/accelerator type (the
                    # catalog can be out of date): the next zone, then the next offer, may have it.
                    exhausted.append(f"{zone}: {_zone_failure(e)}")
                    code = e.code
                    continue
                if e.kind is ErrorKind.QUOTA:
                    # GPUS_ALL_REGIONS is project-wide: no other region can help either.
                    # PREEMPTIBLE_* quotas count spot VMs only: on-demand offers there stay open.
                    e.scope = QuotaScope(backend="gcp", region=None if "ALL_REGIONS" in e.message else offer.region,
                                         spot_only="'PREEMPTIBLE_" in e.message)
                raise
        raise CloudError(ErrorKind.CAPACITY, _short(f"no capacity for {offer.instance_type} in any zone of "
                                                    f"{offer.region} ({'; '.join(exhausted)})"), code=code)

    def _create_in_zone(self, job: JobSpec, offer: InstanceOffer, key: str, zone: str, nvcc: bool) -> CloudInstance:
        instances, _ = self.clients()
        request = compute_v1.InsertInstanceRequest(
            project=self.project, zone=zone, instance_resource=self._resource(job, offer, key, zone, nvcc),
            request_id=str(uuid.uuid5(REQUEST_NS, f"{key}/{zone}")))
        try:
            with api_errors(f"insert {offer.instance_type} in {zone}"):
                op = instances.insert_unary(request=request)
        except CloudError as e:
            if e.code != "alreadyExists":
                raise
            return self._adopt(zone, key, offer)  # an earlier attempt made it
        self.wait_operation(zone, op, f"insert {offer.instance_type} in {zone}")
        found = self._get(zone, key)
        if found is None or found.state in ("stopping", "stopped"):
            raise CloudError(ErrorKind.CAPACITY, f"instance {key} vanished in {zone}", code="Vanished")
        return found.model_copy(update={"price": offer.price})

    def _adopt(self, zone: str, key: str, offer: InstanceOffer) -> CloudInstance:
        found = self._get(zone, key)
        if found is None or found.state in ("stopping", "stopped"):
            # A failed insert (capacity) leaves the instance briefly, then GCE deletes it.
            raise CloudError(ErrorKind.CAPACITY, f"instance {key} in {zone} is gone or going", code="Vanished")
        if found.key != key:
            raise CloudError(ErrorKind.FATAL, f"instance name {key} in {zone} is taken by an instance durastack "
                             "did not label", code="NameTaken")
        return found.model_copy(update={"price": offer.price})

    def find_reservation(self, value: str, regions: Optional[list[str]] = None) -> ReservationLookup:
        """Every zone's reservation named by ``value`` (``NAME`` in this project, or ``projects/P/reservations/NAME``)
        in ``regions`` (default: configured), whatever its state: the matching says why one cannot be used."""
        parsed = gcp_reservation(value, self.project)
        if parsed is None:
            return ReservationLookup(name=value, notes=["gcp: not a GCP reservation name"])
        project, name = parsed
        self.clients()
        wanted = set(regions or self.regions)
        request = compute_v1.AggregatedListReservationsRequest(project=project, filter=f'(name = "{name}")')
        found = []
        with api_errors(f"aggregatedList reservations of {project}"):
            for scope, scoped in self._reservations.aggregated_list(request=request, retry=_READ_RETRY):
                zone = scope.rsplit("/", 1)[-1]
                if not wanted or region_of(zone) in wanted:
                    found += [self._reservation(value, raw, zone) for raw in scoped.reservations if raw.name == name]
        where = ", ".join(sorted(wanted)) or "any region"
        return ReservationLookup(name=value, found=found,
                                 notes=[] if found else [f"gcp: no reservation {name} in project {project} ({where})"])

    @staticmethod
    def _reservation(value: str, raw: compute_v1.Reservation, zone: str) -> Reservation:
        specific = raw.specific_reservation
        properties = specific.instance_properties
        return Reservation(
            backend="gcp", name=value, region=region_of(zone), zone=zone, instance_type=properties.machine_type,
            accelerators={a.accelerator_type.rsplit("/", 1)[-1]: a.accelerator_count
                          for a in properties.guest_accelerators},
            kind="reservation", state=raw.status, specific=raw.specific_reservation_required,
            total=specific.count, in_use=specific.in_use_count)

    def find_replica(self, job: JobSpec, regions: Optional[list[str]] = None) -> list[CloudInstance]:
        """Instances of this replica submission (any offer, any zone) in ``regions`` (default: configured)."""
        return self._aggregated(regions, {LABELS["service"]: slug(job.service), LABELS["group"]: slug(job.group),
                                          LABELS["replica"]: replica_label(job.replica_num, job.submission_num)})

    def list_tagged(self, regions: Optional[list[str]] = None, *, service: Optional[str] = None) -> list[CloudInstance]:
        """Every durastack instance (of ``service`` if given) in ``regions`` (default: all configured)."""
        labels = {"managed-by": "durastack"} | ({LABELS["service"]: slug(service)} if service else {})
        return self._aggregated(regions, labels)

    def get(self, instance: CloudInstance) -> Optional[CloudInstance]:
        found = self._get(instance.zone, instance.instance_id)
        return found.model_copy(update={"price": instance.price}) if found else None

    def retag(self, instance: CloudInstance, job: JobSpec) -> None:
        """Label a running instance for another submission of its service's group (an idle instance reused), as
        AWSBackend.retag. setLabels replaces every label and takes the fingerprint of the ones it replaces: a
        change meanwhile fails it (conditionNotMet), and the retried launch reads them again."""
        instances, _ = self.clients()
        with api_errors(f"get {instance.instance_id}"):
            raw = instances.get(project=self.project, zone=instance.zone, instance=instance.instance_id,
                                retry=_READ_RETRY)
        labels = dict(raw.labels) | {LABELS["replica"]: replica_label(job.replica_num, job.submission_num)}
        with api_errors(f"setLabels on {instance.instance_id}"):
            op = instances.set_labels_unary(
                project=self.project, zone=instance.zone, instance=instance.instance_id,
                instances_set_labels_request_resource=compute_v1.InstancesSetLabelsRequest(
                    labels=labels, label_fingerprint=raw.label_fingerprint))
        self.wait_operation(instance.zone, op, f"setLabels on {instance.instance_id}")

    def terminate(self, instance: CloudInstance) -> None:
        """Delete and wait for it; an instance that is already gone is success."""
        instances, _ = self.clients()
        try:
            with api_errors(f"delete {instance.instance_id}"):
                op = instances.delete_unary(project=self.project, zone=instance.zone, instance=instance.instance_id)
        except CloudError as e:
            if e.code == "notFound":
                return
            if e.kind is ErrorKind.CAPACITY:  # e.g. resourceNotReady: a delete is already under way
                raise CloudError(ErrorKind.TRANSIENT, e.message, code=e.code) from e
            raise
        self.wait_operation(instance.zone, op, f"delete {instance.instance_id}")

    # --- helpers ----------------------------------------------------------------------------------

    def _resource(self, job: JobSpec, offer: InstanceOffer, key: str, zone: str, nvcc: bool) -> compute_v1.Instance:
        gpu = offer.gpu_count > 0
        accelerators = []
        if gpu and offer.instance_type.startswith("n1-"):
            accelerator = ACCELERATORS.get((offer.gpu_name or "").lower())
            if accelerator is None:
                raise CloudError(ErrorKind.CAPACITY, f"no N1 accelerator type for {offer.gpu_name}", code="Unsupported")
            accelerators = [compute_v1.AcceleratorConfig(
                accelerator_type=f"zones/{zone}/acceleratorTypes/{accelerator}", accelerator_count=offer.gpu_count)]
        scheduling = compute_v1.Scheduling(
            # GPU VMs cannot live-migrate; SPOT VMs must terminate too. Plain CPU VMs keep the default (MIGRATE).
            on_host_maintenance="TERMINATE" if gpu or offer.spot else "MIGRATE",
            automatic_restart=not offer.spot, provisioning_model="SPOT" if offer.spot else "STANDARD")
        if offer.spot:
            scheduling.instance_termination_action = "DELETE"  # a preempted replica is gone; its disk must not bill
        keys = self.ssh_keys or SSHKeys.of_home(_home())
        host = keys.host_key(key)
        boot_keys = BootKeys(host_key=host.private_openssh, host_key_public=host.public_openssh,
                             authorized_key=keys.client_public())
        # No env and no command in metadata: they arrive over SSH after boot. Root logs in with the installation's
        # key alone: no project keys, and no OS Login, whose guest agent would rewrite sshd's configuration.
        metadata = [compute_v1.Items(key="startup-script", value=startup_script(job, gpu=gpu, keys=boot_keys)),
                    compute_v1.Items(key="block-project-ssh-keys", value="true"),
                    compute_v1.Items(key="enable-oslogin", value="FALSE")]
        if gpu:
            metadata.append(compute_v1.Items(key="install-nvidia-driver", value="True"))  # Deep Learning VM images
        nic = compute_v1.NetworkInterface(network=self.config.network)
        if self.config.public_ip:
            nic.access_configs = [compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")]
        image = self._boot_image(gpu)
        labels = {"managed-by": "durastack", LABELS["service"]: slug(job.service), LABELS["group"]: slug(job.group),
                  LABELS["replica"]: replica_label(job.replica_num, job.submission_num), LABELS["key"]: key,
                  LABELS["port"]: str(job.port), LABELS["host_key"]: HOST_KEY_AFTER_BOOT,
                  LABELS["image"]: image.rsplit("/", 1)[-1]}
        if self.installation:
            labels[LABELS["installation"]] = self.installation
        boot = compute_v1.AttachedDiskInitializeParams(
            source_image=image,
            disk_size_gb=max(10, math.ceil(offer.disk_gb)), disk_type=f"zones/{zone}/diskTypes/pd-balanced")
        return compute_v1.Instance(
            name=key, machine_type=f"zones/{zone}/machineTypes/{offer.instance_type}", labels=labels,
            guest_accelerators=accelerators, scheduling=scheduling, network_interfaces=[nic],
            metadata=compute_v1.Metadata(items=metadata),
            # Network tags ≤ 63: the SSH rule targets the first, the service's own rule the second.
            tags=compute_v1.Tags(items=[self.network_tag, self.service_tag(job.service)]),
            disks=[compute_v1.AttachedDisk(boot=True, auto_delete=True, initialize_params=boot)],
            reservation_affinity=self._affinity(offer))

    def _affinity(self, offer: InstanceOffer) -> Optional[compute_v1.ReservationAffinity]:
        """Into the offer's reservation only (GCE refuses the insert if it is gone, full or holds other VMs), named
        with its project: the form that also reaches one shared from another project."""
        parsed = gcp_reservation(offer.reservation, self.project) if offer.reservation else None
        if parsed is None:
            return None
        return compute_v1.ReservationAffinity(consume_reservation_type="SPECIFIC_RESERVATION", key=RESERVATION_KEY,
                                              values=[f"projects/{parsed[0]}/reservations/{parsed[1]}"])

    def wait_operation(self, zone: str, op: compute_v1.Operation, what: str) -> None:
        """Poll our own operations client until DONE (bounded); raise the operation's error, classified."""
        _, operations = self.clients()
        deadline = time.monotonic() + self.config.operation_timeout
        while compute_v1.Operation.Status(op.status).name != "DONE":
            if time.monotonic() > deadline:
                # The insert may still succeed: a retry meets 409 and adopts the instance.
                raise CloudError(ErrorKind.TRANSIENT, f"{what}: operation {op.name} still running", code="Timeout")
            with api_errors(f"{what} (operation)"):
                # wait() returns when DONE or after about two minutes server-side, so this is not a busy loop.
                op = operations.wait(project=self.project, zone=zone, operation=op.name)
        if op.error and op.error.errors:
            codes = [e.code for e in op.error.errors]
            message = "; ".join(f"{e.code}: {e.message}" for e in op.error.errors)
            kind = classify_gcp(codes, op.http_error_status_code or 500, tuple(e.message for e in op.error.errors))
            raise CloudError(kind, _short(f"{what}: {message}"), code=codes[0])

    def _get(self, zone: str, name: str) -> Optional[CloudInstance]:
        instances, _ = self.clients()
        try:
            with api_errors(f"get {name}"):
                raw = instances.get(project=self.project, zone=zone, instance=name, retry=_READ_RETRY)
        except CloudError as e:
            if e.code == "notFound":
                return None
            raise
        return self._instance(raw, zone)

    def _aggregated(self, regions: Optional[list[str]], labels: dict[str, str]) -> list[CloudInstance]:
        instances, _ = self.clients()
        wanted = set(regions or self.regions)
        request = compute_v1.AggregatedListInstancesRequest(
            project=self.project, filter=" AND ".join(f'(labels.{k} = "{v}")' for k, v in sorted(labels.items())))
        found = []
        with api_errors("aggregatedList instances"):
            for scope, scoped in instances.aggregated_list(request=request, retry=_READ_RETRY):
                zone = scope.rsplit("/", 1)[-1]
                if not wanted or region_of(zone) in wanted:
                    found += [self._instance(raw, zone) for raw in scoped.instances
                              if belongs(raw.labels, "gcp", self.installation)]
        return sorted(found, key=lambda i: (i.launched_at is None, i.launched_at, i.zone, i.instance_id))

    def _instance(self, raw: compute_v1.Instance, zone: str) -> CloudInstance:
        labels = dict(raw.labels)
        nic = raw.network_interfaces[0] if raw.network_interfaces else None
        private = nic.network_i_p if nic else ""
        public = nic.access_configs[0].nat_i_p if nic and nic.access_configs else ""
        # The address the gateway reaches, exec and logs too: the private one with data_path: private.
        ip = (public or private) if self.config.public_ip and self.config.data_path != "private" else private
        port = labels.get(LABELS["port"], "")
        launched = None
        if raw.creation_timestamp:
            with contextlib.suppress(ValueError):
                launched = datetime.fromisoformat(raw.creation_timestamp)
        return CloudInstance(
            backend="gcp", instance_id=raw.name, region=region_of(zone), zone=zone,
            instance_type=raw.machine_type.rsplit("/", 1)[-1], key=labels.get(LABELS["key"], ""),
            state=_STATES.get(raw.status, "pending"), spot=raw.scheduling.provisioning_model == "SPOT",
            address=f"{ip}:{port}" if ip and port else "", private_ip=private, public_ip=public,
            launched_at=launched, tags=labels)


__all__ = ["ACCELERATORS", "GCPBackend", "IMAGE_TTL", "REQUEST_NS", "region_of"]
