"""Ask a healthy rank for its in-memory state before stopping a faulty attempt.

After a hang or an unresponsive rank or node, the healthy ranks wait in the
step's collective with weights complete up to the last finished step. One of
them writes that state on its node (see :mod:`relay_train.protocol.rescue_files`); Relay asks
for it and fetches it through the node's agent, over the channel, before the
workload is stopped, verifies its sha256, and after the stop publishes it to the
attempt's MLflow run as a checkpoint like any other, whose manifest says where
it came from. The retry then resumes from it, and the steps since the last
periodic checkpoint are not lost. If no rank answers in time, nothing changes:
the retry resumes from the last periodic checkpoint, as it would have anyway.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from relay.core.attempt import Attempt
from relay.core.checkpoint_keys import ring_for
from relay.core.exceptions import StaleAgentError
from relay.core.faults import RESCUABLE, Fault, FaultKind
from relay.launchers import Launcher, launcher_from
from relay_train.protocol.heartbeat import Heartbeat, write_atomically
from relay_train.protocol.launch import LaunchConfig
from relay_train.protocol.manifest import (
    CHECKPOINT_FILE,
    CheckpointManifest,
    CheckpointRef,
    file_sha256,
)
from relay_train.protocol.rescue_files import RescueResult
from relay_train.protocol.routes import ACK, DONE, FAULT, RANK, STEP, Route
from relay_train.protocol.signing import sign

if TYPE_CHECKING:
    from relay.launchers.agent_client import AgentChannel

log = logging.getLogger(__name__)

ACK_TIMEOUT_SECONDS = 2.0  # a healthy rank's thread answers within a poll (0.1s)
RECEIVED_DIR = "rescued"  # Relay's side: the states fetched from the nodes
KEPT_FILE = "result.json"  # in RECEIVED_DIR: the verified state, for a retry that finishes a record
REJECTED_FILE = "rejected.json"  # in RECEIVED_DIR: a state refused on arrival (its sha256)


def silent(fault: Fault, cfg: LaunchConfig) -> tuple[set[str], set[int]]:
    """Return the nodes and ranks this fault says cannot answer: a frozen node's agent and
    every rank of it. Nobody waits on them: each would cost a request timeout before the
    stop. (An unresponsive rank's agent still answers, and may still get its C-level stack.)"""
    if fault.kind is FaultKind.NODE_UNRESPONSIVE and fault.culprit_node in cfg.nodes:
        node = fault.culprit_node
        return {node}, {cfg.global_rank(node, r) for r in range(cfg.ranks_per_node)}
    return set(), set()


def donor(fault: Fault, cfg: LaunchConfig, beats: dict[int, Heartbeat]) -> int | None:
    """Return the healthy rank to ask: not the culprit, not on a silent node, furthest along."""
    if fault.kind not in RESCUABLE:
        return None
    excluded = {fault.culprit_rank} if fault.culprit_rank is not None else set()
    excluded |= silent(fault, cfg)[1]
    candidates = [b for r, b in beats.items() if r not in excluded and b.nonfinite_step is None]
    if not candidates:
        return None
    return min(candidates, key=lambda b: (-b.step, b.rank)).rank


def _wait_for(channel: AgentChannel, node: str, key: str, timeout: float) -> dict | None:
    """Ask the node's agent how the rescue goes until ``key`` is set; return its answer."""
    deadline = time.monotonic() + timeout
    while True:
        answer = channel.fetch(node, Route.RESCUE)
        if isinstance(answer, dict) and answer.get(key):
            return answer
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def request_rescue(
    attempt: Attempt, cfg: LaunchConfig, fault: Fault, timeout_seconds: float,
    launcher: Launcher | None = None,
) -> RescueResult | None:
    """Ask one healthy rank for its state over the channel; return the verified result, or None.

    The state is fetched from the rank's node into ``<attempt>/rescued/`` on Relay's side.
    """
    attempt_dir = attempt.runs_in
    kept = kept_rescue(attempt_dir)
    if kept is not None:  # a retry finishing a record its killed task began: no one to ask now
        log.info("Using the state rank %d handed over before (step %d)", kept.rank, kept.step)
        return kept
    launcher = launcher or launcher_from(None)
    channel = launcher.channel(attempt)
    frozen = silent(fault, cfg)[0]
    channel.poll([n for n in cfg.nodes if n not in frozen])  # a frozen agent: no wait on it
    rank = donor(fault, cfg, dict(channel.beats))
    if rank is None:
        return None
    node = cfg.nodes[rank // cfg.ranks_per_node]
    asked = time.monotonic()
    if channel.ask(node, Route.RESCUE, **{RANK: rank, FAULT: fault.kind.value}) is None:
        log.warning("The agent of %s did not take the rescue request; resuming from the last "
                    "checkpoint instead", node)
        return None
    if _wait_for(channel, node, ACK, ACK_TIMEOUT_SECONDS) is None:
        log.warning("Rank %d did not answer the rescue request in %.0fs; resuming from the last "
                    "checkpoint instead", rank, ACK_TIMEOUT_SECONDS)
        return None
    answer = _wait_for(channel, node, DONE, timeout_seconds)
    if answer is None:
        log.warning("Rank %d did not finish handing over its state in %.0fs; resuming from the "
                    "last checkpoint instead", rank, timeout_seconds)
        return None
    try:
        result = RescueResult(**answer[DONE])
    except (TypeError, ValueError) as exc:
        log.warning("Unreadable rescue answer from %s (%s); resuming from the last checkpoint",
                    node, exc)
        return None
    if result.refused or result.path is None or result.step is None:
        log.warning("Rank %d refused to hand over its state: %s", rank, result.refused)
        return None
    local = _fetch_state(channel, node, result, attempt_dir, timeout_seconds)
    if local is None:
        return None
    log.info("Rank %d handed over its state at step %d in %.2fs", rank, result.step,
             time.monotonic() - asked)
    result = dataclasses.replace(result, path=str(local))
    write_atomically(attempt_dir / RECEIVED_DIR / KEPT_FILE, json.dumps(dataclasses.asdict(result)),
                     durable=True)
    return result


def kept_rescue(attempt_dir: Path) -> RescueResult | None:
    """Return the state already fetched for this attempt, if its file is still intact."""
    try:
        result = RescueResult.read(attempt_dir / RECEIVED_DIR / KEPT_FILE)
    except (OSError, ValueError, TypeError):
        return None
    if result.path is None or result.step is None or not Path(result.path).is_file():
        return None
    return result if file_sha256(Path(result.path)) == result.sha256 else None


def _fetch_state(channel: AgentChannel, node: str, result: RescueResult, attempt_dir: Path,
                 timeout_seconds: float) -> Path | None:
    """Download the rescued file from the node's agent to Relay's side; return its path.

    The download is authenticated like every channel request (signed both ways), and the
    file is verified on arrival: its sha256 must be the one the rank declared (in its
    signed ``GET rescue`` answer), else it is deleted, refused and reported (a warning
    and ``rescued/rejected.json``), and None is returned.
    """
    assert result.step is not None
    try:
        data = channel.call(node, Route.RESCUE_FILE, query={STEP: result.step},
                            timeout=timeout_seconds)
    except StaleAgentError:
        data = None
    if not isinstance(data, bytes):
        log.warning("Rescued state of rank %d at step %d: no file came from the agent of %s; "
                    "not used", result.rank, result.step, node)
        return None
    local = attempt_dir / RECEIVED_DIR / f"step-{result.step:08d}" / CHECKPOINT_FILE
    local.parent.mkdir(parents=True, exist_ok=True)
    partial = local.with_suffix(".partial")
    partial.write_bytes(data)
    found = file_sha256(partial)
    if found != result.sha256:
        partial.unlink(missing_ok=True)
        log.warning("Rescued state of rank %d at step %d from %s: expected sha256 %s (as the "
                    "rank declared), found %s over %d bytes; refused, not used", result.rank,
                    result.step, node, result.sha256, found, len(data))
        write_atomically(attempt_dir / RECEIVED_DIR / REJECTED_FILE, json.dumps({
            "node": node, "rank": result.rank, "step": result.step, "expected_sha256":
            result.sha256, "found_sha256": found, "size_bytes": len(data), "at": time.time()}))
        return None
    partial.replace(local)
    return local


def publish_rescue(
    result: RescueResult, cfg: LaunchConfig, fault: Fault, parent: CheckpointRef | None
) -> CheckpointManifest:
    """Log the rescued checkpoint to the attempt's MLflow run, its manifest signed with the
    attempt's key ring like the ranks' own; return the manifest."""
    from relay_train.checkpoints.publish import (
        MlflowCheckpointSink,  # MLflow: only once there is one
    )

    assert result.path is not None and result.step is not None and result.sha256 is not None
    manifest = CheckpointManifest(
        step=result.step, sha256=result.sha256, size_bytes=int(result.size_bytes or 0),
        world_size=cfg.world_size, job=cfg.job, run_id=cfg.run_id, parent=parent,
        created_at=time.time(), origin=f"rescued from rank {result.rank} after {fault.kind.value}",
    )
    manifest = sign(manifest, ring_for(cfg))
    MlflowCheckpointSink(cfg.tracking_uri, cfg.run_id).publish(Path(result.path), manifest)
    return manifest
