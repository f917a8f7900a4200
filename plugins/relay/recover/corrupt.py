"""Corrupt checkpoints met on the way to a resume point: recorded, skipped, decided on.

The segment task looks for the latest valid checkpoint before it launches; every
newer one whose manifest is unsigned or badly signed, or whose files do not match
its manifest, is a ``corrupt_checkpoint`` fault. There is no workload to stop: each
is rejected in MLflow (the chooser skips it from then on) and put to the policy,
whose rule may give up on the segment.
"""

from __future__ import annotations

import logging
from typing import Any

from relay.core.attempt import AttemptState
from relay.core.faults import Fault, FaultKind
from relay.lineage.tags import TAG_FAULT
from relay.policy.decide import decide
from relay.policy.model import LoadedPolicy
from relay.policy.notify import escalate

log = logging.getLogger(__name__)


def record_corrupt(lineage: Any, run_id: str, corrupt: list[Any],  # noqa: ANN401
                   policy: LoadedPolicy, history: list[FaultKind], segment: int) -> str | None:
    """Record each corrupt checkpoint in the attempt's run ``run_id`` and decide on it;
    return why the segment fails for good, if a decision says so (None: go on)."""
    for bad in corrupt:
        fault = Fault(FaultKind.CORRUPT_CHECKPOINT, None, None, {
            "summary": bad.describe(), "checkpoint": str(bad.manifest.ref)})
        decision = decide(fault, history, policy.policy, policy.sha256)
        lineage.reject_checkpoint(bad.manifest, f"corrupt: {fault.evidence['summary']}")
        lineage.log_json(run_id, f"corrupt-step-{bad.manifest.step:08d}.json",
                         {"fault": fault.to_event()["fault"], "decision": decision.to_dict()})
        log.error("%s; decision %s: %s", fault.describe(), decision.action, decision.reason)
        if not decision.retry:
            message = f"Segment {segment}: {fault.describe()}; {decision.reason}"
            if decision.notify:
                escalate(decision.notify, message, policy.policy.escalation,
                         {"decision": decision.to_dict()})
            lineage.finish_run(run_id, AttemptState.RECORDED,
                               {TAG_FAULT: fault.kind.value})
            return message
    return None
