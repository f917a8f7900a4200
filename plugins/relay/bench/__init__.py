"""Benchmarks behind `relay bench`."""
