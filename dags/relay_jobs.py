"""Airflow DAG file: one Relay DAG per job spec in dags/jobs/ (wiring only)."""

from relay.operators.dag_factory import job_dags

globals().update(job_dags())
