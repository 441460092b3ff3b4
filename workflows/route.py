"""A service's gateway route: put when the service starts, whenever an apply changes its settings and (patch
route-unavailable) whenever why the service cannot serve changes; removed when the service stops."""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities import interface
    from models.messages import RouteInput
    from models.state import ServiceState
    from rules import lifecycle

# The retry of the service's helper activities (its route, its watchers): never gives up, waits at most 30 s.
RETRY = RetryPolicy(maximum_interval=timedelta(seconds=30))


class Route:
    def __init__(self) -> None:
        self.routed: Optional[RouteInput] = None  # the route last put on the gateway by this run
        self.say_unavailable = False  # the route says why the service cannot serve (patch, set by the service)

    async def sync(self, state: ServiceState) -> list[lifecycle.Note]:
        """Put the route if it is not on the gateway as the configuration wants it (its replicas stay routed).
        A gateway that refuses it (a 4xx: asking again changes nothing) is noted, not retried, and the service
        goes on with the route as it was."""
        route = lifecycle.route(state, self.say_unavailable)
        if route == self.routed:
            return []
        notes = self._changed(route)
        self.routed = route
        try:
            await workflow.execute_activity(interface.ensure_route, route, retry_policy=RETRY,
                                            start_to_close_timeout=timedelta(seconds=60), summary="gateway route")
        except ActivityError as e:
            state.routed = state.routed or False
            return [lifecycle.Note("rejected", f"the gateway refused the route: {e.cause or e}")]
        state.routed = True
        return notes

    def _changed(self, route: RouteInput) -> list[lifecycle.Note]:
        """A note when the gateway starts or stops answering 503 for the service."""
        was = self.routed.unavailable if self.routed is not None else ""
        if route.unavailable == was:
            return []
        if route.unavailable:
            return [lifecycle.Note("route", f"the gateway answers 503 at once: {route.unavailable}")]
        return [lifecycle.Note("route", "the gateway holds requests for a replica again")]

    @staticmethod
    async def remove(state: ServiceState) -> None:
        await workflow.execute_activity(
            interface.remove_route, RouteInput(service=state.name), start_to_close_timeout=timedelta(seconds=60),
            retry_policy=RETRY, summary="remove gateway route")
