"""Airflow DAG file: report invalid job specs in dags/jobs/ as an import error of this file.

It defines no DAG. Kept apart from relay_jobs.py so that a bad spec shows up in
Airflow's import errors (file:line, field, fix) while every good job still loads.
"""

from relay.operators.dag_factory import raise_for_invalid_specs

raise_for_invalid_specs()
