"""A stand-in prefill or decode worker: registers with the router, then answers its part of a request.

    python3 worker.py prefill|decode http://<router ip>:<router port>

The router's address comes from the service file: ``${{ groups[router].replicas[0].IP_ADDRESS }}``,
substituted by durastack before this replica starts (and a new one started when the router moves).
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import JSONHandler, own_ip, port, replica_name, serve  # noqa: E402

ROLE, ROUTER = sys.argv[1], sys.argv[2].rstrip("/")


def register_forever() -> None:
    """Every second, so that a router that restarted (or a new one) learns of this worker within a second."""
    body = json.dumps({"role": ROLE, "url": f"http://{own_ip()}:{port()}", "id": replica_name()}).encode()
    while True:
        try:
            request = urllib.request.Request(f"{ROUTER}/register", data=body,
                                             headers={"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=2).close()
        except OSError as e:
            print(f"{replica_name()}: router {ROUTER} not reached: {e}", flush=True)
        time.sleep(1)


class Worker(JSONHandler):
    def do_POST(self) -> None:
        body = self.read_json()
        if ROLE == "prefill" and self.path == "/prefill":
            kv = hashlib.sha256(str(body.get("prompt", "")).encode()).hexdigest()[:12]
            return self.send_json(200, {"worker": replica_name(), "kv": kv})
        if ROLE == "decode" and self.path == "/decode":
            return self.send_json(200, {"worker": replica_name(), "text": f"decoded {body.get('kv', '')}"})
        self.send_json(404, {"error": f"a {ROLE} worker has no {self.path}"})

    def do_GET(self) -> None:
        self.send_json(200, {"worker": replica_name(), "role": ROLE})


if __name__ == "__main__":
    threading.Thread(target=register_forever, daemon=True).start()
    serve(Worker)
