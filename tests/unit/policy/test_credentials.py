"""The tracking URI's credentials are not left in world-readable files or printed."""

from __future__ import annotations

import stat
from pathlib import Path

from relay.core.urls import redact
from relay_train.protocol.launch import LaunchConfig

URI = "postgresql://relay:s3cret@db.internal:5432/mlflow"


def config(tmp_path: Path) -> LaunchConfig:
    return LaunchConfig(
        job="j", seed=0, model={}, data={}, optimizer={}, start_step=0, end_step=1,
        checkpoint_every=1, nodes=["n"], ranks_per_node=1, master_addr="127.0.0.1",
        master_port=1, tracking_uri=URI, run_id="r", attempt_dir=str(tmp_path), attempt=1,
        segment=0)


def test_the_launch_file_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "launch.json"
    path.write_text("{}")
    path.chmod(0o644)  # an older, world-readable file is tightened when rewritten
    config(tmp_path).write(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert LaunchConfig.read(path).tracking_uri == URI  # the workers still get it


def test_printed_tracking_uris_lose_their_password_only() -> None:
    assert redact(URI, keep_query=True) == "postgresql://db.internal:5432/mlflow"
    assert redact("https://u:p@mlflow.example/x?a=1", keep_query=True) == (
        "https://mlflow.example/x?a=1")
    for plain in ("sqlite:////home/u/.relay/mlflow/mlflow.db", "http://127.0.0.1:5000"):
        assert redact(plain, keep_query=True) == plain

