"""End to end: a secret from the caller's environment reaches a real local replica through `durastack apply`,
the worker and the dev server, while the histories the Temporal CLI shows, `config` and `ps` never hold it."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from tests.e2e import Stack, ready, running_stack, until
from tests.test_secrets import encoded_forms

pytestmark = pytest.mark.e2e

SECRET = "hf_e2e_" + "Vb7Nq2Xr9Lm4Kt8Pw3Zs6Hd1Jc5Fg0Ya"
SERVICE = """
type: service
name: secret-env
port: 8000
env: [HF_TOKEN, MODEL_ID=tiny-llm]
commands: [python3 -m http.server 8000]
resources: {cpu: 1, memory: 1GB..}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from running_stack(tmp_path_factory)


def history(stack: Stack, workflow_id: str) -> str:
    res = stack.temporal("workflow", "show", "--workflow-id", workflow_id, "--output", "json", timeout=30)
    assert res.returncode == 0, res.stderr
    return res.stdout


def payload_bytes(node) -> bytes:
    """Every payload's data in a `temporal workflow show -o json` document, decoded."""
    if isinstance(node, dict):
        own = base64.b64decode(node["data"]) if "metadata" in node and isinstance(node.get("data"), str) else b""
        return own + b"".join(payload_bytes(v) for v in node.values())
    if isinstance(node, list):
        return b"".join(payload_bytes(v) for v in node)
    return b""


def test_secret_reaches_the_replica_and_nothing_else(stack: Stack, tmp_path: Path):
    path = tmp_path / "secret-env.yml"
    path.write_text(SERVICE)
    stack.env["HF_TOKEN"] = SECRET
    try:
        applied = stack.cli("apply", "-f", str(path), "-y")
    finally:
        del stack.env["HF_TOKEN"]
    assert applied.returncode == 0, applied.stdout + applied.stderr
    until(lambda: ready(stack.ps("secret-env")) == {"0": [0]}, 60, 0.5, "the replica ready")
    out = stack.cli("exec", "secret-env", "--", "printenv", "HF_TOKEN", "MODEL_ID")
    assert out.returncode == 0 and out.stdout.split() == [SECRET, "tiny-llm"]

    config = stack.cli("config", "secret-env", "--json")
    assert config.returncode == 0, config.stderr
    assert json.loads(config.stdout)["env"] == {"HF_TOKEN": "***", "MODEL_ID": "tiny-llm"}
    printed = applied.stdout + applied.stderr + config.stdout + stack.cli("ps", "secret-env", "--json").stdout
    shown = [history(stack, "service/secret-env"), history(stack, "service/secret-env/0/r0-s0")]
    for text in [printed, *shown]:
        assert not any(form in text.encode() for form in encoded_forms(SECRET))
    for text in shown:  # the payloads themselves: the secret encrypted, the rest readable
        data = payload_bytes(json.loads(text))
        assert b"durastack-encrypted" in data and b"tiny-llm" in data
        assert not any(form in data for form in encoded_forms(SECRET))
    stop = stack.cli("stop", "secret-env", "-y")
    assert stop.returncode == 0, stop.stderr
