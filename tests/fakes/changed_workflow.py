"""ServiceRunWorkflow changed the wrong way, for tests/test_replay.py to prove the replay catches it.

In a module of its own: the workflow sandbox imports a workflow's module again, so it holds nothing else.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities import interface
    from models.run import RouteInput
    from workflows.service import ServiceRunInput, ServiceRunWorkflow


@workflow.defn(name="ServiceRunWorkflow")
class ExtraActivityFirst(ServiceRunWorkflow):
    """A new activity before everything else, not behind ``workflow.patched``."""

    @workflow.run
    async def run(self, inp: ServiceRunInput) -> str:
        await workflow.execute_activity(interface.remove_route, RouteInput(service=inp.state.name),
                                        start_to_close_timeout=timedelta(seconds=10))
        return await super().run(inp)
