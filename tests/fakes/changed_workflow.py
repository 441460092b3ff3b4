"""ServiceRunWorkflow changed: the wrong way, for tests/test_replay.py to prove the replay catches it; and behind a
patch, as a later build (tests/test_worker_versioning.py).

In a module of its own: the workflow sandbox imports a workflow's module again, so it holds nothing else.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities import interface
    from models.messages import RouteInput, ScaleRequest
    from workflows.service import ServiceRunInput, ServiceRunWorkflow


@workflow.defn(name="ServiceRunWorkflow")
class ExtraActivityFirst(ServiceRunWorkflow):
    """A new activity before everything else, not behind ``workflow.patched``."""

    @workflow.run
    async def run(self, inp: ServiceRunInput) -> str:
        await workflow.execute_activity(interface.remove_route, RouteInput(service=inp.state.name),
                                        start_to_close_timeout=timedelta(seconds=10))
        return await super().run(inp)


NEW_IN_V2 = "new-in-v2"


@workflow.defn(name="ServiceRunWorkflow")
class PatchedInV2(ServiceRunWorkflow):
    """A later build: a manual scale records a patch (and a memo) that the build before it does not know. A worker
    of that older build replaying such a history fails it as non-deterministic."""

    @workflow.run
    async def run(self, inp: ServiceRunInput) -> str:
        return await super().run(inp)

    @workflow.update
    def scale(self, request: ScaleRequest) -> int:
        if workflow.patched(NEW_IN_V2):
            workflow.upsert_memo({"build": "v2"})
        return super().scale(request)

    @scale.validator
    def _validate_scale(self, request: ScaleRequest) -> None:
        super()._validate_scale(request)
