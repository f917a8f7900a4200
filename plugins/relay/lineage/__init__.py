"""What Relay records: MLflow runs and checkpoints, reports read back from them.

``store`` is the MLflow client side (a parent run per DAG run, a child run per
attempt, checkpoints with manifests, fencing), ``summary``/``report``/``run_view``/
``report_files`` read it back, ``resume_time`` and ``interval`` measure recoveries
and checkpoint intervals. May import ``relay.nodes``, ``relay.spec``, ``relay.core``.
"""
