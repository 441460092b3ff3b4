"""A fake of the Compute Engine v1 REST API — just what durastack's GCP backend uses (cloud-testing.md 2.4).

instances insert / get / list (label and status filter) / delete / aggregatedList, zone operations get and
wait; firewall rules and their global operations; unknown zones, and machine or accelerator types a zone does
not have (per tests/fakes/gce_zones.py, written from Google's documentation, not from the shipped catalog), refused
as Compute refuses them (400 invalid), and an accelerator the machine type cannot take (400 badRequest); requestId
dedupe; 409 on a duplicate name in a zone; regions.get with the region's ``quotas`` list (metric, limit, usage;
``set_quota``, or ``refuse_regions`` for a caller without compute.regions.get); faults: capacity and quota in the
operation, synchronous quota (403) or any HTTP error, and "lost responses" (created, then answered 503). A stdlib
ThreadingHTTPServer on 127.0.0.1:<ephemeral>; ``gce`` is the fixture (import it into a test module).

Images: get and getFromFamily, of ``PUBLIC_IMAGES`` and those a test adds; an insert whose boot image does not
resolve (a retired family, an obsolete image) is refused as Compute refuses it (400 invalid).

Persistent disks (insert, get, delete) and instances attachDisk / detachDisk: a disk attached read-write to an
instance is refused to another one (and to the same one again) in the attach's operation,
RESOURCE_IN_USE_BY_ANOTHER_RESOURCE, "The disk resource '…' is already being used by '…'", as Compute answers it; its
deletion synchronously (400 resourceInUseByAnotherResource). A disk of another zone, an unknown disk or instance, or a
detach of a device name the instance has not are refused (400 invalid, 404 notFound); deleting an instance detaches
its disks (they are not auto-deleted).

Reservations (get, list and aggregatedList, filtered by name, status and specificReservationRequired): an insert
whose reservationAffinity is SPECIFIC_RESERVATION consumes one VM of the named reservation of its zone, held until
the instance is deleted, and is refused as Compute refuses it: a reservation without specificReservationRequired
synchronously (400 invalid); one that does not exist in that zone, is not READY, holds other VMs (machine type,
accelerators) or has no VM left in the operation, as CONDITION_NOT_MET (HTTP 412) with Compute's messages.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import parse_qs, urlparse

import pytest
from tests.fakes import ServedInThread, gce_zones

_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_ZONE_PATH = re.compile(r"^/compute/v1/projects/(?P<p>[^/]+)/zones/(?P<z>[^/]+)/(?P<kind>instances|operations)"
                        r"(?:/(?P<name>[^/]+))?(?P<wait>/wait|/setLabels)?(?:/(?P<action>attachDisk|detachDisk))?$")
_DISK_PATH = re.compile(r"^/compute/v1/projects/(?P<p>[^/]+)/zones/(?P<z>[^/]+)/disks(?:/(?P<name>[^/]+))?$")
_DISK_SOURCE = re.compile(r"(?:.*/compute/v1/)?projects/(?P<p>[^/]+)/zones/(?P<z>[^/]+)/disks/(?P<name>[^/]+)$")
MIN_DISK_GB = 10  # pd-balanced
_GLOBAL_PATH = re.compile(r"^/compute/v1/projects/(?P<p>[^/]+)/global/(?P<kind>firewalls|operations)"
                          r"(?:/(?P<name>[^/]+))?(?P<wait>/wait)?$")
_REGION_PATH = re.compile(r"^/compute/v1/projects/(?P<p>[^/]+)/regions/(?P<r>[^/]+)$")
_IMAGES = re.compile(r"^/compute/v1/projects/(?P<p>[^/]+)/global/images/(?:family/(?P<family>[^/]+)|(?P<name>[^/]+))$")
_SOURCE_IMAGE = re.compile(r"^(?:https?://[^/]+/compute/v1/)?(?:projects/(?P<p>[^/]+)/)?global/images/"
                           r"(?:family/(?P<family>[^/]+)|(?P<name>[^/]+))$")
# Public images as their projects publish them: (project, image, family, deprecation state). The Deep Learning VM
# families name CUDA, OS and NVIDIA driver branch; the cu124 py310 family was retired (its images deprecated).
_DLVM = "deeplearning-platform-release"
PUBLIC_IMAGES = [(_DLVM, f"{family}-{version}", family, state) for family, version, state in (
    ("common-cu129-ubuntu-2404-nvidia-580", "v20260626", ""),
    ("common-cu129-ubuntu-2404-nvidia-580", "v20261020", ""),
    ("common-cu129-ubuntu-2204-nvidia-580", "v20261020", ""),
    ("common-cu128-ubuntu-2204-nvidia-570", "v20260301", ""),
    ("common-cu124-ubuntu-2204-py310", "v20250325", "DEPRECATED"))] + [
    ("ubuntu-os-cloud", "ubuntu-2204-jammy-v20261015", "ubuntu-2204-lts", ""),
    ("ubuntu-os-cloud", "ubuntu-2404-noble-amd64-v20261015", "ubuntu-2404-lts-amd64", "")]
_AGGREGATED = re.compile(r"^/compute/v1/projects/(?P<p>[^/]+)/aggregated/(?P<kind>instances|reservations)$")
_RESERVATION_PATH = re.compile(r"^/compute/v1/projects/(?P<p>[^/]+)/zones/(?P<z>[^/]+)/reservations"
                               r"(?:/(?P<name>[^/]+))?$")
_TERM = re.compile(r'\(?\s*(labels\.[a-z0-9_-]+|status|name|specificReservationRequired)\s*(=|!=)\s*"?([^")\s]*)"?'
                   r'\s*\)?')
_AFFINITY_KEY = "compute.googleapis.com/reservation-name"
_OP_ERRORS = {503: "SERVICE UNAVAILABLE", 403: "FORBIDDEN", 412: "PRECONDITION FAILED", 400: "BAD REQUEST"}
_REASONS = {400: "invalid", 401: "required", 403: "forbidden", 404: "notFound", 409: "alreadyExists",
            429: "rateLimitExceeded", 500: "backendError", 503: "backendError"}


@dataclass
class GCEFault:
    kind: str  # capacity | quota (in the operation) | quota_sync (403) | http (status, reason)
    zone: Optional[str] = None
    machine_type: Optional[str] = None
    times: Optional[int] = None
    status: int = 503
    reason: str = ""
    message: str = ""

    def matches(self, zone: str, machine_type: str, spot: bool) -> bool:
        """A quota fault of a PREEMPTIBLE_* quota counts spot VMs only, as Compute's quotas do."""
        return (self.times is None or self.times > 0) and self.zone in (None, zone) and \
            self.machine_type in (None, machine_type) and (spot or "'PREEMPTIBLE_" not in self.message)


