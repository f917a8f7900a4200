"""The deployment's checkpoint key ring on Relay's side: where it comes from, first use.

Every checkpoint manifest is signed with a key MLflow never sees
(:mod:`relay_train.protocol.signing`). Relay's side looks for the ring, in order:

1. a source the Airflow side registers (:func:`use_source`): the Airflow Variable
   ``relay_checkpoint_keys`` (a JSON ring) or the Connection ``relay_checkpoint_key``
   (login: the key id, password: the key, extra ``{"read": {id: old key}}``);
2. the file ``$RELAY_CHECKPOINT_KEYS_FILE`` names (e.g. a mounted Kubernetes Secret);
3. ``$RELAY_HOME/checkpoint-keys.json``, the embedded default: created on first use with
   one random key, mode 0600 from its creation.

This module never imports Airflow: the warden (``relay.recover``) runs outside it, and
uses the ring its attempt was launched with (:func:`ring_for`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from relay.core import settings
from relay_train.protocol.env import ENV_CHECKPOINT_KEYS_FILE
from relay_train.protocol.launch import LaunchConfig
from relay_train.protocol.signing import KEYRING_FILE, KeyRing

log = logging.getLogger(__name__)

KEYS_VARIABLE = "relay_checkpoint_keys"  # Airflow Variable: a JSON ring
KEYS_CONNECTION = "relay_checkpoint_key"  # Airflow Connection: login = id, password = key

Source = Callable[[], KeyRing | None]
_source: Source | None = None


def use_source(source: Source | None) -> None:
    """Look for the ring in ``source`` first, in this process (the Airflow side's lookup)."""
    global _source  # noqa: PLW0603 - one lookup per process, set by the Airflow side
    _source = source


def default_key_file(home: Path | None = None) -> Path:
    """Return the embedded default key ring file (under ``$RELAY_HOME``)."""
    return (home or settings.relay_home()) / KEYRING_FILE


def checkpoint_keys(*, create: bool = True) -> KeyRing:
    """Return the deployment's key ring (see the module's docstring for the order).

    ``create=False``: never make the default file (a new key can verify nothing already
    signed); raise ``FileNotFoundError`` saying what to provide instead.
    """
    if _source is not None and (ring := _source()) is not None:
        return ring
    path = os.environ.get(ENV_CHECKPOINT_KEYS_FILE, "").strip()
    if path:
        return KeyRing.read(Path(path))
    default = default_key_file()
    if not create and not default.exists():
        raise FileNotFoundError(
            f"checkpoint key ring: expected the attempt's launch file, "
            f"{ENV_CHECKPOINT_KEYS_FILE} or {default}; found none on this machine. Give "
            f"this machine the deployment's key ring file and set {ENV_CHECKPOINT_KEYS_FILE}")
    return ensure_key_file(default)


def ring_for(cfg: LaunchConfig) -> KeyRing:
    """Return the ring an attempt was launched with (its launch file's), else the deployment's
    (never a new one: the attempt's checkpoints were signed with an existing key)."""
    if cfg.checkpoint_keys:
        return KeyRing.from_dict(cfg.checkpoint_keys, f"{cfg.root}: field checkpoint_keys")
    return checkpoint_keys(create=False)


def ensure_key_file(path: Path) -> KeyRing:
    """Return the ring in ``path``, creating it with one new key if it does not exist.

    Created atomically and private from its first byte: written to a temporary file made
    with mode 0600, then linked into place (two processes racing both read the winner's).
    """
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        ring = KeyRing.generate()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(json.dumps(ring.to_dict(), indent=2))
                out.flush()
                os.fsync(out.fileno())
            try:
                os.link(tmp, path)
                log.warning("Created the checkpoint signing key %s (key id %s); back it up: "
                            "without it, no checkpoint signed with it can be resumed from",
                            path, ring.write)
            except FileExistsError:
                pass  # another process made it first: use theirs
        finally:
            tmp.unlink(missing_ok=True)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise PermissionError(
            f"checkpoint key ring {path}: expected mode 0600 (owner only), found "
            f"{mode:04o}; run `chmod 600 {path}` (and rotate the key if others could read it)")
    return KeyRing.read(path)
