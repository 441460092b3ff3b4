"""How a service's state answers what happens to it (pure): a new deployment, a manual scale, a
replica's report, a replica seen dead. Each returns the notes for the decision log.

The ServiceRunWorkflow calls these from its handlers and its loop; no Temporal, no I/O here, so each
rule is tested on plain models (tests/test_lifecycle.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Optional

from models.common import format_duration
from models.failures import retry_event, without_output
from models.gateway import RouteRateLimit
from models.messages import ApplyResult, Down, ReplicaUpdate, RouteInput
from models.state import UNKNOWN_NAMES, EngineSnapshot, GroupState, Replica, ServiceState
from models.views import Event
from models.service import SUMMED_METRICS, ServiceConfiguration
from rules import addresses, idle
from rules.autoscaler import Below, GroupScaler, engine_total
from rules.changes import classify, spec_hash
from rules.planner import Plan, count_failure, sync_groups

MAX_EVENTS = 200  # the latest decisions kept in state; the store's decision log keeps them all
MAX_UNRECORDED = 2000  # while the store is unreachable; older ones are then dropped from the log


@dataclass(frozen=True)
class Note:
    """One entry for the decision log (`durastack events`)."""

    kind: str
    message: str
    group: Optional[str] = None


def deploy(state: ServiceState, new: ServiceConfiguration) -> tuple[ApplyResult, list[Note]]:
    """A new configuration: counts apply at once, changed jobs roll out replica by replica.

    Groups it changes forget their back-off and failed rollout: a fix must take effect at once."""
    changes = classify(state.config, new)
    if not changes.any:
        return ApplyResult(deployment=state.deployment_num, changed=False), []
    changed = {g.name for g in new.replica_groups
               if state.config.group(g.name) != g or _spec(state, g.name) != _spec(state, g.name, new)}
    state.previous_config, state.config = state.config, new
    state.deployment_num += 1
    state.groups = sync_groups(new, state.groups)
    for group in state.groups.values():
        group.rollout_failed = ""
        if group.name in changed:
            _forgive(group)
    kept = _keep_unchanged(state)
    what = ", ".join(changes.in_place + changes.rolling)
    replacing = sum(1 for r in state.replicas if r.active and r.deployment_num < state.deployment_num)
    following = addresses.roll_after(state)
    then = "".join(f", then {n} in {g} naming them" for g, n in sorted(following.items()))
    note = Note("apply", f"deployment {state.deployment_num}: changed {what}; {kept} replica(s) kept, "
                         f"{replacing} roll{then}")
    return ApplyResult(deployment=state.deployment_num, in_place=changes.in_place, rolling=changes.rolling,
                       kept=kept, replacing=replacing, following=following), [note]


def _spec(state: ServiceState, group: str, config: Optional[ServiceConfiguration] = None) -> str:
    """What a replica of ``group`` runs under ``config`` (the service's by default), hashed with its key."""
    return spec_hash(config or state.config, group, state.hash_key)


def _keep_unchanged(state: ServiceState) -> int:
    """Replicas whose job does not change join the new deployment without a restart."""
    hashes = {g.name: _spec(state, g.name) for g in state.config.replica_groups}
    kept = 0
    for r in state.replicas:
        if not r.finished and r.deployment_num < state.deployment_num and hashes.get(r.group) == r.spec_hash:
            r.deployment_num = state.deployment_num
            kept += 1
    return kept


def rescale(state: ServiceState, group_name: str, count: int, now: datetime) -> list[Note]:
    """A manual scale: the count holds until the group's scaling delay, and the group's back-off ends."""
    group = state.groups[group_name]
    notes = [Note("scale", f"{group.desired} → {count} (manual scale)", group_name)] if group.desired != count else []
    group.desired, group.last_scaled_at, group.below_since = count, now, None
    _forgive(group)
    return notes


def _forgive(group: GroupState) -> None:
    """A new deployment or a manual scale of the group: its next replica starts now, not after a back-off, and
    `retry.duration` counts afresh."""
    group.failures, group.retry_after, group.last_failed_at, group.failing_since = 0, None, None, None
    group.failed_start = ""


def on_replica_update(state: ServiceState, update: ReplicaUpdate, now: datetime) -> list[Note]:
    """A replica's report. Reports are fire-and-forget and may repeat or arrive late: one not newer than
    the last applied (``seq``) is dropped."""
    replica = state.find(update.replica_num, update.submission_num)
    if replica is None or replica.finished or update.seq <= replica.seq:
        return []
    served = replica.ready  # before this report: a failure after serving is no failed start
    replica.seq = update.seq
    replica.status, replica.ready, replica.registered = update.status, update.ready, update.registered
    replica.placement = update.placement or replica.placement
    notes: list[Note] = []
    if state.one_place and not state.place and update.placement is not None:
        state.place = f"{update.placement.backend}/{update.placement.region}"
        notes.append(Note("place", f"the service is placed on {update.placement.backend} "
                                   f"{update.placement.region}: its replicas reach each other there, and all of "
                                   "them go there", replica.group))
    replica.instance = update.instance or replica.instance
    replica.reason = update.reason or replica.reason
    if update.refs and not update.refs.items() <= replica.refs.items():  # its late references, resolved once placed
        replica.refs = {**replica.refs, **update.refs}
        notes.append(_starts_with(replica, update.refs))
    group = state.groups.get(replica.group)
    if replica.serves and group is not None:
        group.failed_start = ""  # the group serves again: no longer crash-looping
    if update.status in ("terminating", "failed") and not replica.stop_requested and group is not None:
        replica.stop_requested = True  # counted once: a later report of the same failure finds it stopping
        notes += _failed(state, group, replica, update.reason or "failed", now, served)
    if replica.finished:
        replica.finished_at = now
        kept = f"; {idle.keep(state, replica, update.instance, now)}" if update.idle and update.instance else ""
        notes.append(Note("replica", f"replica {replica.replica_num} {replica.status}: {replica.reason}{kept}",
                          replica.group))
    return notes


def on_down(state: ServiceState, down: Down, now: datetime) -> tuple[Optional[Replica], list[Note]]:
    """The monitor saw a serving replica die (already unrouted): it counts as a failure and is replaced.
    Returns the replica to stop, or None when it was already leaving."""
    replica = state.find(down.replica_num, down.submission_num)
    if replica is None or replica.finished or replica.stop_requested:
        return None, []
    replica.stop_requested, replica.registered, replica.reason = True, False, down.reason
    group = state.groups.get(replica.group)
    failed = _failed(state, group, replica, down.reason, now) if group is not None else []
    then = "not replaced" if state.failure else "replacing"
    return replica, [Note("replica", f"replica {replica.replica_num} down: {down.reason}; unrouted, {then}",
                          replica.group)] + failed


def _failed(state: ServiceState, group: GroupState, replica: Replica, reason: str, now: datetime,
            served: Optional[bool] = None) -> list[Note]:
    """A replica failed: back off before the group's next one, and stop a rollout whose new replica failed.
    A failure the configuration's `retry` does not cover fails the service instead (but never a rollout's
    new replica: the old replicas keep serving)."""
    count_failure(group, now)
    # A replica that was ready when it failed had served (the monitor saw it die): its replacement is a cold start.
    served = replica.ready if served is None else served
    # What the gateway's 503 and `ps` say: the replica's last output stays in its event.
    group.failed_start = "" if served else f"replica {replica.replica_num} {without_output(reason)}"
    rollout = state.rolling(group.name) and replica.deployment_num == state.deployment_num
    if not rollout and not state.stopping:
        why = not_retried(state.config, group, reason, now)
        if why:
            state.stopping, state.failure = True, \
                f"replica {replica.replica_num} {without_output(reason)}; not retried: {why}"
            return [Note("stop", f"service failed: {state.failure}", group.name)]
    notes = []
    if group.retry_after is not None:
        notes.append(Note("backoff", f"{group.failures} failures in a row: next replica after "
                                     f"{group.retry_after:%H:%M:%S} UTC", group.name))
    if rollout:
        group.rollout_failed = reason
        notes.append(Note("rollout", f"rollout to deployment {state.deployment_num} stopped: replica "
                                     f"{replica.replica_num} {reason}; old replicas keep serving "
                                     "(apply the previous file or `durastack rollback`)", group.name))
    return notes


def not_retried(config: ServiceConfiguration, group: GroupState, reason: str, now: datetime) -> str:
    """Why the configuration's `retry` does not replace a replica that failed for ``reason`` (the group's
    failure already counted); '' when it does. Without `retry` every failure is replaced."""
    retry = config.retry
    if retry is None:
        return ""
    event = retry_event(reason)
    if event not in retry.on_events:
        return f"'{event}' is not in retry.on_events"
    since = group.failing_since or now
    if retry.duration is not None and now - since > timedelta(seconds=retry.duration):
        return f"failing for longer than retry.duration {format_duration(retry.duration)}"
    return ""


def autoscale(state: ServiceState, now: datetime, fresh: bool, steady: bool = False) -> list[Note]:
    """The autoscaler applied to every group with `scaling`, each decision noted with what its metric read.
    ``fresh``: a new reading arrived, so a decision held by a delay is worth noting once. ``steady``: a scale-down
    waits for the group to have wanted fewer for its whole down-delay (autoscaler.decide)."""
    notes = []
    for spec in state.config.replica_groups:
        if spec.scaling is None:
            continue
        group, scaler = state.groups[spec.name], GroupScaler.of(spec)
        total, seen = group_signal(state, spec.name)
        span = scaler.below(span_of(group), group.desired, total, now) if steady else None
        d = scaler.decide(group.desired, total, group.last_scaled_at, now, span, steady)
        if d.new != group.desired:
            notes.append(Note("scale", f"{group.desired} → {d.new}: {d.reason}; {seen}", group.name))
            group.desired, group.last_scaled_at = d.new, now
            span = scaler.below(None, d.new, total, now) if steady else None  # counted from here
        elif fresh and "delay" in d.reason:
            notes.append(Note("hold", f"stays at {group.desired}: {d.reason}; {seen}", group.name))
        group.below_since, group.below_most = (span.since, span.most) if span else (None, 0)
    return notes


def on_engines(state: ServiceState, snapshots: list[EngineSnapshot]) -> list[Note]:
    """What the engine watchers read, kept (of serving replicas only), and noted: a replica whose engine cannot
    be read, once each time it starts or stops being so, and an engine that exposes none of the names, once."""
    notes: list[Note] = []
    serving = {r.key for r in state.latest() if r.serves}
    for snap in snapshots:
        before = {(s.replica_num, s.submission_num): s for s in
                  (state.engines[snap.backend].replicas if snap.backend in state.engines else [])}
        snap = snap.model_copy(update={"replicas": [s for s in snap.replicas
                                                    if (s.replica_num, s.submission_num) in serving]})
        state.engines[snap.backend] = snap
        for s in snap.replicas:
            was = before.get((s.replica_num, s.submission_num))
            group = state.groups.get(s.group)
            if s.error.startswith(UNKNOWN_NAMES):  # the engine's own doing, the same on every replica: said once
                if group is not None and group.engine_note != s.error:
                    group.engine_note = s.error
                    notes.append(Note("engine", f"the engines expose none of the names: {s.error}; "
                                                "the group does not scale until they do", s.group))
            elif s.unreadable and (was is None or was.error != s.error):
                notes.append(Note("engine", f"replica {s.replica_num}: engine not read: {s.error} (counted as the "
                                            "group's average)", s.group))
            elif s.value is not None and was is not None and was.unreadable:
                notes.append(Note("engine", f"replica {s.replica_num}: engine read again", s.group))
    return notes


def span_of(group: GroupState) -> Optional[Below]:
    """Since when the group has wanted fewer replicas than it has, as autoscale last saw it."""
    return Below(group.below_since, group.below_most) if group.below_since is not None else None


def group_signal(state: ServiceState, name: str) -> tuple[Optional[float], str]:
    """What a scaled group's metric totals now (None: nothing to go by) and how it was read, for the log."""
    spec = state.config.group(name)
    assert spec is not None and spec.scaling is not None
    scaling, snap = spec.scaling, state.stats
    rate = snap.rate(scaling.window) if snap is not None else None
    if not scaling.engine:
        if rate is None:
            return None, ""
        seen = f"rps {rate:.2f} over {scaling.window}s, target {scaling.target:g}"
        if not state.config.routed(name):  # the gateway never sees a worker's own rate
            seen += f" (the service's rate: all its traffic enters through router group '{state.config.router_group}')"
        return rate, seen
    serving = {r.key for r in state.latest() if r.group == name and r.serves}
    if not serving:  # no engine to read: at zero, the first request the gateway sees wakes the group
        if state.groups[name].desired == 0 and rate:
            return min(rate, scaling.target), f"a request arrived (rps {rate:.2f}); {scaling.metric} target " \
                                              f"{scaling.target:g}"
        return None, ""
    signals = sorted((s for e in state.engines.values() for s in e.replicas
                      if s.group == name and (s.replica_num, s.submission_num) in serving),
                     key=lambda s: s.replica_num)
    read = [s.value for s in signals if s.value is not None]
    counted = len(read) + sum(1 for s in signals if s.unreadable)  # a replica not read yet has taken no load yet
    total = engine_total(sum(read), len(read), counted)
    each = ", ".join(f"r{s.replica_num} {s.value:.3g}" if s.value is not None else f"r{s.replica_num} unread ({s.error})"
                     for s in signals)
    if total is None:
        return None, f"{scaling.metric}: no replica read ({each or 'not read yet'})"
    unread = counted - len(read)
    shown = f"{total:.3g}" if scaling.metric in SUMMED_METRICS else f"{counted} × {total / counted:.3g}"
    seen = (f"{scaling.metric} {shown} over {scaling.window}s ({each}"
            f"{f'; {unread} unread counted as the average' if unread else ''}), target {scaling.target:g}")
    if total == 0 and rate:  # idle engines, but requests still arrive: the group does not sleep (as with `rps`)
        return min(rate, scaling.target), seen + f"; requests still arrive (rps {rate:.2f})"
    return total, seen


def add_replicas(state: ServiceState, plan: Plan, now: datetime) -> tuple[list[Replica], list[Note]]:
    """The replicas the plan starts, added to the state: each with the addresses its commands use and
    whether the gateway routes to it (not to workers behind a router group)."""
    added, notes = [], []
    for s in plan.start:
        refs = dict(plan.refs.get(s.group, {}))  # the planner starts a group only once all of them resolve
        replica = Replica(replica_num=s.replica_num, submission_num=s.submission_num, group=s.group,
                          deployment_num=state.deployment_num, submitted_at=now,
                          spec_hash=_spec(state, s.group), routed=state.config.routed(s.group), refs=refs)
        state.replicas.append(replica)
        state.next_replica_num = max(state.next_replica_num, s.replica_num + 1)
        added.append(replica)
        if refs:
            notes.append(_starts_with(replica, refs))
    return added, notes


def _starts_with(replica: Replica, refs: dict[str, str]) -> Note:
    return Note("replica", f"replica {replica.replica_num} starts with " +
                ", ".join(f"{k} = {v}" for k, v in sorted(refs.items())), replica.group)


def remember_waits(state: ServiceState, plan: Plan) -> list[Note]:
    """Note, once each, a group that cannot start a replica for want of an address, and a group whose replicas
    roll because an address they use moved."""
    notes = []
    for name, group in state.groups.items():
        wait, moved = plan.waits.get(name, ""), plan.readdressed.get(name, "")
        if wait and wait != group.waiting:
            notes.append(Note("wait", f"a replica cannot start yet: {wait}", name))
        if moved and moved != group.readdressed:
            notes.append(Note("rollout", f"replicas roll: a replica their commands reference was replaced ({moved})",
                              name))
        group.waiting, group.readdressed = wait, moved
    return notes


def end_backoffs(state: ServiceState, now: datetime) -> None:
    """Back-offs that have run out are forgotten, so `ps` shows only the ones a group still waits on."""
    for group in state.groups.values():
        if group.retry_after is not None and group.retry_after <= now:
            group.retry_after = None


def deadline(state: ServiceState) -> Optional[datetime]:
    """When the service stops itself: `max_duration` after it was submitted (an apply that changes it counts
    from the same submission); None without one."""
    if state.config.max_duration is None or state.submitted_at is None:
        return None
    return state.submitted_at + timedelta(seconds=state.config.max_duration)


def expire(state: ServiceState, now: datetime) -> list[Note]:
    """`max_duration` reached: the service stops, as if asked to (the run ends as stopped)."""
    due, limit = deadline(state), state.config.max_duration or 0
    if state.stopping or due is None or now < due:
        return []
    state.stopping = True
    return [Note("stop", f"max_duration {format_duration(limit)} reached: stopping the service")]


def next_due(state: ServiceState, now: datetime) -> Optional[datetime]:
    """When a back-off, a scaling decision held by its delay or the service's `max_duration` ends, whichever is
    first; None if none."""
    dues = [g.retry_after for g in state.groups.values() if g.retry_after is not None]
    if (due := idle.next_due(state)) is not None:
        dues.append(due)
    if (due := deadline(state)) is not None:
        dues.append(due)
    for spec in state.config.replica_groups:
        group = state.groups[spec.name]
        if spec.scaling is None or group.last_scaled_at is None:
            continue
        delay = GroupScaler.of(spec).next_check(group.desired, group_signal(state, spec.name)[0], group.last_scaled_at,
                                                span_of(group))
        if delay is not None:
            dues.append(group.last_scaled_at + timedelta(seconds=delay))
    return min((d for d in dues if d > now), default=None)


def settled(state: ServiceState) -> bool:
    """No replica is between two steps (launching, stopping): none is about to report. A continue-as-new waits for
    this: reports that reach a run while the workflow task deciding to continue is in flight can be lost (the
    server refuses that task and the SDK's replay takes the decision again before it applies them)."""
    return all(r.finished or r.serves for r in state.replicas)


MAX_UNAVAILABLE = 500  # characters of the reason the gateway answers with (the gateway takes up to 1024)


def route(state: ServiceState, say_unavailable: bool = False) -> RouteInput:
    """The gateway route the configuration asks for. The service puts it at start and again whenever an
    apply changes it (rate limits, prefix, Authorization header, cold-start timeout), and, with
    ``say_unavailable``, whenever why the service cannot serve changes (`unavailable`)."""
    cfg = state.config
    limits = [RouteRateLimit(prefix=lim.prefix, key=lim.key.type, header=lim.key.header, rps=lim.rps,
                             burst=lim.burst) for lim in cfg.rate_limits]
    return RouteInput(service=state.name, auth=cfg.auth, cold_start_timeout=cfg.cold_start_timeout,
                      pass_authorization=cfg.pass_authorization, strip_prefix=cfg.strip_prefix, rate_limits=limits,
                      unavailable=unavailable(state) if say_unavailable else "")


def unavailable(state: ServiceState) -> str:
    """Why the service cannot serve, so that the gateway answers 503 with it at once rather than hold requests up
    to the cold-start timeout; '' when it may yet serve. It cannot when it failed, or when each group the gateway
    routes to (the router group; without one, every group) should have replicas, has none serving, and its latest
    replica failed before it served (crash-looping). A group at zero (scale from zero) and a start with no failure
    yet are held."""
    if state.failure:
        return _bounded(f"service failed: {state.failure}")
    reasons = []
    for spec in state.config.replica_groups:
        if not state.config.routed(spec.name):
            continue
        why = _cannot_serve(state, spec.name)
        if not why:
            return ""
        reasons.append(why)
    return _bounded("; ".join(reasons))


def _cannot_serve(state: ServiceState, name: str) -> str:
    group = state.groups.get(name)
    if group is None or group.desired < 1 or not group.failed_start:
        return ""
    if any(r.serves for r in state.replicas if r.group == name):
        return ""
    role = "router group" if state.config.router_group == name else "group"
    then = (f"next attempt at {group.retry_after:%H:%M:%S} UTC" if group.retry_after is not None
            else "a new replica is starting")
    return f"{role} '{name}': {group.failed_start}; {then}"


def _bounded(reason: str) -> str:
    return reason if len(reason) <= MAX_UNAVAILABLE else reason[:MAX_UNAVAILABLE - 1] + "…"


def log(state: ServiceState, event: Event) -> None:
    """Append to the decision log: numbered, the latest kept in state, the unrecorded kept for the store."""
    state.last_seq += 1
    event.seq = state.last_seq
    state.events.append(event)
    del state.events[:-MAX_EVENTS]
    state.unrecorded.append(event)
    del state.unrecorded[:-MAX_UNRECORDED]