def default_quotas() -> dict[str, tuple[float, float]]:
    """metric → (limit, usage) of a project granted GPU quota: generous standard limits, and preemptible quotas at 0
    as in a project that never asked for them (its spot VMs draw on the standard quotas)."""
    gpus = ("T4", "V100", "P100", "L4", "A100", "A100_80GB", "H100")
    return {"CPUS": (2400.0, 0.0), "N2_CPUS": (2400.0, 0.0), "A2_CPUS": (2400.0, 0.0), "C2_CPUS": (600.0, 0.0),
            "PREEMPTIBLE_CPUS": (0.0, 0.0), "INSTANCES": (6000.0, 0.0), "DISKS_TOTAL_GB": (409600.0, 0.0),
            "SSD_TOTAL_GB": (81920.0, 0.0), "IN_USE_ADDRESSES": (575.0, 0.0)} | \
        {f"NVIDIA_{g}_GPUS": (64.0, 0.0) for g in gpus} | {f"PREEMPTIBLE_NVIDIA_{g}_GPUS": (0.0, 0.0) for g in gpus}


def _http_error(status: int, message: str, reason: str = "") -> tuple[int, dict]:
    reason = reason or _REASONS.get(status, "error")
    return status, {"error": {"code": status, "message": message,
                              "errors": [{"message": message, "domain": "global", "reason": reason}]}}


def _fingerprint(labels: dict) -> str:
    """A labels fingerprint as Compute gives one: opaque base64 that changes with the labels."""
    digest = hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).digest()[:8]
    return base64.b64encode(digest).decode()


def _matches(instance: dict, flt: str) -> bool:
    for field, op, value in _TERM.findall(flt):
        have = instance.get("labels", {}).get(field[7:]) if field.startswith("labels.") else instance.get(field)
        if isinstance(have, bool):
            have = str(have).lower()
        if (have == value) != (op == "="):
            return False
    rest = _TERM.sub("", flt).replace("AND", "").strip()
    if rest:
        raise ValueError(f"unsupported filter: {flt!r}")
    return True


