"""State files: atomic writes with unique temporary names, fsynced when durable."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from relay.nodes.pool import NodePool
from relay_train.protocol.heartbeat import write_atomically


def test_two_writers_in_one_process_never_collide(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    errors: list[BaseException] = []

    def write(tag: str) -> None:
        try:
            for i in range(300):
                write_atomically(target, f"{tag}{i}")
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(t,)) for t in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert target.read_text() in ("a299", "b299")
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_durable_writes_fsync_the_file_and_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    write_atomically(tmp_path / "quick.json", "x")
    assert synced == []
    write_atomically(tmp_path / "durable.json", "x", durable=True)
    assert len(synced) == 2
    synced.clear()
    NodePool(tmp_path / "nodes.json", ["n1"]).quarantine("n1", 60, "test", by="test")
    assert len(synced) == 2  # the node pool's state is durable


def test_a_failed_write_leaves_the_old_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "state.json"
    write_atomically(target, "old")

    def broken(*_args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        write_atomically(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_fault_history_comes_from_attempt_folders_and_skips_stale_ones(tmp_path: Path) -> None:
    import json

    from relay.recover.journal import fault_history

    def decided(folder: str, kind: str) -> Path:
        path = tmp_path / folder
        path.mkdir()
        (path / "decision.json").write_text(json.dumps({"fault": {"kind": kind}}))
        return path

    decided("try-1", "crash")
    decided("try-1.stale-1764700000", "crash")  # the same try launched again: not an attempt
    decided("try-2", "hang")
    decided("try-10", "straggler")
    current = decided("try-11", "nan_loss")
    (tmp_path / "try-3").mkdir()  # an attempt that has not decided anything
    assert [k.value for k in fault_history({}, tmp_path, exclude=current)] == [
        "crash", "hang", "straggler"]
