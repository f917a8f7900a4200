"""Where a segment runs: local processes or Kubernetes."""