class FakeGCE(ServedInThread):
    def __init__(self):
        self.lock = threading.Lock()
        self.ids = itertools.count(1000)
        self.reset()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                url = urlparse(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}") if length else {}
                with fake.lock:
                    fake.requests.append({"method": self.command, "path": url.path, "query": query, "body": body})
                    status, payload = fake.route(self.command, url.path, query, body)
                out = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_DELETE = do_PATCH = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="gce-fake", daemon=True)

    def reset(self) -> None:
        with self.lock:
            self.instances: dict[tuple[str, str, str], dict] = {}
            self.operations: dict[tuple[str, str, str], dict] = {}
            self.polls: dict[str, int] = {}
            self.request_ids: dict[tuple[str, str, str], str] = {}
            self.faults: list[GCEFault] = []
            self.requests: list[dict] = []
            self.lose = 0
            self.op_polls = 1  # new operations report RUNNING for this many polls, then DONE
            self.firewalls: dict[tuple[str, str], dict] = {}
            self.images: dict[tuple[str, str], dict] = {}
            for project, name, family, state in PUBLIC_IMAGES:
                self._add_image(project, name, family, state)
            # What Compute has in each zone, per Google's documentation; a test may narrow or widen a zone.
            self.machine_types = {z: set(gce_zones.machine_types(z)) for z in gce_zones.ZONES}
            self.accelerator_types = {z: set(gce_zones.accelerator_types(z)) for z in gce_zones.ZONES}
            self.quotas = {r: default_quotas() for r in gce_zones.REGIONS}  # region → metric → (limit, usage)
            self.region_refusal: Optional[tuple[int, str]] = None  # (status, reason) regions.get answers
            self.reservations: dict[tuple[str, str, str], dict] = {}
            self.consumed: dict[tuple[str, str, str], tuple[str, str, str]] = {}  # instance → its reservation
            self.disks: dict[tuple[str, str, str], dict] = {}

    # --- test controls ----------------------------------------------------------------------------

    def fail(self, kind: str, *, zone: Optional[str] = None, machine_type: Optional[str] = None,
             times: Optional[int] = None, status: int = 503, reason: str = "", message: str = "") -> None:
        with self.lock:
            self.faults.append(GCEFault(kind, zone, machine_type, times, status, reason, message))

    def set_quota(self, region: str, metric: str, limit: Optional[float], usage: float = 0.0) -> None:
        """The region's quota of ``metric`` as regions.get lists it; ``limit`` None drops it from the list."""
        with self.lock:
            if limit is None:
                self.quotas[region].pop(metric, None)
            else:
                self.quotas[region][metric] = (limit, usage)

    def refuse_regions(self, status: int = 403, reason: str = "forbidden") -> None:
        """regions.get answers this error, e.g. 403 for a caller without compute.regions.get."""
        with self.lock:
            self.region_refusal = (status, reason)

    def region_reads(self) -> list[str]:
        with self.lock:
            return [m["r"] for r in self.requests if r["method"] == "GET" and (m := _REGION_PATH.match(r["path"]))]
    def add_image(self, project: str, name: str, family: str = "", deprecated: str = "") -> None:
        """An image (of ``family``); ``deprecated``: DEPRECATED, OBSOLETE or DELETED. Added later is newer."""
        with self.lock:
            self._add_image(project, name, family, deprecated)

    def _add_image(self, project: str, name: str, family: str, state: str) -> None:
        n = next(self.ids)
        self.images[(project, name)] = {
            "kind": "compute#image", "id": str(n), "name": name, "status": "READY", "archiveSizeBytes": "0",
            "creationTimestamp": f"2026-01-01T00:00:00.{n:06d}-00:00",
            **({"family": family} if family else {}), **({"deprecated": {"state": state}} if state else {})}

    def _newest_of(self, project: str, family: str) -> Optional[dict]:
        """What getFromFamily answers: the family's newest image that is not deprecated."""
        live = [i for (p, _), i in self.images.items() if p == project and i.get("family") == family
                and "deprecated" not in i]
        return max(live, key=lambda i: i["creationTimestamp"]) if live else None

    def _image(self, p: str, family: Optional[str], name: Optional[str]) -> tuple[int, dict]:
        found = self._newest_of(p, family) if family else self.images.get((p, name or ""))
        if found is None:
            what = f"family/{family}" if family else name
            return _http_error(404, f"The resource 'projects/{p}/global/images/{what}' was not found")
        return 200, {**found, "selfLink": f"{self.url}/compute/v1/projects/{p}/global/images/{found['name']}"}

    def _boot_image_missing(self, p: str, body: dict) -> Optional[tuple[int, dict]]:
        """Compute refuses an insert whose boot disk's image does not resolve (retired family, obsolete image)."""
        for i, disk in enumerate(body.get("disks", [])):
            source = disk.get("initializeParams", {}).get("sourceImage", "")
            m = _SOURCE_IMAGE.match(source)
            found = m and (self._newest_of(m["p"] or p, m["family"]) if m["family"] else
                           self.images.get((m["p"] or p, m["name"])))
            if source and (not found or found.get("deprecated", {}).get("state") in ("OBSOLETE", "DELETED")):
                return _http_error(400, f"Invalid value for field 'resource.disks[{i}].initializeParams.sourceImage': "
                                        f"'{source}'. The referenced image resource cannot be found.", "invalid")
        return None

    def lose_responses(self, n: int) -> None:
        with self.lock:
            self.lose = n

    def inserts(self) -> list[dict]:
        with self.lock:
            return [r for r in self.requests if r["method"] == "POST" and r["path"].endswith("/instances")]

    def all_instances(self) -> list[dict]:
        with self.lock:
            return list(self.instances.values())

    def add_reservation(self, project: str, zone: str, name: str, machine_type: str, *, count: int = 1,
                        accelerators: Optional[dict[str, int]] = None, status: str = "READY",
                        specific: bool = True) -> dict:
        """A reservation of ``count`` VMs of ``machine_type`` (with ``accelerators``: type → count) in ``zone``, as
        Compute describes it; ``specific``: specificReservationRequired."""
        base = f"{self.url}/compute/v1/projects/{project}/zones/{zone}"
        properties = {"machineType": machine_type, "guestAccelerators": [
            {"acceleratorType": t, "acceleratorCount": n} for t, n in (accelerators or {}).items()]}
        reservation = {"kind": "compute#reservation", "id": str(next(self.ids)), "name": name, "zone": base,
                       "creationTimestamp": "2026-01-01T00:00:00.000-00:00", "status": status,
                       "selfLink": f"{base}/reservations/{name}", "specificReservationRequired": specific,
                       "shareSettings": {"shareType": "LOCAL"},
                       "specificReservation": {"instanceProperties": properties, "count": str(count),
                                               "inUseCount": "0", "assuredCount": str(count)}}
        with self.lock:
            self.reservations[(project, zone, name)] = reservation
        return reservation

    def reservation(self, project: str, zone: str, name: str) -> dict:
        with self.lock:
            return self.reservations[(project, zone, name)]

    # --- routes -----------------------------------------------------------------------------------

    def firewall_rules(self) -> list[dict]:
        with self.lock:
            return list(self.firewalls.values())

    def route(self, method: str, path: str, query: dict, body: dict) -> tuple[int, dict]:
        m = _IMAGES.match(path)
        if m and method == "GET":
            return self._image(m["p"], m["family"], m["name"])
        m = _GLOBAL_PATH.match(path)
        if m:
            return self._global(method, m["p"], m["kind"], m["name"], body)
        m = _REGION_PATH.match(path)
        if m and method == "GET":
            return self._region(m["p"], m["r"])
        m = _AGGREGATED.match(path)
        if m and method == "GET":
            return self._aggregated(m["p"], m["kind"], query.get("filter", ""))
        m = _RESERVATION_PATH.match(path)
        if m and method == "GET":
            return self._reservations(m["p"], m["z"], m["name"], query.get("filter", ""))
        m = _ZONE_PATH.match(path) or _DISK_PATH.match(path)
        if not m:
            return _http_error(404, f"no route {method} {path}")
        p, z, name = m["p"], m["z"], m["name"]
        if z not in self.machine_types:
            return _http_error(404 if method == "GET" else 400, f"Invalid value for field 'zone': '{z}'. "
                                                                 "Unknown zone.", "invalid")
        if m.re is _DISK_PATH:
            return self._disk(method, p, z, name, body, query.get("requestId", ""))
        if m["action"] and method == "POST":
            return self._attach(p, z, name, body, query) if m["action"] == "attachDisk" else \
                self._detach(p, z, name, query.get("deviceName", ""))
        if m["kind"] == "operations" and name:
            return self._operation(p, z, name, wait=m["wait"] == "/wait")
        if m["wait"] == "/setLabels" and method == "POST":
            return self._set_labels(p, z, name, body)
        if method == "POST" and not name:
            return self._insert(p, z, body, query.get("requestId", ""))
        if method == "GET" and not name:
            return self._list(p, z, query.get("filter", ""))
        if method == "GET":
            inst = self.instances.get((p, z, name))
            return (200, inst) if inst else _http_error(404, f"The resource 'projects/{p}/zones/{z}/instances/"
                                                              f"{name}' was not found")
        if method == "DELETE":
            deleted = self.instances.pop((p, z, name), None)
            if deleted is None:
                return _http_error(404, f"The resource 'projects/{p}/zones/{z}/instances/{name}' was not found")
            for disk in self.disks.values():  # its disks stay, detached
                disk["users"] = [u for u in disk.get("users", []) if u != deleted["selfLink"]]
            if (p, z, name) in self.consumed:
                self._consume(self.consumed[(p, z, name)], (p, z, name), -1)
            return 200, self._new_op(p, z, "delete", name)
        return _http_error(405, f"{method} not supported")

    def _insert(self, p: str, z: str, body: dict, request_id: str) -> tuple[int, dict]:
        name = body.get("name", "")
        if not _NAME.match(name):
            return _http_error(400, f"Invalid value for field 'resource.name': '{name}'.", "invalid")
        for tag in body.get("tags", {}).get("items", []):  # network tags: RFC 1035 labels, as names
            if not _NAME.match(tag):
                return _http_error(400, f"Invalid value for field 'resource.tags.items[]': '{tag}'.", "invalid")
        if request_id and (p, z, request_id) in self.request_ids:
            return 200, self.operations[(p, z, self.request_ids[(p, z, request_id)])]
        if (p, z, name) in self.instances:
            return _http_error(409, f"The resource 'projects/{p}/zones/{z}/instances/{name}' already exists")
        machine_type = body.get("machineType", "").rsplit("/", 1)[-1]
        refused = self._boot_image_missing(p, body)
        if refused:
            return refused
        if machine_type not in self.machine_types.get(z, ()):
            return _http_error(400, f"Invalid value for field 'resource.machineType': '{body.get('machineType')}'. "
                                    f"Machine type with name '{machine_type}' does not exist in zone '{z}'.",
                               "invalid")
        for acc in body.get("guestAccelerators", []):
            kind = acc.get("acceleratorType", "").rsplit("/", 1)[-1]
            if kind not in self.accelerator_types.get(z, ()):
                return _http_error(400, f"Invalid value for field 'resource.guestAccelerators[0].acceleratorType': "
                                        f"'{acc.get('acceleratorType')}'. Accelerator type '{kind}' does not exist "
                                        f"in zone '{z}'.", "invalid")
            if not gce_zones.attachable(machine_type, kind):  # T4/V100/P4/P100 on N1 only; A2/A3/G2 carry their own
                return _http_error(400, f"[{machine_type}, {kind}] features are not compatible for creating "
                                        "instance.", "badRequest")
        reservation, refused = self._reserved(p, z, body, name, request_id)
        if refused:
            return refused
        for fault in self.faults:
            if fault.matches(z, machine_type, body.get("scheduling", {}).get("provisioningModel") == "SPOT"):
                if fault.times is not None:
                    fault.times -= 1
                return self._fault(p, z, name, fault, request_id)
        n = next(self.ids)
        instance = {**body, "id": str(n), "status": "RUNNING", "zone": f"{self.url}/compute/v1/projects/{p}/zones/{z}",
                    "machineType": f"{self.url}/compute/v1/projects/{p}/zones/{z}/machineTypes/{machine_type}",
                    "creationTimestamp": "2026-01-01T00:00:00.000-00:00",
                    "labelFingerprint": _fingerprint(body.get("labels", {})),
                    "selfLink": f"{self.url}/compute/v1/projects/{p}/zones/{z}/instances/{name}"}
        nics = [dict(nic) for nic in instance.get("networkInterfaces", [{}])]
        for i, nic in enumerate(nics):
            nic["networkIP"] = f"10.128.{n % 250}.{i + 2}"
            nic["accessConfigs"] = [{**ac, "natIP": f"34.1.{n % 250}.{i + 2}"} for ac in nic.get("accessConfigs", [])]
        instance["networkInterfaces"] = nics
        self.instances[(p, z, name)] = instance
        if reservation:
            self._consume(reservation, (p, z, name), +1)
        op = self._new_op(p, z, "insert", name, request_id)
        if self.lose > 0:
            self.lose -= 1
            return _http_error(503, "response lost (injected; the instance was created)")
        return 200, op

    def all_disks(self) -> list[dict]:
        with self.lock:
            return [dict(d) for d in self.disks.values()]

    def _disk(self, method: str, p: str, z: str, name: Optional[str], body: dict, request_id: str
              ) -> tuple[int, dict]:
        """disks.insert, get and delete."""
        path = f"projects/{p}/zones/{z}/disks/{name or body.get('name', '')}"
        if method == "POST" and not name:
            disk_name, size = body.get("name", ""), int(body.get("sizeGb") or 0)
            if not _NAME.match(disk_name):
                return _http_error(400, f"Invalid value for field 'resource.name': '{disk_name}'.", "invalid")
            if request_id and (p, z, request_id) in self.request_ids:
                return 200, self.operations[(p, z, self.request_ids[(p, z, request_id)])]
            if (p, z, disk_name) in self.disks:
                return _http_error(409, f"The resource '{path}' already exists")
            if size < MIN_DISK_GB:
                return _http_error(400, f"Invalid value for field 'resource.sizeGb': '{size}'. Disk size cannot be "
                                        f"smaller than {MIN_DISK_GB} GB.", "invalid")
            self.disks[(p, z, disk_name)] = {
                **body, "kind": "compute#disk", "id": str(next(self.ids)), "sizeGb": str(size), "status": "READY",
                "zone": f"{self.url}/compute/v1/projects/{p}/zones/{z}", "users": [],
                "type": f"{self.url}/compute/v1/projects/{p}/zones/{z}/diskTypes/"
                        f"{body.get('type', 'pd-standard').rsplit('/', 1)[-1]}",
                "creationTimestamp": "2026-01-01T00:00:00.000-00:00", "selfLink": f"{self.url}/compute/v1/{path}"}
            return 200, self._new_op(p, z, "insert", disk_name, request_id)
        disk = self.disks.get((p, z, name or ""))
        if disk is None:
            return _http_error(404, f"The resource '{path}' was not found")
        if method == "GET":
            return 200, disk
        if method == "DELETE":
            if disk["users"]:
                return _http_error(400, f"The disk resource '{path}' is already being used by "
                                        f"'{_short_link(disk['users'][0])}'", "resourceInUseByAnotherResource")
            del self.disks[(p, z, name)]
            return 200, self._new_op(p, z, "delete", name or "")
        return _http_error(405, f"{method} not supported")

    def _attach(self, p: str, z: str, name: str, body: dict, query: dict) -> tuple[int, dict]:
        """instances.attachDisk: a disk of the instance's zone, attached read-write to no other instance."""
        instance = self.instances.get((p, z, name))
        if instance is None:
            return _http_error(404, f"The resource 'projects/{p}/zones/{z}/instances/{name}' was not found")
        request_id = query.get("requestId", "")
        if request_id and (p, z, request_id) in self.request_ids:
            return 200, self.operations[(p, z, self.request_ids[(p, z, request_id)])]
        m = _DISK_SOURCE.match(body.get("source", ""))
        if m is None or (m["p"], m["z"]) != (p, z):
            return _http_error(400, f"Invalid value for field 'resource.source': '{body.get('source')}'. The disk "
                                    "must be in the same zone as the instance.", "invalid")
        disk = self.disks.get((p, z, m["name"]))
        if disk is None:
            return _http_error(404, f"The resource 'projects/{p}/zones/{z}/disks/{m['name']}' was not found")
        if disk["users"] and body.get("mode", "READ_WRITE") == "READ_WRITE":
            return 200, self._new_op(p, z, "attachDisk", name, request_id, error=(
                400, "RESOURCE_IN_USE_BY_ANOTHER_RESOURCE", f"The disk resource 'projects/{p}/zones/{z}/disks/"
                f"{m['name']}' is already being used by '{_short_link(disk['users'][0])}'"))
        attached = instance.setdefault("disks", [])
        attached.append({"kind": "compute#attachedDisk", "type": "PERSISTENT", "mode": body.get("mode", "READ_WRITE"),
                         "source": disk["selfLink"], "deviceName": body.get("deviceName") or m["name"],
                         "index": len(attached), "boot": False, "autoDelete": bool(body.get("autoDelete", False)),
                         "interface": "SCSI"})
        disk["users"] = disk["users"] + [instance["selfLink"]]
        return 200, self._new_op(p, z, "attachDisk", name, request_id)

    def _detach(self, p: str, z: str, name: str, device: str) -> tuple[int, dict]:
        instance = self.instances.get((p, z, name))
        if instance is None:
            return _http_error(404, f"The resource 'projects/{p}/zones/{z}/instances/{name}' was not found")
        found = next((d for d in instance.get("disks", []) if d.get("deviceName") == device and not d.get("boot")),
                     None)
        if found is None:
            return _http_error(400, f"Invalid value for field 'deviceName': '{device}'. No attached disk found with "
                                    f"device name '{device}'", "invalid")
        instance["disks"] = [d for d in instance["disks"] if d is not found]
        m = _DISK_SOURCE.match(found["source"])
        disk = self.disks.get((m["p"], m["z"], m["name"])) if m else None
        if disk is not None:
            disk["users"] = [u for u in disk["users"] if u != instance["selfLink"]]
        return 200, self._new_op(p, z, "detachDisk", name)

    def _reserved(self, p: str, z: str, body: dict, name: str, request_id: str
                  ) -> tuple[Optional[tuple], Optional[tuple]]:
        """(the key of the reservation that takes the VM, None), (None, None) without a specific reservation, or (None,
        Compute's refusal): the affinity's error at once, the reservation's in the insert's operation."""
        affinity = body.get("reservationAffinity") or {}
        if affinity.get("consumeReservationType") != "SPECIFIC_RESERVATION":
            return None, None
        if affinity.get("key") != _AFFINITY_KEY:
            return None, _http_error(400, f"Invalid value for field 'resource.reservationAffinity.key': "
                                          f"'{affinity.get('key')}'.", "invalid")
        value = (affinity.get("values") or [""])[0]
        m = re.fullmatch(r"(?:projects/(?P<p>[^/]+)/reservations/)?(?P<n>[^/]+)", value)
        key = ((m["p"] or p) if m else p, z, m["n"] if m else value)
        reservation = self.reservations.get(key)

        def unmet(message: str) -> tuple[None, tuple[int, dict]]:
            return None, (200, self._new_op(p, z, "insert", name, request_id,
                                            error=(412, "CONDITION_NOT_MET", message)))

        if reservation is None:
            return unmet(f"Specified reservation '{value}' does not exist.")
        if not reservation["specificReservationRequired"]:
            return None, _http_error(400, f"Invalid value for field 'resource.reservationAffinity': "
                                          f"'{json.dumps(affinity)[:60]}...'. Specified reservations [{value}] can "
                                          "not be targeted as specificReservationRequired is not set", "invalid")
        if reservation["status"] != "READY":
            return unmet(f"Cannot insert instance to a reservation with status: {reservation['status']}, as it "
                         "requires reservation to be in READY state.")
        specific = reservation["specificReservation"]
        held = specific["instanceProperties"]
        wanted = {(a["acceleratorType"].rsplit("/", 1)[-1], a["acceleratorCount"])
                  for a in body.get("guestAccelerators", [])}
        if body.get("machineType", "").rsplit("/", 1)[-1] != held["machineType"] or wanted != {
                (a["acceleratorType"], a["acceleratorCount"]) for a in held.get("guestAccelerators", [])}:
            return unmet(f"No available resources in specified reservations '{value}'")
        if int(specific["inUseCount"]) >= int(specific["count"]):
            return unmet(f"Specified reservation '{value}' does not have available resources for the request.")
        return key, None

    def _consume(self, reservation: tuple[str, str, str], instance: tuple[str, str, str], delta: int) -> None:
        specific = self.reservations[reservation]["specificReservation"]
        specific["inUseCount"] = str(int(specific["inUseCount"]) + delta)
        if delta > 0:
            self.consumed[instance] = reservation
        else:
            self.consumed.pop(instance, None)

    def _reservations(self, p: str, z: str, name: Optional[str], flt: str) -> tuple[int, dict]:
        if name:
            found = self.reservations.get((p, z, name))
            return (200, found) if found else _http_error(404, f"The resource 'projects/{p}/zones/{z}/reservations/"
                                                               f"{name}' was not found")
        items = [r for (rp, rz, _), r in sorted(self.reservations.items()) if (rp, rz) == (p, z) and _matches(r, flt)]
        return 200, {"kind": "compute#reservationList", "items": items}

    def _set_labels(self, p: str, z: str, name: str, body: dict) -> tuple[int, dict]:
        """instances.setLabels: replaces every label, given the fingerprint of the labels it replaces (Compute
        refuses a missing or stale one with 412 conditionNotMet; each change makes a new fingerprint)."""
        inst = self.instances.get((p, z, name))
        if inst is None:
            return _http_error(404, f"The resource 'projects/{p}/zones/{z}/instances/{name}' was not found")
        if body.get("labelFingerprint") != inst.get("labelFingerprint"):
            return _http_error(412, "Labels fingerprint either invalid or resource labels have changed",
                               "conditionNotMet")
        inst["labels"] = dict(body.get("labels", {}))
        inst["labelFingerprint"] = _fingerprint(inst["labels"])
        return 200, self._new_op(p, z, "setLabels", name)

    def _fault(self, p: str, z: str, name: str, fault: GCEFault, request_id: str) -> tuple[int, dict]:
        if fault.kind == "capacity":
            return 200, self._new_op(p, z, "insert", name, request_id, error=(
                503, "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
                fault.message or f"The zone 'projects/{p}/zones/{z}' does not have enough resources available "
                                 "to fulfill the request. (injected)"))
        if fault.kind == "quota":
            return 200, self._new_op(p, z, "insert", name, request_id, error=(
                403, "QUOTA_EXCEEDED", fault.message or f"Quota 'NVIDIA_T4_GPUS' exceeded.  Limit: 0.0 in region "
                                                        f"{z.rsplit('-', 1)[0]}. (injected)"))
        if fault.kind == "quota_sync":
            return _http_error(403, fault.message or "Quota 'GPUS_ALL_REGIONS' exceeded.  Limit: 0.0 globally.",
                               "quotaExceeded")
        return _http_error(fault.status, fault.message or f"injected HTTP {fault.status}", fault.reason)

    def _new_op(self, p: str, z: str, kind: str, target: str, request_id: str = "",
                error: Optional[tuple[int, str, str]] = None) -> dict:
        name = f"operation-{next(self.ids)}-{kind}"
        op = {"kind": "compute#operation", "id": str(next(self.ids)), "name": name, "operationType": kind,
              "zone": f"{self.url}/compute/v1/projects/{p}/zones/{z}", "progress": 0, "status": "RUNNING",
              "targetLink": f"{self.url}/compute/v1/projects/{p}/zones/{z}/instances/{target}",
              "selfLink": f"{self.url}/compute/v1/projects/{p}/zones/{z}/operations/{name}"}
        if error:
            status, code, message = error
            op.update(error={"errors": [{"code": code, "message": message}]}, httpErrorStatusCode=status,
                      httpErrorMessage=_OP_ERRORS[status])
        self.operations[(p, z, name)] = op
        self.polls[name] = self.op_polls
        if request_id:
            self.request_ids[(p, z, request_id)] = name
        if not self.op_polls:
            op.update(status="DONE", progress=100)
        return op

    def _operation(self, p: str, z: str, name: str, *, wait: bool) -> tuple[int, dict]:
        op = self.operations.get((p, z, name))
        if op is None:
            return _http_error(404, f"operation {name} not found")
        if wait or self.polls.get(name, 0) <= 0:
            op.update(status="DONE", progress=100)
        else:
            self.polls[name] -= 1
        return 200, op

    def _global(self, method: str, p: str, kind: str, name: Optional[str], body: dict) -> tuple[int, dict]:
        """Firewall rules (insert, get, patch, delete) and their global operations, done at once."""
        if kind == "operations":
            op = self.operations.get((p, "global", name or ""))
            return (200, op) if op else _http_error(404, f"operation {name} not found")
        if method == "POST" and not name:
            rule_name = body.get("name", "")
            if not _NAME.match(rule_name):
                return _http_error(400, f"Invalid value for field 'resource.name': '{rule_name}'.", "invalid")
            for tag in body.get("sourceTags", []) + body.get("targetTags", []):
                if not _NAME.match(tag):
                    return _http_error(400, f"Invalid value for field 'resource.targetTags': '{tag}'.", "invalid")
            if (p, rule_name) in self.firewalls:
                return _http_error(409, f"The resource 'projects/{p}/global/firewalls/{rule_name}' already exists")
            self.firewalls[(p, rule_name)] = {**body, "selfLink": f"{self.url}/compute/v1/projects/{p}/global/"
                                                                  f"firewalls/{rule_name}"}
            return 200, self._global_op(p, "insert", rule_name)
        if (p, name) not in self.firewalls:
            return _http_error(404, f"The resource 'projects/{p}/global/firewalls/{name}' was not found")
        if method == "GET":
            return 200, self.firewalls[(p, name)]
        if method == "PATCH":
            self.firewalls[(p, name)].update(body)
            return 200, self._global_op(p, "patch", name)
        if method == "DELETE":
            del self.firewalls[(p, name)]
            return 200, self._global_op(p, "delete", name)
        return _http_error(405, f"{method} not supported")

    def _global_op(self, p: str, kind: str, target: str) -> dict:
        name = f"operation-{next(self.ids)}-{kind}"
        op = {"kind": "compute#operation", "id": str(next(self.ids)), "name": name, "operationType": kind,
              "progress": 100, "status": "DONE",
              "targetLink": f"{self.url}/compute/v1/projects/{p}/global/firewalls/{target}",
              "selfLink": f"{self.url}/compute/v1/projects/{p}/global/operations/{name}"}
        self.operations[(p, "global", name)] = op
        return op

    def _region(self, p: str, r: str) -> tuple[int, dict]:
        if self.region_refusal:
            status, reason = self.region_refusal
            return _http_error(status, f"Required 'compute.regions.get' permission for 'projects/{p}/regions/{r}'",
                               reason)
        if r not in self.quotas:
            return _http_error(404, f"The resource 'projects/{p}/regions/{r}' was not found")
        base = f"{self.url}/compute/v1/projects/{p}"
        return 200, {"kind": "compute#region", "id": str(1000 + sorted(self.quotas).index(r)),
                     "creationTimestamp": "1969-12-31T16:00:00.000-08:00", "name": r, "description": r,
                     "status": "UP", "zones": [f"{base}/zones/{z}" for z in gce_zones.ZONES if z.startswith(r + "-")],
                     "quotas": [{"metric": k, "limit": v[0], "usage": v[1]} for k, v in self.quotas[r].items()],
                     "selfLink": f"{base}/regions/{r}", "supportsPzs": False}

    def _list(self, p: str, z: str, flt: str) -> tuple[int, dict]:
        try:
            items = [i for (ip, iz, _), i in sorted(self.instances.items()) if (ip, iz) == (p, z) and _matches(i, flt)]
        except ValueError as e:
            return _http_error(400, str(e))
        return 200, {"kind": "compute#instanceList", "items": items}

    def _aggregated(self, p: str, kind: str, flt: str) -> tuple[int, dict]:
        stored = self.instances if kind == "instances" else self.reservations
        scopes: dict[str, dict] = {}
        try:
            for (ip, iz, _), item in sorted(stored.items()):
                if ip == p and _matches(item, flt):
                    scopes.setdefault(f"zones/{iz}", {kind: []})[kind].append(item)
        except ValueError as e:
            return _http_error(400, str(e))
        return 200, {"kind": f"compute#{kind[:-1]}AggregatedList", "items": scopes}


def _short_link(link: str) -> str:
    """``projects/…`` of a resource URL, as Compute's messages name resources."""
    return link[link.index("projects/"):] if "projects/" in link else link


@pytest.fixture
def gce():
    server = FakeGCE().start()
    yield server
    server.stop()
