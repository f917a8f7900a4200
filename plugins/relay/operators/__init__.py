"""The Airflow side of a job: the DAG factory and its operators.

``dag_factory`` turns job specs into DAGs (preflight >> segments >> finalize),
``segment`` is the segment task (launch, defer to the watcher, hand a fault to the
recovery pipeline, succeed or raise for Airflow's retry). May import every role
below it: ``relay.watch``, ``relay.recover`` and down.
"""

from relay.core.checkpoint_keys import use_source
from relay.operators.checkpoint_keys_airflow import airflow_ring

use_source(airflow_ring)  # inside Airflow, its Variable or Connection holds the key ring first
