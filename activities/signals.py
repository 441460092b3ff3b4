"""The judge of `scale` and `apply` signals: the same rules as the updates' validators, on a raw payload.

Run as a local activity from the service's loop, so its verdict is written to history: a rule tightened
later never changes how an old history replays.
"""

from __future__ import annotations

from pydantic import ValidationError

from activities.interface import implements, judge_signal as judge_stub
from models.loader import load_config_data, render_path
from models.validation import broken_rules, validate_service
from models.messages import ApplyRequest, ScaleRequest, SignalInput, Verdict
from rules.admission import Refused, check_apply, check_scale
from rules.changes import classify


@implements(judge_stub)
async def judge_signal(inp: SignalInput) -> Verdict:
    return judge(inp)


def judge(inp: SignalInput) -> Verdict:
    try:
        if inp.kind == "start":
            return _judge_start(inp)
        if inp.kind == "scale":
            request = ScaleRequest.model_validate(inp.payload)
            check_scale(inp.config, inp.stopping, request)
            return Verdict(scale=request)
        return _judge_apply(inp)
    except ValidationError as e:
        return Verdict(reason=broken_rules(e))
    except Refused as e:
        return Verdict(reason=str(e))


def _judge_apply(inp: SignalInput) -> Verdict:
    if not isinstance(inp.payload, dict) or "config" not in inp.payload:
        return Verdict(reason='payload: expected {"config": {…}}')
    result = load_config_data(inp.payload["config"])
    if result.errors or result.config is None:
        return Verdict(reason="invalid configuration: " + "; ".join(str(e) for e in result.errors))
    check_apply(inp.service, inp.config, inp.stopping, result.config)
    if not classify(inp.config, result.config).any:
        return Verdict(reason="no changes")  # a signal cannot be told it was a no-op: the log says so
    return Verdict(apply=ApplyRequest(config=result.config))


def _judge_start(inp: SignalInput) -> Verdict:
    """A run's configuration, checked as `apply` checks a file: a run started some other way (`temporal workflow
    start`, a client of its own) gets no bound skipped."""
    issues = [f"{render_path(i.path) or 'configuration'}: {i.message}" for i in validate_service(inp.config)]
    return Verdict(reason="invalid configuration: " + "; ".join(issues)) if issues else Verdict()
