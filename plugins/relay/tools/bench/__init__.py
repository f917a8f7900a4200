"""Benchmarks behind ``relay bench``: each prints the figures the docs quote."""
