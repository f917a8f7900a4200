"""A resident agent started before its DAG run exists, and its claim by the run.

``airflow dags test`` spends its first seconds on Airflow alone (its CLI imports,
parsing the DAG folder, building the in-process execution API) with one of the
host's cores idle; the run's resident agent (:mod:`relay_train.resident`) then
spends seconds importing the training stack, on the path to the first step.
Relay's own runner of ``airflow dags test`` (:func:`relay.demo.run_dag_test`)
starts the resident first, in ``$RELAY_HOME/residents/<id>``, and names it in the
DAG run's conf (``relay_resident``); the local launcher's preflight claims it
(:func:`claim`) instead of starting one. Nothing else changes: the run's
``resident`` folder is a link to the prestarted one, so the run's end stops it as
it stops its own. A run started any other way (the scheduler, a bare ``airflow dags
test``) starts its resident in preflight, as before.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from relay import settings
from relay.launchers.local_standby import live_resident, release, start_recorded
from relay_train.resident import CLAIM_FILE, RESIDENT_DIR

log = logging.getLogger(__name__)

CONF_KEY = "relay_resident"  # in a DAG run's conf: the prestarted resident's folder
PRESTART_FOLDER = "residents"  # in $RELAY_HOME
HOST = "host"  # the prestarted resident's name: it serves every node of this host
# Unclaimed this long after its start, a prestarted resident leaves by itself (its
# runner normally stops it when airflow dags test exits); Airflow's start-up takes
# 5-6 s here.
CLAIM_WITHIN_SECONDS = 180.0


def residents_dir(home: Path | None = None) -> Path:
    """Return the folder of the prestarted residents of ``home`` (default $RELAY_HOME)."""
    return (home or settings.relay_home()) / PRESTART_FOLDER


def prestart_resident(home: Path, env: dict[str, str] | None = None) -> Path:
    """Start a resident agent for a DAG run about to be started; return its folder."""
    directory = residents_dir(home) / uuid.uuid4().hex
    directory.mkdir(parents=True)
    pid = start_recorded(["relay_train.resident", "--dir", str(directory), "--node", HOST,
                          "--claim-within", str(CLAIM_WITHIN_SECONDS)], directory, HOST, env)
    log.info("Prestarted a resident agent for the DAG run: pid %d in %s", pid, directory)
    return directory


def prestarted(conf: object) -> Path | None:
    """Return the prestarted resident a DAG run's conf names, if it names one of ours.

    The conf comes from whoever triggered the run: only a folder directly in this
    home's ``residents`` folder is taken, never a path elsewhere."""
    value = conf.get(CONF_KEY) if isinstance(conf, dict) else None
    if not isinstance(value, str) or not value:
        return None
    folder = Path(value)
    if folder.parent.resolve() != residents_dir().resolve() or folder.name in ("", ".", ".."):
        log.warning("DAG run conf %s=%r is not a folder in %s; starting a resident here "
                    "instead", CONF_KEY, value, residents_dir())
        return None
    return folder


def claim(run_dir: Path, folder: Path) -> bool:
    """Make the prestarted resident in ``folder`` the DAG run's; False if it is gone or
    another run claimed it (the caller starts one then)."""
    link = run_dir / RESIDENT_DIR
    if link.exists() or link.is_symlink() or live_resident(folder) is None:
        return False  # the run has a resident folder (a dangling link too), or it is gone
    staged = folder / f"{CLAIM_FILE}.{uuid.uuid4().hex}"
    staged.write_text(str(run_dir))
    try:
        os.link(staged, folder / CLAIM_FILE)  # exclusive, and whole when it appears
    except FileExistsError:
        return False
    finally:
        staged.unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    link.symlink_to(folder.resolve(), target_is_directory=True)
    return True


def release_unclaimed(folder: Path) -> None:
    """Stop the prestarted resident in ``folder`` unless a DAG run claimed it."""
    if not (folder / CLAIM_FILE).exists():
        release(folder)
