"""The node pool: which nodes exist, which are quarantined or leased, and its stores.

May import ``relay.spec`` and ``relay.core``.
"""
