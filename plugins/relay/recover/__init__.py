"""The recovery pipeline: what happens to an attempt once a fault is detected.

decide -> claim -> save state (evidence, drain or rescue) -> stop -> fence ->
quarantine -> record, in :mod:`relay.recover.pipeline`, run by the segment task and
by the warden that acts when Airflow cannot. May import ``relay.policy`` and below,
never Airflow's task machinery.
"""
