"""Warm the scheduler: the task processes its LocalExecutor forks start with MLflow.

Relay's tasks all open the lineage in MLflow (preflight, every segment, the
deferred task that decides a fault, finalize), and importing it costs ~1.2 s of
CPU. Under the LocalExecutor every task process is forked from a worker that the
scheduler forked, so an import done once in the scheduler is inherited by all of
them. Without it a recovery paid that import twice on its critical path, in the
deferred task that decides (``decide``) and in the retry's task before its launch
(``launch``): 1.0-1.2 s each in `relay bench scheduled`, against 0.1-0.4 s with
it. Airflow calls a lifecycle listener's ``on_starting`` with a bare ``Job`` before
its runner gives it a type, so the process's command tells the scheduler apart;
other components, other executors and ``airflow dags test`` import nothing here
(the Recovery page's plugin load must stay light: see ``relay.ui.recovery_page``).
"""

from __future__ import annotations

import logging
import sys

from airflow.listeners import hookimpl

log = logging.getLogger(__name__)


def forks_tasks(component: object, argv: list[str], executor: str) -> bool:
    """Return whether ``component`` starts a scheduler whose executor forks the task
    processes (a task process forked from it has its argv too, but starts a task runner)."""
    return (type(component).__name__ == "Job" and argv[1:2] == ["scheduler"]
            and "LocalExecutor" in executor)


@hookimpl
def on_starting(component: object) -> None:
    """In the scheduler of a LocalExecutor deployment, import Relay's lineage (MLflow)."""
    from airflow.configuration import conf

    if not forks_tasks(component, sys.argv, conf.get("core", "executor", fallback="")):
        return
    import relay.lineage.store  # noqa: F401 - the import is the point

    log.info("Relay: imported MLflow in the scheduler, for the task processes it forks")
