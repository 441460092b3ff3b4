"""Every activity stub the workflows call has exactly one implementation on the worker, with its signature,
on the queue the contract says: the replica's life on each ``<queue>-<backend>``, the rest on ``<queue>``."""

from __future__ import annotations

import inspect
import typing

import pytest
from temporalio import activity

import worker
from activities import interface
from store import Store, StoreLedger
from models.backends import BackendsConfig
from models.settings import Settings

STUBS = {name: fn for name, fn in vars(interface).items()
         if inspect.iscoroutinefunction(fn) and activity._Definition.from_callable(fn) is not None}
BACKEND_STUBS = {"place_replica", "start_replica", "await_ready", "launch_replica", "teardown_replica",
                 "monitor_replicas", "watch_fleet", "sync_router", "watch_engines"}
REAPER_STUBS = {"reap_orphans", "reap_replicas", "reap_closed"}  # the main queue; a cloud worker: reap_orphans


def _name(fn) -> str:
    return activity._Definition.must_from_callable(fn).name


def _signature(fn) -> tuple[list, object]:
    """Parameter types in order, and the return type: what Temporal encodes and decodes (not the names)."""
    hints = typing.get_type_hints(fn)
    params = [p for p in inspect.signature(fn).parameters if p != "self"]
    return [hints.get(p) for p in params], hints.get("return")


def _clouds(tmp_path, backends: dict) -> worker.Clouds:
    return worker.Clouds(BackendsConfig(), backends, StoreLedger(Store(f"sqlite:///{tmp_path}/store.db")))


def _check(queues: dict[str, list], expected: dict[str, set[str]]) -> None:
    assert set(queues) == set(expected)
    for queue, acts in queues.items():
        names = [_name(a) for a in acts]
        assert len(names) == len(set(names)), f"{queue}: an activity registered twice: {names}"
        stubs = {n for n in names if n in STUBS}
        assert stubs == expected[queue], queue
        for fn in acts:
            if _name(fn) in STUBS:
                assert _signature(fn) == _signature(STUBS[_name(fn)]), _name(fn)


def test_the_stubs_are_the_contract():
    assert set(STUBS) == BACKEND_STUBS | {"watch_stats", "ensure_route", "remove_route", "record_service", "judge_signal",
                                          "served_backends"} | REAPER_STUBS


@pytest.mark.parametrize("local_replicas", [True, False])
def test_the_main_worker_implements_every_stub_once_on_its_queue(tmp_path, local_replicas):
    settings = Settings(home=tmp_path / "home", local_replicas=local_replicas)
    clouds = _clouds(tmp_path, {"aws": object()})
    gateway = type("Gateway", (), {"stats": None})()  # only wired, never called here
    queues = worker.worker_activities(None, settings, gateway, clouds)
    q = settings.task_queue
    expected = {q: set(STUBS) - BACKEND_STUBS, f"{q}-aws": BACKEND_STUBS}
    if local_replicas:
        expected[f"{q}-local"] = BACKEND_STUBS
    _check(queues, expected)
    assert list(queues)[0] == q  # the main worker: the one with the workflows


def test_a_cloud_worker_runs_only_its_clouds_replica_activities(tmp_path):
    settings = Settings(home=tmp_path / "home")
    queues = worker.cloud_worker_activities(None, settings, None, _clouds(tmp_path, {"aws": object(), "gcp": object()}))
    q = settings.task_queue
    _check(queues, {f"{q}-aws": BACKEND_STUBS | {"reap_orphans"}, f"{q}-gcp": BACKEND_STUBS | {"reap_orphans"}})


async def test_served_backends_lists_this_machine_then_every_configured_cloud(tmp_path):
    clouds = worker.Clouds(BackendsConfig(), {"gcp": object()}, None, queues={"aws": "q-aws"})
    assert worker.served(Settings(home=tmp_path), clouds) == ["local", "aws", "gcp"]
    assert worker.served(Settings(home=tmp_path, local_replicas=False), clouds) == ["aws", "gcp"]


def test_the_workflow_tests_fake_cloud_implements_every_stub_as_the_worker_does():
    from tests.fakes.cloud import FakeCloud

    fake = FakeCloud()
    _check({"q": fake.activities(), "q-local": fake.replica_activities()},
           {"q": set(STUBS) - BACKEND_STUBS - REAPER_STUBS, "q-local": BACKEND_STUBS})
