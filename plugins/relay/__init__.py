"""Relay: keep segmented distributed PyTorch training running through faults."""
