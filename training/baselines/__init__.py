"""Training loops without Relay, for the benchmarks' comparisons."""
