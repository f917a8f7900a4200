"""Relay in Airflow's UI: the plugin and the Recovery page.

May import every role below ``relay.tools``.
"""
