"""Airflow DAG file: watch a training job that Relay did not launch (wiring only).

The job writes heartbeats with relay_train.protocol.heartbeat.HeartbeatWriter into one
folder; trigger this DAG with {"heartbeat_dir": "/path/to/heartbeats",
"world_size": 4}; the folder must be under $RELAY_WATCH_ROOTS (default
$RELAY_HOME) and a policy_file in the policies folder. It succeeds when every
rank reports done and fails, naming the fault, culprit and evidence, when the
heartbeats show a fault.
"""

from datetime import datetime

from airflow.sdk import DAG, Param

from relay.core.paths import watch_roots
from relay.watch.sensors import HeartbeatSensor, ThroughputSensor

with DAG(
    dag_id="relay_watch_external",
    description="Watch any job that writes Relay heartbeats",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["relay", "example"],
    params={
        "heartbeat_dir": Param("", type="string", description="the job's heartbeat folder"),
        "world_size": Param(1, type="integer", minimum=1, description="ranks in the job"),
        "policy_file": Param("", type="string", description="policy (default thresholds if empty)"),
    },
):
    common = {
        "heartbeat_dir": "{{ params.heartbeat_dir }}",
        "world_size": "{{ params.world_size }}",
        "policy_file": "{{ params.policy_file }}",
        "confine_to": [str(root) for root in watch_roots()],  # the paths come from run conf
        "poke_interval": 1,
        "timeout": 6 * 3600,
    }
    HeartbeatSensor(task_id="heartbeats", **common)
    ThroughputSensor(task_id="throughput", **common)
