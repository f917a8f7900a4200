"""The ``relay`` command and what it runs: demo, doctor, services, chaos, benchmarks.

The top layer: may import every role; nothing imports it.
"""
