"""The watchers: deferrable triggers and sensors that turn observations into one fault.

``triggers`` gather what the node agents report (over the launcher's channel),
``detection`` with ``slowness`` and ``steptime`` classify it, ``sensors`` offer the
same to jobs Relay did not launch. A watcher that fires a fault also arms the
attempt's warden (``relay.recover``). May import ``relay.recover`` and below.
"""
