"""What the stand-in's router and workers share: where this replica listens, and a small JSON HTTP server."""

from __future__ import annotations

import json
import os
import secrets
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def own_ip() -> str:
    """Where the other replicas of the service reach this one (durastack gives it in the replica's env)."""
    return os.environ.get("DURASTACK_REPLICA_IP") or "127.0.0.1"


def bind_host() -> str:
    # On a private service network (or a cloud) the others come from outside; on the host's loopback
    # (a local backend without isolation) listening there is enough and exposes nothing.
    return "127.0.0.1" if own_ip().startswith("127.") else "0.0.0.0"


def port() -> int:
    return int(os.environ.get("PORT", "8000"))


_INSTANCE = secrets.token_hex(2)  # tells a replacement (same replica number, new submission) from its predecessor


def replica_name() -> str:
    return f"{os.environ.get('DURASTACK_GROUP', '?')}/r{os.environ.get('DURASTACK_REPLICA', '?')}#{_INSTANCE}"


class JSONHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def send_json(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def read_json(self) -> dict:
        size = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(size) or b"{}") if size else {}

    def log_message(self, fmt: str, *args) -> None:  # one short line per request, in the replica's log
        print(f"{replica_name()} {self.command} {self.path} {args[1] if len(args) > 1 else ''}", flush=True)


def serve(handler: type[JSONHandler]) -> None:
    server = ThreadingHTTPServer((bind_host(), port()), handler)
    server.daemon_threads = True
    print(f"{replica_name()} listening on {bind_host()}:{port()} (reached at {own_ip()}:{port()})", flush=True)
    server.serve_forever()
