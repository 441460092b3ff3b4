"""Saved workflow histories replay against the current workflow code (fast; in `make test`).

A failure here means a change to workflows/ would break services that are running now: on their next
workflow task, the worker would replay their history with the new code, meet a different command than
the one recorded, and stop them with a NondeterminismError. Put the change behind ``workflow.patched``
(CONTRIBUTING.md) instead of re-capturing; tests/histories/capture.py says how and when to re-capture.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer
from temporalio.workflow import NondeterminismError

from tests.conftest import DATA_CONVERTER
from tests.fakes.changed_workflow import ExtraActivityFirst
from rules import admission
from workflows.fleet import FleetMonitorWorkflow
from workflows.reaper import ReaperWorkflow
from workflows.replica import ReplicaWorkflow
from workflows.service import ServiceRunWorkflow

HISTORIES = sorted((Path(__file__).resolve().parent / "histories").glob("*.json"))


def replayer(*workflows) -> Replayer:
    # The worker's converter (connect.codec via connect.connection), as conftest builds it for every workflow
    # test; the histories hold no secret, so no particular codec key is needed to read them.
    return Replayer(workflows=list(workflows), data_converter=DATA_CONVERTER)


def history(path: Path) -> WorkflowHistory:
    return WorkflowHistory.from_json(path.stem, path.read_text())


def workflow_type(h: WorkflowHistory) -> str:
    return h.events[0].workflow_execution_started_event_attributes.workflow_type.name


def test_histories_cover_every_workflow():
    types = [workflow_type(history(p)) for p in HISTORIES]
    assert types.count("ServiceRunWorkflow") >= 3 and "ReplicaWorkflow" in types and "ReaperWorkflow" in types \
        and "FleetMonitorWorkflow" in types, \
        [p.name for p in HISTORIES]


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_saved_history_replays(path: Path):
    await replayer(ServiceRunWorkflow, ReplicaWorkflow, ReaperWorkflow, FleetMonitorWorkflow).replay_workflow(
        history(path))


async def test_an_unpatched_change_is_caught():
    path = next(p for p in HISTORIES if workflow_type(history(p)) == "ServiceRunWorkflow")
    with pytest.raises(NondeterminismError, match="Nondeterminism"):
        await replayer(ExtraActivityFirst, ReplicaWorkflow).replay_workflow(history(path))


async def test_a_tightened_rule_does_not_change_how_a_signalled_apply_replays(monkeypatch):
    """The history holds an `apply` and a `scale` that came by signal and were accepted. A later release
    that refuses every configuration and every count must still replay it: the verdicts are in history
    (the judge's local-activity markers), and no handler runs a rule."""
    path = next(p for p in HISTORIES if p.stem == "service_signalled_apply")
    h = history(path)
    accepted = [e for e in h.events if e.HasField("marker_recorded_event_attributes")]
    assert accepted, "the signals' verdicts are recorded as markers"

    def refuse(*args, **kwargs):
        raise admission.Refused("InvalidConfiguration", "a rule added later refuses everything")

    monkeypatch.setattr(admission, "check_apply", refuse)
    monkeypatch.setattr(admission, "check_scale", refuse)
    await replayer(ServiceRunWorkflow, ReplicaWorkflow).replay_workflow(h)


def _loosened(h: WorkflowHistory, change) -> WorkflowHistory:
    """``h`` with its start input changed by ``change(input)``: what a run admitted under looser rules holds."""
    raw = json.loads(h.to_json())
    payload = raw["events"][0]["workflowExecutionStartedEventAttributes"]["input"]["payloads"][0]
    data = json.loads(base64.b64decode(payload["data"]))
    change(data)
    payload["data"] = base64.b64encode(json.dumps(data).encode()).decode()
    return WorkflowHistory.from_json(h.workflow_id, raw)


def _yesterdays_config(data: dict) -> None:
    config = data["state"]["config"]
    config["port"]["local_port"] = 70000  # past today's bound (1..65535)
    config["retired_field"] = True  # a field the models no longer have


async def test_a_history_admitted_under_looser_rules_still_replays():
    """A release that tightens a bound or removes a field must not strand running services: their histories
    decode without today's rules (models.history); only what is admitted is held to them."""
    path = next(p for p in HISTORIES if p.stem == "service_signalled_apply")
    h = _loosened(history(path), _yesterdays_config)
    await replayer(ServiceRunWorkflow, ReplicaWorkflow).replay_workflow(h)
    # The same history read with the rules applied (pydantic's own converter) fails its first workflow task.
    strict = Replayer(workflows=[ServiceRunWorkflow, ReplicaWorkflow],
                      data_converter=dataclasses.replace(pydantic_data_converter,
                                                         payload_codec=DATA_CONVERTER.payload_codec))
    with pytest.raises(Exception, match="validation error"):
        await strict.replay_workflow(h)
