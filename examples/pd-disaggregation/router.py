"""The stand-in router: every request of the service enters here (the only group the gateway routes to).

Workers register themselves (POST /register, again every second); one not heard of for TTL seconds, or
that fails a request, is dropped. A request is answered by one prefill worker, then one decode worker,
each picked round-robin, and the answer says who did what.
"""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import JSONHandler, replica_name, serve  # noqa: E402

TTL = 3.0
ROLES = ("prefill", "decode")
workers: dict[str, dict[str, tuple[str, float]]] = {role: {} for role in ROLES}  # role → id → (url, last seen)
lock = threading.Lock()
turns = itertools.count()


def live(role: str) -> list[tuple[str, str]]:
    now = time.monotonic()
    with lock:
        for wid, (_, seen) in list(workers[role].items()):
            if now - seen > TTL:
                del workers[role][wid]
        return sorted((wid, url) for wid, (url, _) in workers[role].items())


def call(role: str, path: str, payload: dict) -> dict:
    """Ask one live worker of ``role``; a worker that fails is dropped and the next one tried."""
    for _ in range(3):
        choices = live(role)
        if not choices:
            raise LookupError(f"no {role} worker registered")
        wid, url = choices[next(turns) % len(choices)]
        request = urllib.request.Request(f"{url}{path}", data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return json.loads(response.read())
        except OSError:
            with lock:
                workers[role].pop(wid, None)
    raise LookupError(f"no {role} worker answered")


class Router(JSONHandler):
    def do_POST(self) -> None:
        if self.path == "/register":
            body = self.read_json()
            if body.get("role") not in ROLES or not str(body.get("url", "")).startswith("http://"):
                return self.send_json(400, {"error": "role (prefill|decode) and url (http://ip:port) needed"})
            with lock:
                workers[body["role"]][str(body.get("id") or body["url"])] = (body["url"], time.monotonic())
            return self.send_json(200, {"ok": True})
        self.do_GET()

    def do_GET(self) -> None:
        if self.path == "/workers":
            return self.send_json(200, {role: dict(live(role)) for role in ROLES})
        prompt = self.path
        try:
            kv = call("prefill", "/prefill", {"prompt": prompt})
            out = call("decode", "/decode", {"kv": kv["kv"]})
        except LookupError as e:
            return self.send_json(503, {"router": replica_name(), "error": str(e)})
        self.send_json(200, {"router": replica_name(), "prefill": kv["worker"], "decode": out["worker"],
                             "text": out["text"]})


if __name__ == "__main__":
    serve(Router)
