"""Payloads read back from history without today's rules (models.history, connect.codec.HistoryJSONConverter);
what is admitted is still held to them (models.validation)."""

from __future__ import annotations

import json

import pytest
from temporalio.api.common.v1 import Payload

from connect.codec import data_converter
from models.history import lenient
from models.loader import load_config_text
from models.messages import ApplyRequest
from models.state import ServiceState
from rules.admission import Refused, check_apply
from workflows.service import ServiceRunInput

CONFIG = """
type: service
name: svc
port: 8000
env:
  HF_TOKEN: hf_secret
probes: [{type: http, url: /health, ready_after: 2}]
replicas:
  - count: 1..3
    commands: [python3 -m http.server 8000]
    scaling: {metric: rps, target: 2}
"""
CONVERTER = data_converter(None).payload_converter


def config():
    result = load_config_text(CONFIG)
    assert result.config is not None, result.errors
    return result.config


def recorded(value) -> dict:
    [payload] = CONVERTER.to_payloads([value])
    return json.loads(payload.data)


def read_back(raw: dict, type_hint):
    [value] = CONVERTER.from_payloads([Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(raw).encode())],
                                      [type_hint])
    return value


def test_a_payload_that_meets_the_rules_is_read_as_the_models_make_it():
    inp = ServiceRunInput(state=ServiceState(name="svc", config=config(), hash_key="k" * 64))
    assert read_back(recorded(inp), ServiceRunInput) == inp


def test_what_fails_only_a_rule_is_kept_as_recorded(caplog):
    raw = recorded(ServiceRunInput(state=ServiceState(name="svc", config=config(), hash_key="k" * 64)))
    cfg = raw["state"]["config"]
    cfg["port"]["container_port"] = 70000  # a bound
    cfg["probes"][0]["ready_after"] = 0  # another, in a list
    cfg["groups"][0]["scaling"]["window"] = 1  # a field check
    cfg["retired"] = True  # a field the model no longer has
    with pytest.raises(ValueError):  # the models alone refuse it
        ServiceRunInput.model_validate(raw)
    back = read_back(raw, ServiceRunInput)
    got = back.state.config
    assert got.port.container_port == 70000 and got.probes[0].ready_after == 0
    assert got.groups[0].scaling.window == 1 and got.groups[0].scaling.target == 2
    assert not hasattr(got, "retired")
    # Everything else read as usual: the secret's mark stripped, ranges parsed, the service's key kept.
    assert got.env["HF_TOKEN"] == "hf_secret" and back.state.hash_key == "k" * 64
    assert (got.groups[0].count.min, got.groups[0].count.max) == (1, 3)
    assert got.replica_groups[0].commands == ["python3 -m http.server 8000"]
    # The log says which rules it does not meet, never the values (one may be a secret).
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "container_port" in said and "ready_after" in said and "hf_secret" not in said


def test_short_forms_are_still_parsed_when_a_rule_fails():
    assert lenient(ServiceState, {"name": "svc", "config": {**recorded(config()), "port": 70000}}) \
        .config.port.container_port == 70000


def test_an_update_read_back_leniently_is_still_judged_by_the_rules():
    """Only history is read without the rules: an `apply` update that a client of its own sends with a bound
    skipped is decoded (the worker must read it to judge it), then refused by the rules `apply` runs."""
    raw = recorded(ApplyRequest(config=config()))
    raw["config"]["port"]["container_port"] = 70000
    request = read_back(raw, ApplyRequest)
    with pytest.raises(Refused, match=r"port\.container_port: Input should be less than or equal to 65535"):
        check_apply("svc", config(), False, request.config)
