"""When a drain may end: every rank that was running says it is done."""

from __future__ import annotations

from relay.recover.drain import done
from relay_train.protocol.heartbeat import Heartbeat, Phase


def _beats(**phases: Phase) -> dict[int, Heartbeat]:
    return {int(r[1:]): Heartbeat(rank=int(r[1:]), node="n", pid=1, step=12, phase=p.value)
            for r, p in phases.items()}


def test_a_drain_ends_once_every_rank_is_done() -> None:
    before = _beats(r0=Phase.COMPUTE, r1=Phase.COMPUTE)
    assert not done(before, _beats(r0=Phase.DONE, r1=Phase.CHECKPOINT))  # rank 1 still saving
    assert not done(before, _beats(r0=Phase.DONE))  # rank 1 not heard
    assert done(before, _beats(r0=Phase.DONE, r1=Phase.DONE))
