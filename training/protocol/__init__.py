"""The contracts both sides share: standard library only.

Heartbeat records, the launch file, checkpoint manifests, process identity (PID
with start time). Relay (``relay``) and the worker side (``relay_train``) both
import these; nothing here imports torch, MLflow or Airflow.
"""
