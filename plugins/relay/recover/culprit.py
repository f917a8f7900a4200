"""Confirm a hang's culprit against where the ranks really are, before the decision acts.

The watcher names a hang's culprit from the heartbeat phases: the rank still in
"compute" while others wait in "collective". A collective the phases do not mark
(DDP's buffer broadcast, FSDP's all-gathers, a user's ``all_reduce`` of a metric)
leaves healthy ranks waiting there marked "compute": the phases then blame a
bystander, or nobody. Before the decision acts, the evidence gathered from every
rank (:mod:`relay.recover.evidence`) settles it: a rank is *in a collective* if its
Flight Recorder trace holds an unfinished collective, or its main thread's stack
ends in ``torch.distributed`` (or DDP's buffer broadcast); otherwise it is
*elsewhere*, and only a rank elsewhere can be what the others wait for.

The rule, for a hang (:func:`confirm_culprit`):

- the named rank is elsewhere: confirmed;
- it waits in a collective, or nobody was named: the one rank elsewhere (every
  other rank answered and waits in a collective) is the culprit; otherwise
  there is none, and nobody is quarantined;
- the named rank sent no evidence: kept, marked unconfirmed (nothing contradicts it);
- a rank stuck saving a checkpoint (its own ``checkpoint_timeout``) is left as named.

What was checked goes into the fault's evidence as ``culprit_check``; the decision's
reason quotes its note (:mod:`relay.policy.decide`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from relay.core.faults import CULPRIT_CHECK, Fault, FaultKind
from relay.recover.evidence import Evidence
from relay_train.protocol.heartbeat import Phase

COLLECTIVE, ELSEWHERE = "collective", "elsewhere"
# Frames of a Python stack that are a wait in a collective: torch.distributed itself, and
# DDP's buffer broadcast (a C call from torch/nn/parallel/distributed.py).
_DDP_FILE = "torch/nn/parallel/distributed.py"
_DDP_BROADCAST = frozenset({"_sync_buffers", "_sync_module_buffers",
                            "_default_broadcast_coalesced", "_distributed_broadcast_coalesced"})
_INNERMOST = 3  # frames looked at, from the innermost
_FAULTHANDLER_FRAME = re.compile(r'File "(?P<file>[^"]+)", line \d+ in (?P<function>\S+)')


def _is_collective_frame(file: str, function: str) -> bool:
    file = file.replace("\\", "/")
    return "/torch/distributed/" in file or (file.endswith(_DDP_FILE)
                                             and function in _DDP_BROADCAST)


def _frames_say_collective(frames: list[tuple[str, str]]) -> bool:
    """Return whether the innermost frames (file, function) are a collective's wait."""
    return any(_is_collective_frame(f, fn) for f, fn in frames[-_INNERMOST:])


def _unfinished(trace: dict[str, Any] | None) -> str | None:
    """Return the first collective the Flight Recorder has not seen finish (None: all did)."""
    for entry in (trace or {}).get("entries", []):
        if not entry.get("retired"):
            return f"{entry.get('profiling_name')} #{entry.get('collective_seq_id')}"
    return None


def _faulthandler_main(text: str) -> list[tuple[str, str]]:
    """Return the signalled thread's frames (file, function), innermost last, from a
    faulthandler dump: the block headed "Current thread", else the last (the oldest)."""
    blocks = re.split(r"^(?=(?:Current thread|Thread) 0x)", text, flags=re.MULTILINE)
    blocks = [b for b in blocks if b.strip()]
    if not blocks:
        return []
    block = next((b for b in blocks if b.startswith("Current thread")), blocks[-1])
    frames = [(m["file"], m["function"]) for m in _FAULTHANDLER_FRAME.finditer(block)]
    return frames[::-1]  # faulthandler writes the innermost frame first


def rank_places(evidence: Evidence) -> dict[int, tuple[str, str]]:
    """Return, per rank that answered, (COLLECTIVE or ELSEWHERE, what shows it)."""
    places: dict[int, tuple[str, str]] = {}
    for rank, record in evidence.answers.items():
        waiting = _unfinished(evidence.traces.get(rank))
        main = next((t for t in record.get("threads", []) if t.get("main")), None)
        frames = [(f["file"], f["function"]) for f in (main or {}).get("frames", [])]
        inner = frames[-1][1] if frames else "an unknown place"
        if waiting:
            places[rank] = (COLLECTIVE, f"waits in {waiting}")
        elif _frames_say_collective(frames):
            places[rank] = (COLLECTIVE, f"waits in {inner}")
        else:
            places[rank] = (ELSEWHERE, f"in {inner}")
    for rank, text in evidence.fallback_stacks.items():
        waits = (_frames_say_collective(_faulthandler_main(text))
                 or _unfinished(evidence.traces.get(rank)))
        places[rank] = ((COLLECTIVE, "waits in a collective (C-level stack)") if waits
                        else (ELSEWHERE, "outside any collective (C-level stack)"))
    return places


def _saving(fault: Fault) -> bool:
    """Return whether the hang is a rank stuck saving a checkpoint (its own timeout, and
    a sharded save's wait in torch.distributed.checkpoint is no bystander's)."""
    phases = fault.evidence.get("phases") or {}
    rank = fault.culprit_rank
    return rank is not None and Phase.CHECKPOINT.value in (phases.get(rank),
                                                           phases.get(str(rank)))


def confirm_culprit(fault: Fault, evidence: Evidence | None, ranks: list[int],
                    node_of: Callable[[int], str | None]) -> Fault:
    """Return ``fault`` with its culprit confirmed, replaced or withdrawn by ``evidence``.

    ``ranks``: every rank of the attempt. Only a hang is checked; another fault, or no
    evidence at all, comes back unchanged.
    """
    if fault.kind is not FaultKind.HANG or evidence is None or not (
            evidence.answers or evidence.fallback_stacks) or _saving(fault):
        return fault
    places = rank_places(evidence)
    named = fault.culprit_rank
    elsewhere = sorted(r for r, (where, _) in places.items() if where == ELSEWHERE)
    unheard = [r for r in ranks if r not in places]
    found = elsewhere[0] if len(elsewhere) == 1 and not unheard else None
    seen = {str(r): f"{where} ({how})" for r, (where, how) in sorted(places.items())}
    if named is not None and named not in places:
        return _checked(fault, named, seen, f"rank {named} unconfirmed: it sent no stacks")
    if named is not None and places[named][0] == ELSEWHERE:
        return _checked(fault, named, seen,
                        f"rank {named} confirmed by its stack: {places[named][1]}")
    said = ("the heartbeats named no rank" if named is None
            else f"rank {named} {places[named][1]}, not in compute")
    if found is not None:
        return _checked(dataclasses.replace(fault, culprit_rank=found, culprit_node=node_of(found)),
                        named, seen, f"{said}; the evidence names rank {found} "
                        f"({places[found][1]}), the only rank outside a collective")
    why = (f"rank(s) {elsewhere} outside a collective" if elsewhere
           else "every rank that answered waits in a collective")
    if unheard:
        why += f"; rank(s) {unheard} sent no stacks"
    return _checked(dataclasses.replace(fault, culprit_rank=None, culprit_node=None), named,
                    seen, f"{said}; no culprit confirmed ({why}): nobody quarantined")


def _checked(fault: Fault, named: int | None, seen: dict[str, str], note: str) -> Fault:
    check = {"heartbeat_culprit": named, "culprit": fault.culprit_rank, "note": note,
             "ranks": seen}
    return dataclasses.replace(fault, evidence={**fault.evidence, CULPRIT_CHECK: check})
