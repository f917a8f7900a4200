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
Relay), and says so. The tracking URI, the channel secret and the checkpoint key ring
are left out of the record: the URI may carry credentials, the ring is the deployment's
signing key, and the task state store is readable through Airflow's REST API. Whoever
restores a record fills in the URI of its own settings (the same store), and the ring
from the attempt's launch file where this machine has it (else the deployment's, see
:func:`relay.core.checkpoint_keys.ring_for`). A launcher's channel reads the channel
secret where the attempt's agents get it (the launch file, written 0600).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from relay.core.attempt import Attempt
from relay.launchers import Launcher
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig

KEY = "launch_record"  # in trigger events and journal entries

log = logging.getLogger(__name__)
_restored: dict[Path, LaunchConfig] = {}  # attempt folder -> its config, in this process


def build(cfg: LaunchConfig, launcher: Launcher) -> dict[str, Any]:
    """Return the launch record of the attempt ``cfg`` describes (JSON, no tracking URI and
    no channel secret)."""
    launch = dataclasses.asdict(cfg)
    launch["tracking_uri"] = ""
    launch["channel_secret"] = ""  # the launcher finds it where the agents have it
    launch["checkpoint_keys"] = {}
    return {"launch": launch, "handle": launcher.handle(Attempt(cfg.root))}


def restore(record: Mapping[str, Any], launcher: Launcher, tracking_uri: str) -> LaunchConfig:
    """Return the record's launch config, and have ``launcher`` find the attempt by its handle."""
    cfg = LaunchConfig.from_dict({**record["launch"], "tracking_uri": tracking_uri})
    cfg = dataclasses.replace(cfg, checkpoint_keys=_local_keys(cfg.root))
    launcher.attach(Attempt(cfg.root), dict(record.get("handle") or {}))
    _restored[cfg.root] = cfg
    return cfg


def _local_keys(root: Path) -> dict[str, Any]:
    """Return the key ring in the attempt's launch file on this machine ({} if none here)."""
    try:
        return LaunchConfig.read(root / LAUNCH_FILE).checkpoint_keys
    except (OSError, ValueError, TypeError):
        return {}


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
