"""A resident agent started before its DAG run exists, and the run that takes it.

``airflow dags test`` spends its first seconds on Airflow alone (its CLI imports,
parsing the DAG folder, building the in-process execution API) with one of the
host's cores idle; the run's resident agent (:mod:`relay_train.agent.resident`) then
spends seconds importing the training stack, on the path to the first step.
Relay's own runner of ``airflow dags test`` (:func:`relay.tools.demo.run_dag_test`)
starts the resident first, in ``$RELAY_HOME/residents/<id>``, and names it in the
DAG run's conf (``relay_resident``); the local launcher's preflight takes it
(:func:`take`) instead of starting one. Nothing else changes: the run's
``resident`` folder is a link to the prestarted one, so the run's end stops it as
it stops its own. A run started any other way (the scheduler, a bare ``airflow dags
test``) starts its resident in preflight, as before.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from relay.core import settings
from relay.launchers.local.warm_agents import live_resident, release, start_recorded
from relay_train.agent.resident import NOT_TAKEN, RESIDENT_DIR, TAKEN_BY_FILE, take_resident

log = logging.getLogger(__name__)

CONF_KEY = "relay_resident"  # in a DAG run's conf: the prestarted resident's folder
DAG_FILE = "dag_id"  # in its folder: the DAG whose run it was prestarted for
PRESTART_FOLDER = "residents"  # in $RELAY_HOME
HOST = "host"  # the prestarted resident's name: it serves every node of this host
# Untaken this long after its start, a prestarted resident leaves by itself (its
# runner normally stops it when airflow dags test exits); Airflow's start-up takes
# 5-6 s here.
TAKE_WITHIN_SECONDS = 180.0
# An untaken resident's folder is removed this long after it was released (its
# SIGTERM'd process has left by then) or, never released (its runner died), after
# twice the time it waits to be taken.
PRUNE_AFTER_SECONDS = 60.0


def residents_dir(home: Path | None = None) -> Path:
    """Return the folder of the prestarted residents of ``home`` (default $RELAY_HOME)."""
    return (home or settings.relay_home()) / PRESTART_FOLDER


def prestart_resident(home: Path, dag_id: str, env: dict[str, str] | None = None) -> Path:
    """Start a resident agent for a DAG run of ``dag_id`` about to be started; return its
    folder."""
    prune_untaken(home)
    directory = residents_dir(home.resolve()) / uuid.uuid4().hex
    directory.mkdir(parents=True)
    (directory / DAG_FILE).write_text(dag_id)
    pid = start_recorded(["relay_train.agent.resident", "--dir", str(directory), "--node", HOST,
                          "--take-within", str(TAKE_WITHIN_SECONDS)], directory, HOST, env)
    log.info("Prestarted a resident agent for a DAG run of %s: pid %d in %s", dag_id, pid,
             directory)
    return directory


def prestarted(conf: object, dag_id: str) -> Path | None:
    """Return the prestarted resident a DAG run's conf names, if it names one of ours,
    prestarted for a run of ``dag_id``.

    The conf comes from whoever triggered the run: only a folder directly in this
    home's ``residents`` folder is taken, never a path elsewhere, and only for the DAG
    it was started for (a conf copied into another DAG's run does not take it)."""
    value = conf.get(CONF_KEY) if isinstance(conf, Mapping) else None
    if value is None:
        return None
    try:
        folder = Path(value)
        ours = folder.name not in ("", ".", "..") and \
            folder.parent.resolve() == residents_dir().resolve()
        ours = ours and (folder / DAG_FILE).read_text() == dag_id
    except (TypeError, ValueError, OSError):  # not a string, a NUL byte, no such folder
        ours = False
    if not ours:
        log.warning("DAG run conf %s=%r does not name a resident agent prestarted in %s for "
                    "a run of %s; starting one here instead", CONF_KEY, value,
                    residents_dir(), dag_id)
        return None
    return folder


def take(run_dir: Path, folder: Path) -> bool:
    """Make the prestarted resident in ``folder`` the DAG run's; False if it is gone or
    another run took it (the caller starts one then)."""
    link = run_dir / RESIDENT_DIR
    if link.exists() or link.is_symlink() or live_resident(folder) is None:
        return False  # the run has a resident folder (a dangling link too), or it is gone
    if not take_resident(folder, str(run_dir)):
        return False
    run_dir.mkdir(parents=True, exist_ok=True)
    link.symlink_to(folder.resolve(), target_is_directory=True)
    return True


def release_untaken(folder: Path) -> None:
    """Stop the prestarted resident in ``folder`` unless a DAG run took it (taking
    it first, so that no run takes it while it stops)."""
    if take_resident(folder, NOT_TAKEN):
        release(folder)


def prune_untaken(home: Path) -> list[Path]:
    """Remove the folders of prestarted residents that no DAG run took and that have
    left; return them. A taken one is its run's (the run's ``resident`` folder links
    to it, with its log) and stays as long as the run's folder."""
    removed = []
    now = time.time()
    for folder in sorted(residents_dir(home).glob("*")):
        try:
            taken = (folder / TAKEN_BY_FILE).read_text()
            idle = now - (folder / TAKEN_BY_FILE).stat().st_mtime > PRUNE_AFTER_SECONDS
        except FileNotFoundError:  # never taken nor released: its runner died, or starting
            taken, idle = NOT_TAKEN, _age(folder, now) > 2 * TAKE_WITHIN_SECONDS
        except OSError:
            continue
        if taken == NOT_TAKEN and idle and live_resident(folder) is None:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    if removed:
        log.info("Removed %d folder(s) of prestarted resident agents no DAG run took, "
                 "in %s", len(removed), residents_dir(home))
    return removed


def _age(folder: Path, now: float) -> float:
    """Return the seconds since ``folder`` was created (its ``dag_id`` file's write)."""
    try:
        return now - (folder / DAG_FILE).stat().st_mtime
    except OSError:
        return 0.0
