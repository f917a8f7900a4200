"""Moved to :mod:`relay.core.airflow_api` (the segment task writes notes with it too);
this name stays for the scripts and tests that import it from here."""

from relay.core.airflow_api import RELAY_DAG_TAG, AirflowApi

__all__ = ["RELAY_DAG_TAG", "AirflowApi"]
