"""The words of the Recovery page, each with the one line a newcomer needs.

The page shows each explanation beside its figure and lists them all at its foot;
``relay.ui.page_html`` looks them up here so that a term means one thing
everywhere it appears.
"""

from __future__ import annotations

GLOSSARY: dict[str, str] = {
    "ETTR": "effective training time ratio: the share of the run's wall-clock time spent "
            "on training that counted (1.00 means nothing was lost).",
    "goodput": "the useful part of the run's time: training that was kept, as opposed to "
               "time lost to faults, restarts and steps trained twice.",
    "time lost": "from when a fault struck to the retry's first training step, plus the "
                 "time the lost steps had taken.",
    "ETA": "time left at the pace of the attempts that completed so far.",
    "lost steps": "steps trained after the checkpoint the retry resumed from: they were "
                  "thrown away and trained again.",
    "detected after": "from when the fault struck (the culprit's last sign of progress) to "
                      "when Relay's watcher declared it.",
    "time to resume": "from when the fault struck to the retry's first training step: "
                      "detection first, then stopping, placing, starting and loading the "
                      "checkpoint.",
    "culprit": "the rank, and its node, that Relay holds responsible; the other ranks "
               "usually just wait for it.",
    "quarantined": "a node Relay keeps out of new attempts until the time shown, because a "
                   "fault was blamed on it.",
    "segment": "one Airflow task of the DAG run, covering a range of steps [first, end); "
               "each try is one Airflow try of that task (an attempt).",
    "adopted": "at a segment's end the training processes keep going and the next "
               "segment's task adopts them (watches them) instead of restarting them: an "
               "attempt's workload may train past its own segment's end.",
    "first step after": "the attempt's start-up: from its start to its first training step "
                        "(launch, rendezvous, loading the checkpoint).",
    "stack": "where the culprit was when Relay asked, innermost first: your own code "
             "first, Relay's, torch's and Python's frames folded below it.",
    "held at its min": "the hang limit derived from the measured step time was below the "
                       "policy's floor, so the floor applies.",
    "throughput": "training steps per second, from each step's own time (smoothed), per "
                  "attempt: a drop shows a slow node, a gap a restart.",
}


def explain(term: str) -> str:
    """Return the one-line explanation of ``term`` (a key of :data:`GLOSSARY`)."""
    return GLOSSARY[term]
