"""Unit tests for the heartbeat record, its writer thread and its reader."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from relay_train.protocol.heartbeat import (
    Heartbeat,
    HeartbeatWriter,
    Phase,
    heartbeat_path,
    read_heartbeats,
    write_atomically,
)


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes; return whether it held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def read_one(directory: Path, rank: int) -> Heartbeat:
    beats = read_heartbeats(directory)
    assert rank in beats, f"no heartbeat for rank {rank} in {directory}"
    return beats[rank]


@pytest.fixture
def writers() -> Iterator[list[HeartbeatWriter]]:
    """Writers created by a test; closed afterwards so no thread outlives it."""
    made: list[HeartbeatWriter] = []
    yield made
    for writer in made:
        writer.close()


def test_start_writes_first_record_immediately(tmp_path: Path, writers: list) -> None:
    directory = tmp_path / "hb"  # does not exist yet: the writer creates it
    writer = HeartbeatWriter(directory, rank=3, node="node-a", interval_seconds=60, step=17)
    writers.append(writer)
    writer.start()

    beat = read_one(directory, 3)
    assert beat.rank == 3
    assert beat.node == "node-a"
    assert beat.pid == os.getpid()
    assert beat.step == 17
    assert beat.phase == Phase.STARTING.value
    assert beat.seq == 1
    assert heartbeat_path(directory, 3).is_file()


def test_beat_and_enter_are_memory_only_until_flushed(tmp_path: Path) -> None:
    # With a long interval the thread never writes on its own: beat()/enter()
    # must not touch the file, and close() must write the last state.
    writer = HeartbeatWriter(tmp_path, rank=0, node="n0", interval_seconds=60).start()
    writer.enter(Phase.COMPUTE)
    writer.beat(step=7, compute_seconds=0.25, samples_per_second=123.5, loss=2.5)

    assert read_one(tmp_path, 0).step == 0
    writer.close()

    beat = read_one(tmp_path, 0)
    assert beat.step == 7
    assert beat.compute_seconds == 0.25
    assert beat.samples_per_second == 123.5
    assert beat.loss == 2.5
    assert beat.phase == Phase.DONE.value
    assert beat.seq == 2


def test_background_thread_writes_fields_set_by_beat_and_enter(
    tmp_path: Path, writers: list
) -> None:
    writer = HeartbeatWriter(tmp_path, rank=1, node="n1", interval_seconds=0.02)
    writers.append(writer)
    writer.start()
    before = time.time()
    writer.enter(Phase.COLLECTIVE)
    writer.beat(step=42, compute_seconds=0.5, samples_per_second=10.0, loss=1.25)

    assert wait_for(lambda: read_one(tmp_path, 1).step == 42)
    beat = read_one(tmp_path, 1)
    assert beat.phase == Phase.COLLECTIVE.value
    assert beat.phase_started_at >= before
    assert beat.compute_seconds == 0.5
    assert beat.samples_per_second == 10.0
    assert beat.loss == 1.25


def test_beat_keeps_optional_fields_that_are_not_given(tmp_path: Path, writers: list) -> None:
    writer = HeartbeatWriter(tmp_path, rank=0, node="n0", interval_seconds=0.02)
    writers.append(writer)
    writer.start()
    writer.beat(step=1, compute_seconds=0.5, samples_per_second=10.0, loss=3.0)
    writer.beat(step=2)

    assert wait_for(lambda: read_one(tmp_path, 0).step == 2)
    beat = read_one(tmp_path, 0)
    assert (beat.compute_seconds, beat.samples_per_second, beat.loss) == (0.5, 10.0, 3.0)


def test_background_thread_rewrites_record_with_increasing_seq(
    tmp_path: Path, writers: list
) -> None:
    writer = HeartbeatWriter(tmp_path, rank=0, node="n0", interval_seconds=0.02)
    writers.append(writer)
    writer.start()
    first = read_one(tmp_path, 0)

    assert wait_for(lambda: read_one(tmp_path, 0).seq >= first.seq + 3)
    later = read_one(tmp_path, 0)
    assert later.wall_clock >= first.wall_clock
    # Nothing changed in memory, yet the record is fresh: that is liveness.
    assert later.step == first.step


def test_close_marks_done_and_stops_writing(tmp_path: Path) -> None:
    writer = HeartbeatWriter(tmp_path, rank=2, node="n0", interval_seconds=0.02).start()
    writer.enter(Phase.COMPUTE)
    writer.beat(step=5)
    assert wait_for(lambda: read_one(tmp_path, 2).step == 5)

    writer.close()
    closed = read_one(tmp_path, 2)
    assert closed.phase == Phase.DONE.value
    assert closed.step == 5

    time.sleep(0.1)  # five intervals: a thread still running would have rewritten it
    assert read_one(tmp_path, 2).seq == closed.seq


def test_read_heartbeats_of_missing_directory_is_empty(tmp_path: Path) -> None:
    assert read_heartbeats(tmp_path / "nope") == {}


def test_read_heartbeats_skips_unreadable_files(tmp_path: Path) -> None:
    good = Heartbeat(rank=0, node="n0", pid=1234, step=9, phase=Phase.COMPUTE.value)
    write_atomically(heartbeat_path(tmp_path, 0), good.to_json())
    other = Heartbeat(rank=1, node="n0", pid=1235, step=9).to_json()
    heartbeat_path(tmp_path, 1).write_text(other[: len(other) // 2])  # truncated
    heartbeat_path(tmp_path, 2).write_bytes(b"\xff\xfe\x00garbage\x80")  # not even UTF-8
    heartbeat_path(tmp_path, 3).write_text("")  # empty
    heartbeat_path(tmp_path, 4).write_text("[1, 2, 3]")  # JSON, but not a record
    heartbeat_path(tmp_path, 5).write_text('{"rank": 5}')  # a record missing fields
    heartbeat_path(tmp_path, 6).write_text("null")
    # Not matching rank-*.json: never read even though it is a valid record.
    (tmp_path / "notes.json").write_text(Heartbeat(rank=9, node="n9", pid=1).to_json())

    beats = read_heartbeats(tmp_path)

    assert list(beats) == [0]
    assert beats[0] == good


def test_read_heartbeats_skips_record_with_wrong_field_types(tmp_path: Path) -> None:
    good = Heartbeat(rank=0, node="n0", pid=1234)
    write_atomically(heartbeat_path(tmp_path, 0), good.to_json())
    heartbeat_path(tmp_path, 1).write_text('{"rank": [1], "node": "n0", "pid": 1}')

    assert read_heartbeats(tmp_path) == {0: good}


def test_from_json_ignores_unknown_keys() -> None:
    beat = Heartbeat(rank=4, node="n1", pid=99, step=3, loss=0.5, seq=8)
    raw = json.loads(beat.to_json())
    raw["written_by_a_newer_version"] = {"anything": [1, 2]}

    assert Heartbeat.from_json(json.dumps(raw)) == beat


def test_to_json_from_json_round_trip() -> None:
    beat = Heartbeat(
        rank=1,
        node="node-7",
        pid=4321,
        step=100,
        phase=Phase.CHECKPOINT.value,
        phase_started_at=1.5,
        compute_seconds=0.125,
        samples_per_second=512.0,
        loss=float("inf"),
        wall_clock=2.5,
        seq=11,
    )
    assert Heartbeat.from_json(beat.to_json()) == beat


def test_from_json_rejects_record_missing_required_fields() -> None:
    with pytest.raises(TypeError):
        Heartbeat.from_json('{"rank": 0, "node": "n0"}')


def test_write_atomically_replaces_content_and_leaves_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "rank-0.json"
    write_atomically(target, "first")
    write_atomically(target, "second")

    assert target.read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json"]


def test_writer_leaves_no_temp_files(tmp_path: Path) -> None:
    writer = HeartbeatWriter(tmp_path, rank=0, node="n0", interval_seconds=0.01).start()
    writer.beat(step=1)
    assert wait_for(lambda: read_one(tmp_path, 0).seq >= 5)
    writer.close()

    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json"]
