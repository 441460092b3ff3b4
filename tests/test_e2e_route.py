"""Route settings through a real `durastack server`: the service file's rate limits, strip_prefix and
pass_authorization reach nginx, and an apply that changes them updates the route without restarting a replica."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.e2e import Stack, ready, running_stack, until

pytestmark = [pytest.mark.e2e, pytest.mark.long]

# The replica's app answers with the path and the Authorization header it got.
SERVICE = """
type: service
name: routed
port: 8000
replicas: 1
commands:
  - |
    python3 - <<'APP'
    import http.server, json
    class Echo(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps([self.path, self.headers.get("Authorization")]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    http.server.ThreadingHTTPServer(("", 8000), Echo).serve_forever()
    APP
resources: {{cpu: 1, memory: 1GB..}}
{extra}
"""
LIMITED = ("strip_prefix: false\npass_authorization: true\nrate_limits:\n"
           "  - {prefix: /v1, rps: 0.02, burst: 1}  # relative to the service, whether or not the prefix is stripped\n")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from running_stack(tmp_path_factory)


def apply(stack: Stack, tmp_path: Path, extra: str) -> None:
    path = tmp_path / "routed.yml"
    path.write_text(SERVICE.format(extra=extra))
    result = stack.cli("apply", "-f", str(path), "-y")
    assert result.returncode == 0, result.stdout + result.stderr


def get(stack: Stack, path: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {stack.token()}"}
    return httpx.get(f"{stack.gateway}/services/routed{path}", headers=headers, timeout=10, trust_env=False)


def seen(stack: Stack, path: str):
    """What the replica saw of a request, or None when the gateway answered it (e.g. 429)."""
    answer = get(stack, path)
    return answer.json() if answer.status_code == 200 else None


def test_route_settings_from_the_file_to_nginx_and_back(stack: Stack, tmp_path: Path):
    apply(stack, tmp_path, "")
    until(lambda: ready(stack.ps("routed")) == {"0": [0]}, 120, 0.5, "the replica ready")
    first = get(stack, "/v1/a")
    assert first.json() == ["/v1/a", None]  # stripped, and the gateway token kept from the replica

    apply(stack, tmp_path, LIMITED)  # in place: the same replica, a new route
    until(lambda: (seen(stack, "/v1/a") or [""])[0] == "/services/routed/v1/a", 60, 0.5, "the route updated")
    assert get(stack, "/x").json() == ["/services/routed/x", f"Bearer {stack.token()}"]
    codes = [get(stack, "/v1/b").status_code for _ in range(3)]
    assert 429 in codes and codes[-1] == 429  # the rate (one per 50 s) and its burst are used up
    assert get(stack, "/x").status_code == 200  # outside the limit's prefix
    (replica,) = stack.ps("routed")["groups"][0]["replicas"]  # the same replica, never restarted
    assert (replica["replica"], replica["submission"], replica["status"]) == (0, 0, "running")

    apply(stack, tmp_path, "")  # back: no limit, prefix stripped, header dropped
    until(lambda: seen(stack, "/v1/a") == ["/v1/a", None], 60, 0.5, "the route back")
    assert all(get(stack, "/v1/b").status_code == 200 for _ in range(3))
    assert stack.cli("stop", "routed", "-y").returncode == 0
