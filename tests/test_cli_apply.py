"""`durastack apply`'s pieces that need no server: the update id, and how the result is told."""

from __future__ import annotations

import hashlib
import json

from cli.service import _print_result, apply_update_id
from connect.codec import CodecKeys
from models.secrets import REVEAL
from models.loader import load_config_text
from models.messages import ApplyRequest, ApplyResult

SERVICE = """
type: service
name: svc
port: 8000
env:
  HF_TOKEN: {token}
replicas:
  - count: 1
    commands: [python3 -m http.server 8000]
"""


def config(token: str = "hf_one"):
    result = load_config_text(SERVICE.format(token=token))
    assert result.config is not None, result.errors
    return result.config


KEYS = CodecKeys((b"k" * 32,), "test")


def test_the_same_file_over_the_same_deployment_is_the_same_update():
    assert apply_update_id(config(), KEYS, 3) == apply_update_id(config(), KEYS, 3)
    assert apply_update_id(config(), KEYS, None) == apply_update_id(config(), KEYS, None)
    # Over another deployment it is another update: A, B, then A again must apply A again.
    ids = [apply_update_id(config(), KEYS, seen) for seen in (3, 4, None)]
    assert len(set(ids)) == 3
    # A new secret value is a change, and the id does not show it.
    assert apply_update_id(config("hf_two"), KEYS, 3) != apply_update_id(config(), KEYS, 3)
    assert "hf_one" not in apply_update_id(config(), KEYS, 3)


def test_the_update_id_cannot_be_recomputed_without_the_codec_key():
    """The id is in history in clear: a plain hash of the file would let anyone who reads history test guesses of
    its secret values (a short token) against it."""
    payload = config().model_dump(mode="json", context=REVEAL)
    plain = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    ours = apply_update_id(config(), KEYS, 3)
    assert plain not in ours
    assert ours != apply_update_id(config(), CodecKeys((b"o" * 32,), "another"), 3)


def test_the_request_carries_the_typed_configuration():
    request = ApplyRequest(config=config())
    assert request.config.name == "svc"
    assert ApplyRequest.model_validate(request.model_dump(mode="json")).config == request.config
    assert ApplyResult(deployment=2).changed  # what an older workflow's answer means


def test_a_deployment_past_the_expected_one_names_the_apply_before_it(capsys):
    _print_result("svc", ApplyResult(deployment=2, kept=1, replacing=0), expected=2)
    assert capsys.readouterr().out.startswith("svc: deployment 2: 1 replica(s) kept in place")
    _print_result("svc", ApplyResult(deployment=3, kept=0, replacing=2), expected=2)
    assert "svc: deployment 3 (applied after deployment 2 from another apply): 0 replica(s)" in capsys.readouterr().out
    _print_result("svc", ApplyResult(deployment=4, kept=2, replacing=1, following={"prefill": 1}))
    assert "1 to replace one at a time per group, then 1 in group prefill that name(s) them" in capsys.readouterr().out
