"""`durastack apply`'s pieces that need no server: the update id, and how the result is told."""

from __future__ import annotations

from cli.service import _print_result, apply_update_id
from models.loader import load_config_text
from models.run import ApplyRequest, ApplyResult

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


def test_the_same_file_over_the_same_deployment_is_the_same_update():
    assert apply_update_id(config(), 3) == apply_update_id(config(), 3)
    assert apply_update_id(config(), None) == apply_update_id(config(), None)
    # Over another deployment it is another update: A, B, then A again must apply A again.
    assert apply_update_id(config(), 3) != apply_update_id(config(), 4) != apply_update_id(config(), None)
    # A new secret value is a change, and the id does not show it.
    assert apply_update_id(config("hf_two"), 3) != apply_update_id(config(), 3)
    assert "hf_one" not in apply_update_id(config(), 3)


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
