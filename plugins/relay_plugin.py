"""Airflow plugin entry point (the plugins folder's only module; see .airflowignore)."""

from relay.ui.plugin import RelayPlugin

__all__ = ["RelayPlugin"]
