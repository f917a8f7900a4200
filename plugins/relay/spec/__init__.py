"""The job spec: one YAML file per job, read with line numbers, validated, explained.

Holds the spec model and its sections, the YAML loader that turns validation errors
into file:line problems, ``checkpoint_every``, where a spec's policy points and the
fault injection a DAG run's conf may ask for. May import ``relay.core`` and
``relay_train.protocol``.
"""
