"""The agent simulator's model of a job and its scripted faults (relay.tools.bench.agent_sim)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.launchers.agent_groups import AGGREGATE_SECONDS, decode_node
from relay.tools.bench.agent_sim import SimAgent, SimAggregator, Simulator, shards_for
from relay.tools.bench.sim_cluster import HEARTBEAT_SECONDS, Cluster, SimFault
from relay_train.protocol.heartbeat import Phase
from relay_train.protocol.routes import NODES, SEEN_AGE_SECONDS

T0 = 1_000_000.0


def cluster(*faults: SimFault) -> Cluster:
    return Cluster(nodes=4, per_node=8, started_at=T0, faults=list(faults))


def test_healthy_ranks_step_and_write_fresh_heartbeats() -> None:
    job = cluster()
    now = T0 + 10.0
    beats = {r: job.heartbeat(r, now) for r in range(32)}
    assert all(b is not None for b in beats.values())
    assert all(0 <= now - b.wall_clock < HEARTBEAT_SECONDS for b in beats.values())  # type: ignore[union-attr]
    assert all(b.step > 50 for b in beats.values())  # type: ignore[union-attr]
    assert {b.phase for b in beats.values()} <= {Phase.COMPUTE.value, Phase.COLLECTIVE.value}  # type: ignore[union-attr]
    assert all(job.answers(job.node_name(n), now) for n in range(4))
    assert job.heartbeat(0, T0 - 1.0) is None  # nothing before the job started


def test_stop_rank_silences_one_rank_but_not_its_agent() -> None:
    job = cluster(SimFault("stop_rank", T0 + 5.0, rank=9))
    now = T0 + 9.0
    silent = job.heartbeat(9, now)
    assert silent is not None and now - silent.wall_clock > 3.5
    assert now - job.heartbeat(10, now).wall_clock < HEARTBEAT_SECONDS  # type: ignore[union-attr]
    assert job.answers("node-1", now)
    assert len(job.report("node-1", now)) == 8


def test_stop_node_freezes_its_agent_and_every_rank_of_it() -> None:
    job = cluster(SimFault("stop_node", T0 + 5.0, node="node-2"))
    assert job.answers("node-2", T0 + 4.9)
    assert not job.answers("node-2", T0 + 5.0)
    now = T0 + 8.0
    assert all(now - job.heartbeat(r, now).wall_clock > 2.5 for r in job.ranks_of("node-2"))  # type: ignore[union-attr]
    assert job.answers("node-1", now)
    assert now - job.heartbeat(8, now).wall_clock < HEARTBEAT_SECONDS  # type: ignore[union-attr]


def test_partition_cuts_the_agent_off_until_it_heals_while_its_ranks_go_on() -> None:
    job = cluster(SimFault("partition", T0 + 5.0, node="node-3", until=T0 + 7.0))
    assert not job.answers("node-3", T0 + 6.0)
    assert job.answers("node-3", T0 + 7.0)
    now = T0 + 6.5
    assert now - job.heartbeat(24, now).wall_clock < HEARTBEAT_SECONDS  # type: ignore[union-attr]
    forever = cluster(SimFault("partition", T0 + 5.0, node="node-3"))
    assert not forever.answers("node-3", T0 + 500.0)


def test_hang_stops_every_rank_the_culprit_in_compute_the_rest_waiting() -> None:
    job = cluster(SimFault("hang", T0 + 5.0, rank=3))
    early, late = T0 + 7.0, T0 + 9.0
    assert job.heartbeat(3, late).step == job.heartbeat(3, early).step  # type: ignore[union-attr]
    culprit = job.heartbeat(3, late)
    assert culprit is not None and culprit.phase == Phase.COMPUTE.value
    assert culprit.phase_started_at == T0 + 5.0
    waiting = [job.heartbeat(r, late) for r in range(32) if r != 3]
    assert {b.phase for b in waiting} == {Phase.COLLECTIVE.value}  # type: ignore[union-attr]
    assert late - culprit.wall_clock < HEARTBEAT_SECONDS  # its heartbeat thread lives on


def test_straggler_computes_factor_times_longer_and_slows_the_job() -> None:
    healthy = cluster()
    job = cluster(SimFault("straggler", T0 + 5.0, rank=5, factor=2.0))
    now = T0 + 15.0
    slow, other = job.heartbeat(5, now), job.heartbeat(6, now)
    assert slow is not None and other is not None
    assert slow.compute_seconds / other.compute_seconds == pytest.approx(2.0, rel=0.1)  # type: ignore[operator]
    assert slow.compute_total > other.compute_total  # type: ignore[operator]
    assert other.step < healthy.heartbeat(6, now).step  # type: ignore[union-attr]
    assert job.heartbeat(6, T0 + 4.0).step == healthy.heartbeat(6, T0 + 4.0).step  # type: ignore[union-attr]


@pytest.mark.parametrize("raw", [
    {"kind": "crash", "at": 1.0, "rank": 1},  # not a simulated kind
    {"kind": "stop_node", "at": 1.0, "rank": 1},  # a node fault without a node
    {"kind": "hang", "at": 1.0},  # a rank fault without a rank
    {"kind": "straggler", "at": 1.0, "rank": 1, "factor": 1.0},
])
def test_a_bad_script_line_is_refused(raw: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="agent_sim: expected|needs a"):
        SimFault.from_dict(raw)


def test_a_script_line_round_trips() -> None:
    fault = SimFault.from_dict({"kind": "partition", "at": 3.0, "node": "node-1", "until": 4.0})
    assert fault == SimFault("partition", 3.0, node="node-1", until=4.0)


def test_an_aggregator_reports_its_group_as_of_its_last_round(tmp_path: Path) -> None:
    job = cluster(SimFault("stop_node", T0 + 5.0, node="node-1"))
    agents = [SimAgent(job, job.node_name(n), "a", tmp_path) for n in (0, 1)]
    aggregator = SimAggregator(job, "aggregator-0", agents, "a", offset=T0)
    aggregator.summary_record(T0 + 4.9)  # asked while node-1 still answered (last round 4.8)
    now = T0 + 9.03
    summary = aggregator.summary_record(now)[NODES]
    assert sorted(summary) == ["node-0", "node-1"]
    assert summary["node-0"][SEEN_AGE_SECONDS] == pytest.approx(0.03)  # its last round: 9.0
    assert summary["node-1"][SEEN_AGE_SECONDS] == pytest.approx(now - (T0 + 4.8))
    _, _, beats, _ = decode_node("node-1", summary["node-1"], now)  # frozen: it ages as it would
    assert sorted(beats) == job.ranks_of("node-1")
    assert all(now - b.wall_clock > 3.5 for b in beats.values())
    _, _, fresh, _ = decode_node("node-0", summary["node-0"], now)
    assert all(now - b.wall_clock < HEARTBEAT_SECONDS + AGGREGATE_SECONDS for b in fresh.values())


def test_stop_node_on_an_aggregators_name_freezes_that_aggregator() -> None:
    job = cluster(SimFault("stop_node", T0 + 5.0, node="aggregator-0"))
    assert job.answers("aggregator-0", T0 + 4.0) and not job.answers("aggregator-0", T0 + 6.0)
    assert job.answers("node-0", T0 + 6.0)


@pytest.mark.parametrize("fault", [SimFault("stop_node", T0 + 5.0, node="node-2"),
                                   SimFault("stop_rank", T0 + 5.0, rank=9)])
def test_a_silenced_rank_stops_every_other_rank_at_its_next_collective(fault: SimFault) -> None:
    """Data-parallel ranks step in lockstep: the others wait for the silent one."""
    job = cluster(fault)
    before, after = job.heartbeat(0, T0 + 5.0), job.heartbeat(0, T0 + 9.0)
    assert before is not None and after is not None
    assert after.step == before.step and now_fresh(job, 0, T0 + 9.0)
    assert after.phase == Phase.COLLECTIVE.value


def test_a_frozen_aggregator_does_not_stop_the_ranks() -> None:
    job = cluster(SimFault("stop_node", T0 + 5.0, node="aggregator-0"))
    assert job.heartbeat(0, T0 + 9.0).step > job.heartbeat(0, T0 + 5.0).step  # type: ignore[union-attr]


def now_fresh(job: Cluster, rank: int, now: float) -> bool:
    beat = job.heartbeat(rank, now)
    return beat is not None and now - beat.wall_clock < HEARTBEAT_SECONDS


@pytest.mark.parametrize(("nodes", "group_size"), [(100, 32), (40, 0), (8, 32)])
def test_the_shards_serve_every_node_and_aggregator_once(nodes: int, group_size: int,
                                                         tmp_path: Path) -> None:
    """One simulator process per group: together they serve each node once, and each
    aggregator with every node of its group."""
    job = Cluster(nodes, 2, T0)
    shards = shards_for(nodes, group_size)
    served, groups = [], {}
    for shard in range(shards):
        sim = Simulator(job, "a", tmp_path, "s" * 32, group_size, shard, shards)
        try:
            served += sim.ports()
            groups.update(sim.groups)
            assert all(set(g) <= set(sim.ports()) for g in sim.groups.values())
        finally:
            sim.close()
    assert sorted(served) == sorted(job.node_name(n) for n in range(nodes))
    assert shards == (len(groups) or -(-nodes // 32))
    assert sorted(n for g in groups.values() for n in g) == (sorted(served) if groups else [])
