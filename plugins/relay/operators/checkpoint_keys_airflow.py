"""The checkpoint key ring from Airflow: a Variable or a Connection, where an operator set one.

Registered with :func:`relay.core.checkpoint_keys.use_source` when the operators are
imported, so Relay's code running inside Airflow (DAG tasks) finds the ring there first.
Either one, never both:

- Variable ``relay_checkpoint_keys``: ``{"write": "k2", "keys": {"k2": "...", "k1": "..."}}``;
- Connection ``relay_checkpoint_key``: login = the writing key's id (default ``k1``),
  password = its key, extra ``{"read": {"k1": "<old key>"}}`` for keys still accepted.
"""

from __future__ import annotations

import json
import logging

from relay.core.checkpoint_keys import KEYS_CONNECTION, KEYS_VARIABLE
from relay_train.protocol.signing import KeyRing

log = logging.getLogger(__name__)


def airflow_ring() -> KeyRing | None:
    """Return the ring set in Airflow (Variable, else Connection), or None if neither is."""
    from airflow.sdk import Connection, Variable

    try:
        raw = Variable.get(KEYS_VARIABLE, default=None)
    except Exception as exc:  # noqa: BLE001 - outside a task there is no Variable to read
        log.debug("No Airflow Variable %s here (%s)", KEYS_VARIABLE, exc)
        raw = None
    if raw:
        where = f"Airflow Variable {KEYS_VARIABLE}"
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: expected a JSON key ring, found invalid JSON ({exc})") \
                from None
        return KeyRing.from_dict(parsed, where)
    try:
        conn = Connection.get(KEYS_CONNECTION)
    except Exception as exc:  # noqa: BLE001 - not set (or no Airflow context): look elsewhere
        log.debug("No Airflow Connection %s here (%s)", KEYS_CONNECTION, exc)
        return None
    if not conn.password:
        return None
    key_id = conn.login or "k1"
    old = (conn.extra_dejson or {}).get("read") or {}
    return KeyRing.from_dict({"write": key_id, "keys": {**old, key_id: conn.password}},
                             f"Airflow Connection {KEYS_CONNECTION}")
