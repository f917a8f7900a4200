"""An attempt's launch record travels with the attempt, not in one worker's folder.

With Airflow's Celery or Kubernetes executor, ``execute``, the trigger and
``execute_complete`` may each run on a different machine. What Relay needs to
find a launched attempt again is its :class:`~relay_train.protocol.launch.LaunchConfig`
and its launcher's handle (:meth:`relay.launchers.Launcher.handle`); together
they are the *launch record*, and it rides:

- in the watcher's own arguments (``SegmentWatchTrigger(launch_record=...)``,
  kept encrypted in Airflow's metadata database while the task is deferred),
  which hands it back in its event to ``execute_complete`` and to the warden;
- in the journal entry of the task state store (:mod:`relay.recover.journal`), for a
  retry that finishes the record of a try killed mid-way, or stops what it left.

``launch.json`` in the attempt folder stays the ranks' copy on their node; Relay
reads it only for a record that carries none (an attempt launched by an older
Relay), and says so. The tracking URI and the checkpoint key ring are left out of
the record: the URI may carry credentials, the ring is the deployment's signing key,
and the task state store is readable through Airflow's REST API. Whoever restores a
record fills in the URI of its own settings (the same store), and the ring from the
attempt's launch file where this machine has it (else the deployment's, see
:func:`relay.core.checkpoint_keys.ring_for`). The attempt's channel secret travels
sealed with the deployment's key ring (:mod:`relay.core.sealed`): a machine without
the launch file opens it with the ring; a reader of Airflow's stores cannot.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from relay.core.attempt import Attempt
from relay.core.checkpoint_keys import ring_for
from relay.core.sealed import seal, unseal
from relay.launchers.base import Launcher
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig

KEY = "launch_record"  # in trigger events and journal entries

log = logging.getLogger(__name__)
SEALED_SECRET = "channel_secret_sealed"  # the record's field (relay.core.sealed)
_restored: dict[Path, LaunchConfig] = {}  # attempt folder -> its config, in this process


def build(cfg: LaunchConfig, launcher: Launcher) -> dict[str, Any]:
    """Return the launch record of the attempt ``cfg`` describes (JSON: no tracking URI, no
    key ring, the channel secret sealed)."""
    launch = dataclasses.asdict(cfg)
    launch["tracking_uri"] = ""
    launch["channel_secret"] = ""
    launch["checkpoint_keys"] = {}
    record: dict[str, Any] = {"launch": launch, "handle": launcher.handle(Attempt(cfg.root))}
    # The launcher made the secret as it launched: its launch file has it on this machine.
    secret = cfg.channel_secret or ((local := _local(cfg.root)) and local.channel_secret)
    if secret:
        try:
            record[SEALED_SECRET] = seal(secret, ring_for(cfg))
        except (OSError, ValueError) as exc:
            log.warning("The launch record of %s carries no channel secret (%s): only the "
                        "machine that launched it can talk to its agents", cfg.root, exc)
    return record


def restore(record: Mapping[str, Any], launcher: Launcher, tracking_uri: str) -> LaunchConfig:
    """Return the record's launch config, and have ``launcher`` find the attempt by its handle.

    The key ring and the channel secret come from the attempt's launch file where this
    machine has it; else the ring is the deployment's and the secret is unsealed with it.
    """
    cfg = LaunchConfig.from_dict({**record["launch"], "tracking_uri": tracking_uri})
    local = _local(cfg.root)
    cfg = dataclasses.replace(cfg, checkpoint_keys=local.checkpoint_keys if local else {})
    secret = local.channel_secret if local and local.channel_secret else _unsealed(record, cfg)
    cfg = dataclasses.replace(cfg, channel_secret=secret)
    launcher.attach(Attempt(cfg.root), dict(record.get("handle") or {}))
    _restored[cfg.root] = cfg
    return cfg


def _local(root: Path) -> LaunchConfig | None:
    """Return the attempt's launch file on this machine (None if it is not here)."""
    try:
        return LaunchConfig.read(root / LAUNCH_FILE)
    except (OSError, ValueError, TypeError):
        return None


def _unsealed(record: Mapping[str, Any], cfg: LaunchConfig) -> str:
    """Return the record's channel secret, opened with the deployment's ring ("" if not)."""
    sealed = record.get(SEALED_SECRET)
    if not isinstance(sealed, Mapping):
        log.warning("The launch record of %s carries no sealed channel secret and its launch "
                    "file is not on this machine: its agents will refuse this worker", cfg.root)
        return ""
    try:
        secret = unseal(sealed, ring_for(cfg))
        why = (f"key {sealed.get('key_id')!r} is not in this machine's key ring, or the seal "
               "was altered")
    except (OSError, ValueError) as exc:
        secret, why = None, str(exc)
    if secret is None:
        log.warning("Cannot open the channel secret of %s: %s. Give this machine the "
                    "deployment's key ring (docs/security.md#signed-checkpoints)", cfg.root, why)
        return ""
    return secret


def find(root: Path, launcher: Launcher, tracking_uri: str,
         *records: Mapping[str, Any] | None) -> LaunchConfig:
    """Return the launch config of the attempt at ``root`` from the first record that is
    this attempt's (restoring its handle into ``launcher``); else from its folder."""
    for record in records:
        if record and record.get("launch", {}).get("attempt_dir") == str(root):
            return restore(record, launcher, tracking_uri)
    if root in _restored:
        return _restored[root]
    log.warning("No launch record of %s travelled with the task; reading %s from the attempt "
                "folder (only works on the machine that launched it)", root, LAUNCH_FILE)
    return LaunchConfig.read(root / LAUNCH_FILE)


def config_of(root: Path, default: LaunchConfig | None = None) -> LaunchConfig:
    """Return the launch config of an attempt restored in this process, else its folder's
    (else ``default``, if given)."""
    if root in _restored:
        return _restored[root]
    if default is not None and not (root / LAUNCH_FILE).exists():
        return default
    return LaunchConfig.read(root / LAUNCH_FILE)
