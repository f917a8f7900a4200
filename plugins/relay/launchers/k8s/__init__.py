"""The Kubernetes launcher: an Indexed Job per attempt, built as data and submitted."""
