"""A fake of the Compute Engine v1 REST API — just what durastack's GCP backend uses (cloud-testing.md 2.4).

instances insert / get / list (label and status filter) / delete / aggregatedList, zone operations get and
wait; firewall rules and their global operations; unknown zones, and machine or accelerator types a zone does
not have (per tests/fakes/gce_zones.py, written from Google's documentation, not from the shipped catalog), refused
as Compute refuses them (400 invalid), and an accelerator the machine type cannot take (400 badRequest); requestId
dedupe; 409 on a duplicate name in a zone; faults: capacity and quota in the operation,
synchronous quota (403) or any HTTP error, and "lost responses" (created, then answered 503). A stdlib
ThreadingHTTPServer on 127.0.0.1:<ephemeral>; ``gce`` is the fixture (import it into a test module).
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
                        r"(?:/(?P<name>[^/]+))?(?P<wait>/wait|/setLabels)?$")
_GLOBAL_PATH = re.compile(r"^/compute/v1/projects/(?P<p>[^/]+)/global/(?P<kind>firewalls|operations)"
                          r"(?:/(?P<name>[^/]+))?(?P<wait>/wait)?$")
_AGGREGATED = re.compile(r"^/compute/v1/projects/(?P<p>[^/]+)/aggregated/instances$")
_TERM = re.compile(r'\(?\s*(labels\.[a-z0-9_-]+|status|name)\s*(=|!=)\s*"?([^")\s]*)"?\s*\)?')
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
            # What Compute has in each zone, per Google's documentation; a test may narrow or widen a zone.
            self.machine_types = {z: set(gce_zones.machine_types(z)) for z in gce_zones.ZONES}
            self.accelerator_types = {z: set(gce_zones.accelerator_types(z)) for z in gce_zones.ZONES}

    # --- test controls ----------------------------------------------------------------------------

    def fail(self, kind: str, *, zone: Optional[str] = None, machine_type: Optional[str] = None,
             times: Optional[int] = None, status: int = 503, reason: str = "", message: str = "") -> None:
        with self.lock:
            self.faults.append(GCEFault(kind, zone, machine_type, times, status, reason, message))

    def lose_responses(self, n: int) -> None:
        with self.lock:
            self.lose = n

    def inserts(self) -> list[dict]:
        with self.lock:
            return [r for r in self.requests if r["method"] == "POST" and r["path"].endswith("/instances")]

    def all_instances(self) -> list[dict]:
        with self.lock:
            return list(self.instances.values())

    # --- routes -----------------------------------------------------------------------------------

    def firewall_rules(self) -> list[dict]:
        with self.lock:
            return list(self.firewalls.values())

    def route(self, method: str, path: str, query: dict, body: dict) -> tuple[int, dict]:
        m = _GLOBAL_PATH.match(path)
        if m:
            return self._global(method, m["p"], m["kind"], m["name"], body)
        m = _AGGREGATED.match(path)
        if m and method == "GET":
            return self._aggregated(m["p"], query.get("filter", ""))
        m = _ZONE_PATH.match(path)
        if not m:
            return _http_error(404, f"no route {method} {path}")
        p, z, name = m["p"], m["z"], m["name"]
        if z not in self.machine_types:
            return _http_error(404 if method == "GET" else 400, f"Invalid value for field 'zone': '{z}'. "
                                                                 "Unknown zone.", "invalid")
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
            if self.instances.pop((p, z, name), None) is None:
                return _http_error(404, f"The resource 'projects/{p}/zones/{z}/instances/{name}' was not found")
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
        op = self._new_op(p, z, "insert", name, request_id)
        if self.lose > 0:
            self.lose -= 1
            return _http_error(503, "response lost (injected; the instance was created)")
        return 200, op

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
                      httpErrorMessage="SERVICE UNAVAILABLE" if status == 503 else "FORBIDDEN")
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

    def _list(self, p: str, z: str, flt: str) -> tuple[int, dict]:
        try:
            items = [i for (ip, iz, _), i in sorted(self.instances.items()) if (ip, iz) == (p, z) and _matches(i, flt)]
        except ValueError as e:
            return _http_error(400, str(e))
        return 200, {"kind": "compute#instanceList", "items": items}

    def _aggregated(self, p: str, flt: str) -> tuple[int, dict]:
        scopes: dict[str, dict] = {}
        try:
            for (ip, iz, _), inst in sorted(self.instances.items()):
                if ip == p and _matches(inst, flt):
                    scopes.setdefault(f"zones/{iz}", {"instances": []})["instances"].append(inst)
        except ValueError as e:
            return _http_error(400, str(e))
        return 200, {"kind": "compute#instanceAggregatedList", "items": scopes}


@pytest.fixture
def gce():
    server = FakeGCE().start()
    yield server
    server.stop()
