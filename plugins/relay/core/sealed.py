"""A secret sealed for a launch record, opened by whoever holds the deployment's key ring.

An attempt's channel secret must reach every Relay component that talks to its agents,
on whatever machine (Airflow's Celery or Kubernetes executor: the trigger, a later
``execute_complete``, a retry, the warden). It travels in the launch record, which is
kept in Airflow's metadata database (trigger arguments, the task state store, readable
through Airflow's REST API), so it travels sealed: Fernet (AES-128-CBC with
HMAC-SHA256, from ``cryptography``, which Airflow itself uses for connections) under a
key derived from the ring's writing key for this purpose only. A reader of those stores
learns nothing; every worker and triggerer of a deployment holds the ring anyway (it
signs and checks checkpoints: :mod:`relay.core.checkpoint_keys`). The key id travels
with the seal, so a record sealed before a key rotation opens while the old key is
still in the ring.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

from cryptography.fernet import Fernet, InvalidToken

from relay_train.protocol.signing import KeyRing

PURPOSE = b"relay launch record seal v1"  # domain separation from checkpoint signatures


def _fernet(key: str) -> Fernet:
    derived = hmac.new(key.encode(), PURPOSE, hashlib.sha256).digest()
    return Fernet(base64.urlsafe_b64encode(derived))


def seal(value: str, ring: KeyRing) -> dict[str, str]:
    """Return ``value`` sealed with the ring's writing key (JSON-ready)."""
    token = _fernet(ring.keys[ring.write]).encrypt(value.encode())
    return {"key_id": ring.write, "token": token.decode()}


def unseal(sealed: Mapping[str, Any], ring: KeyRing) -> str | None:
    """Return the value ``seal`` sealed, or None when ``ring`` cannot open it (its key is
    not in the ring, or the seal was altered)."""
    key = ring.keys.get(str(sealed.get("key_id")))
    if key is None:
        return None
    try:
        return _fernet(key).decrypt(str(sealed.get("token", "")).encode()).decode()
    except (InvalidToken, ValueError):
        return None
