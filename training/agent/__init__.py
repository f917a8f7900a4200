"""A node's agent: starts the node's ranks, answers Relay over HTTP, stops on demand.

``node`` is the agent itself (``python -m relay_train.agent.node``), ``server`` its
HTTP API (the server side of the channel; Relay's client is
``relay.launchers.agent_client``), ``standby``/``resident``/``preload``/``priority``
keep agents warm before they are needed.
"""
