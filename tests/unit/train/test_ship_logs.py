"""A node agent logs its ranks' logs to the attempt's MLflow run when the launch asks
(pods and hosts whose disk Relay does not share), and never when it does not."""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient

from relay_train.agent.ranks import ship_logs
from relay_train.protocol.launch import LaunchConfig


def _config(tmp_path: Path, ship: bool) -> LaunchConfig:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment(f"logs-{ship}", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(exp).info.run_id
    cfg = LaunchConfig(job="j", seed=0, model={}, data={}, optimizer={}, start_step=0,
                       end_step=4, checkpoint_every=4, nodes=["pod-0"], ranks_per_node=1,
                       tracking_uri=uri, run_id=run_id, attempt_dir=str(tmp_path / f"a-{ship}"),
                       attempt=0, segment=0, logs_to_mlflow=ship)
    cfg.log_dir.mkdir(parents=True)
    (cfg.log_dir / "rank-0.log").write_text("step 4 done\n")
    return cfg


def test_rank_logs_go_to_the_attempts_run_only_when_the_launch_asks(tmp_path: Path) -> None:
    shipped, kept = _config(tmp_path, True), _config(tmp_path, False)
    client = MlflowClient(tracking_uri=shipped.tracking_uri)

    ship_logs(shipped, "pod-0")
    ship_logs(kept, "pod-0")

    assert [f.path for f in client.list_artifacts(shipped.run_id, "logs/pod-0")] == [
        "logs/pod-0/rank-0.log"]
    local = client.download_artifacts(shipped.run_id, "logs/pod-0/rank-0.log",
                                      str(tmp_path / "dl"))
    assert Path(local).read_text() == "step 4 done\n"
    assert client.list_artifacts(kept.run_id) == []
