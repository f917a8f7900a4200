"""The channel secret in a launch record: sealed, opened only with the deployment's key ring.

A launch record rides in Airflow's metadata database (trigger arguments, the task state
store, readable through its REST API); on another machine (no launch file there) the
record is all Relay has to talk to the attempt's agents. Real LocalLauncher, real key ring
files, real Fernet; "another machine" is the launch file deleted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import pytest

from relay.launchers import launch_record
from relay.launchers.local.launcher import HANDLE_FILE, LocalLauncher, channel_secret
from relay_train.protocol.channel_auth import new_secret
from relay_train.protocol.env import ENV_CHECKPOINT_KEYS_FILE
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig
from relay_train.protocol.signing import KeyRing


def write_ring(path: Path, ring: KeyRing) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(ring.to_dict()))
    return path


@pytest.fixture
def launched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[LaunchConfig, KeyRing]:
    """An attempt launched on "this machine": its 0600 launch file and its handle."""
    ring = KeyRing.generate("k1")
    monkeypatch.setenv(ENV_CHECKPOINT_KEYS_FILE, str(write_ring(tmp_path / "ring.json", ring)))
    monkeypatch.setattr(launch_record, "_restored", {})
    root = tmp_path / "runs" / "relay_demo" / "manual__1" / "segment-000" / "try-1"
    root.mkdir(parents=True)
    cfg = LaunchConfig(job="demo", seed=1, model={}, data={}, optimizer={}, start_step=0,
                       end_step=10, checkpoint_every=5, nodes=["node-a"], ranks_per_node=1,
                       master_addr="127.0.0.1", master_port=1, tracking_uri="sqlite:///x",
                       run_id="r", attempt_dir=str(root), attempt=1, segment=0,
                       channel_secret=new_secret(), checkpoint_keys=ring.to_dict())
    cfg.write(root / LAUNCH_FILE)
    (root / HANDLE_FILE).write_text(json.dumps({"nodes": {}, "started_at": 0.0}))
    return cfg, ring


def test_the_record_carries_neither_the_secret_nor_the_ring_in_clear(
    launched: tuple[LaunchConfig, KeyRing]
) -> None:
    cfg, ring = launched
    text = json.dumps(launch_record.build(cfg, LocalLauncher()))
    assert cfg.channel_secret not in text
    assert all(key not in text for key in ring.keys.values())
    assert launch_record.SEALED_SECRET in text


def test_another_machine_with_the_ring_opens_it(
    launched: tuple[LaunchConfig, KeyRing]
) -> None:
    cfg, _ring = launched
    record = json.loads(json.dumps(launch_record.build(cfg, LocalLauncher())))
    (cfg.root / LAUNCH_FILE).unlink()  # another machine: only the record came along
    (cfg.root / HANDLE_FILE).unlink()

    restored = launch_record.restore(record, LocalLauncher(), "sqlite:///y")

    assert restored.channel_secret == cfg.channel_secret
    assert channel_secret(cfg.root) == cfg.channel_secret  # what the launcher signs with


def test_after_a_key_rotation_the_old_key_still_opens_it(
    launched: tuple[LaunchConfig, KeyRing], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, ring = launched
    record = launch_record.build(cfg, LocalLauncher())
    (cfg.root / LAUNCH_FILE).unlink()
    rotated = KeyRing(write="k2", keys={"k2": new_secret(), **ring.keys})
    monkeypatch.setenv(ENV_CHECKPOINT_KEYS_FILE, str(write_ring(tmp_path / "r2.json", rotated)))

    assert launch_record.restore(record, LocalLauncher(), "").channel_secret == (
        cfg.channel_secret)


@pytest.mark.parametrize("how", ["another ring", "altered seal"])
def test_a_ring_that_cannot_open_it_gives_no_secret_and_says_what_to_do(
    launched: tuple[LaunchConfig, KeyRing], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, how: str
) -> None:
    cfg, _ring = launched
    record = launch_record.build(cfg, LocalLauncher())
    (cfg.root / LAUNCH_FILE).unlink()
    if how == "another ring":
        stranger = KeyRing.generate("k1")  # same id, another key
        monkeypatch.setenv(ENV_CHECKPOINT_KEYS_FILE,
                           str(write_ring(tmp_path / "other.json", stranger)))
    else:
        token = record[launch_record.SEALED_SECRET]["token"]
        record[launch_record.SEALED_SECRET]["token"] = token[:-6] + (
            "AAAAAA" if not token.endswith("AAAAAA") else "BBBBBB")

    with caplog.at_level(logging.WARNING, logger="relay.launchers.launch_record"):
        restored = launch_record.restore(record, LocalLauncher(), "")

    assert restored.channel_secret == ""
    assert "Give this machine the deployment's key ring" in caplog.text
    assert cfg.channel_secret not in caplog.text


def test_the_secret_the_launcher_made_is_sealed_from_its_launch_file(
    launched: tuple[LaunchConfig, KeyRing]
) -> None:
    cfg, _ring = launched  # the task's config has no secret: the launcher made one as it launched
    record = launch_record.build(dataclasses.replace(cfg, channel_secret=""), LocalLauncher())
    (cfg.root / LAUNCH_FILE).unlink()

    assert launch_record.restore(record, LocalLauncher(), "").channel_secret == (
        cfg.channel_secret)
