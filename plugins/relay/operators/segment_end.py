"""What a segment's task does once its attempt is over: the observe-mode records logged to
its MLflow run, the time to resume of the recovery that started it finished, and, on a
retry, Airflow's notes rewritten with it. A mixin of
:class:`~relay.operators.segment.TrainSegmentOperator` (also called by
:mod:`relay.operators.handover`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relay.core.attempt import Attempt
from relay.launchers import Launcher
from relay.lineage import resume_time, traces
from relay.operators.airflow_notes import write_notes
from relay.policy.observe import log_observations
from relay.recover import journal
from relay.recover.record import best_effort


class SegmentEnd:
    """The end of a segment attempt, as its task records it."""

    segment: int  # set by the operator

    @staticmethod
    def log_observations(context: Any, lineage: Any, run_id: str,  # noqa: ANN401
                         attempt: Attempt) -> None:
        """Log the attempt's observe-mode records (the task state store's, and this
        machine's files) to its MLflow run."""
        observed = journal.observations(context, attempt.folder)
        best_effort("log the observations",
                    lambda: log_observations(lineage, run_id, attempt.folder, observed))

    def resumed(self, context: Any, attempt: Attempt, lineage: Any,  # noqa: ANN401
                launcher: Launcher, parent: Callable[[], str]) -> None:
        """An attempt reached its segment's end (completed or handed over): finish the time
        to resume of the recovery that started it and, on a retry, rewrite the notes with
        it ("back in ...s"; the DAG run's no longer "not resumed yet")."""
        self.finish_resume_time(attempt, lineage, launcher)
        if int(context["ti"].try_number) > 1:
            write_notes(context, lineage, parent, self.segment)

    @staticmethod
    def finish_resume_time(attempt: Attempt, lineage: Any,  # noqa: ANN401
                           launcher: Launcher) -> None:
        """Finish the time-to-resume breakdown of the recovery that started this attempt."""
        continuity = launcher.continuity
        faulty = resume_time.finish_previous(lineage, attempt.folder,
                                             None if continuity is None else continuity.run_id_of)
        if faulty is not None:  # the rest of the recovery's spans, and the recovery's own
            traces.emit_resumed(faulty, background=True)
