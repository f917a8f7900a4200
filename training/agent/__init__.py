"""A node's agent: starts the node's ranks, answers Relay over HTTP, stops on demand.

``node`` is the agent itself (``python -m relay_train.agent.node``), ``ranks`` its
rank processes, ``server`` its HTTP API (the server side of the channel, whose
routes and messages are :mod:`relay_train.protocol.routes`; Relay's client is
``relay.launchers.agent_client``; every request signed, see
:mod:`relay_train.protocol.channel_auth`), ``limits`` what one request may cost it,
``node_status`` what it says about itself, ``node_files`` what it reads to answer,
``rank_requests`` the rescue and stacks requests it hands its ranks,
``standby``/``standby_fork``/``resident``/``preload``/``priority`` keep agents warm
before they are needed.
"""
