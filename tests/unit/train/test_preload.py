"""What a node agent preloads: MLflow and the tracking store its URI opens, on every node.

Each case runs in a fresh interpreter: this test process may have imported the store.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from relay_train.protocol.channel_auth import new_secret
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig

STORE = "mlflow.store.tracking.sqlalchemy_store"


def _imported_after(code: str) -> bool:
    """Run ``code`` in a new interpreter; return whether it left the database store imported."""
    probe = f"import json, sys\n{code}\nprint(json.dumps({STORE!r} in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_the_store_of_a_database_uri_is_imported_and_a_servers_is_not() -> None:
    preload = "from relay_train.checkpoints.publish import preload_store; preload_store({!r})"
    assert _imported_after(preload.format("sqlite:////tmp/relay/mlflow.db"))
    assert _imported_after(preload.format("postgresql+psycopg2://relay@127.0.0.1/mlflow"))
    assert not _imported_after(preload.format("http://127.0.0.1:5000"))
    assert not _imported_after(preload.format("/tmp/relay/mlruns"))


def test_a_standby_preloading_for_a_uri_it_does_not_know_imports_the_database_store() -> None:
    assert _imported_after(
        "from relay_train.agent.preload import preload_worker\n"
        "from relay_train.protocol.launch import BUILTIN_ENTRYPOINT, Entrypoint\n"
        "preload_worker(Entrypoint(BUILTIN_ENTRYPOINT), publisher=True)")
    assert not _imported_after(
        "from relay_train.agent.preload import preload_worker\n"
        "from relay_train.protocol.launch import BUILTIN_ENTRYPOINT, Entrypoint\n"
        "preload_worker(Entrypoint(BUILTIN_ENTRYPOINT), publisher=False)")


def test_rank_0s_node_preloads_only_what_its_tracking_uri_opens() -> None:
    worker = ("from relay_train.agent.preload import preload_worker\n"
              "from relay_train.protocol.launch import BUILTIN_ENTRYPOINT, Entrypoint\n"
              "preload_worker(Entrypoint(BUILTIN_ENTRYPOINT), publisher=True, "
              "tracking_uri={!r})")
    assert not _imported_after(worker.format("http://127.0.0.1:5000"))
    assert _imported_after(worker.format("sqlite:////tmp/relay/mlflow.db"))


def test_every_nodes_agent_imports_mlflow_before_it_forks_its_ranks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    # Not only rank 0's: an agent that imported MLflow beside its running ranks held the
    # GIL for seconds while its channel thread waited, and its node looked silent under load.
    from relay_train.agent import node as agent_node

    asked: dict[str, bool] = {}
    cfg = LaunchConfig(job="preload", seed=0, model={}, data={}, optimizer={}, start_step=0,
                       end_step=1, checkpoint_every=1, nodes=["node-a", "node-b"],
                       ranks_per_node=2, tracking_uri="sqlite:////tmp/relay/mlflow.db",
                       run_id="", attempt_dir=str(tmp_path), attempt=0, segment=0,
                       channel_secret=new_secret(), backend="gloo")
    for node in cfg.nodes:
        monkeypatch.setattr(agent_node, "preload_worker",
                            lambda _entry, *, publisher, tracking_uri=None, node=node:
                            asked.__setitem__(node, publisher and tracking_uri == cfg.tracking_uri))
        agent_node.NodeAgent(cfg, tmp_path / LAUNCH_FILE, node).preload()
    assert asked == {"node-a": True, "node-b": True}
    assert not any(t.name == "preload-behind" for t in threading.enumerate())
