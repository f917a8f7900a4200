"""What the run page says: the stack's user frame first, words explained, adoption, no ETA
once ended, a reload only while running. Rendered from a hand-built RunView."""

from __future__ import annotations

import re
from dataclasses import replace
from html import unescape

from test_stack_view import CULPRIT_MAIN

from relay.lineage.report import FaultRow
from relay.lineage.run_view import AttemptView, RunView
from relay.ui.glossary import GLOSSARY
from relay.ui.page_html import adoption_note, run_html

T0 = 1_000.0
WHERE = "rank 1 in stall (inject.py:50); rank 0 waits in gloo:all_reduce #36"
HANG = {"kind": "hang", "culprit_rank": 1, "culprit_node": "node-a", "detected_at": T0 + 40,
        "evidence": {"summary": "rank 1 stalled (hang_timeout 3s, held at its min)",
                     "where": WHERE,
                     "stacks": [{"rank": 1, "node": "node-a", "culprit": True,
                                 "threads": {"main": CULPRIT_MAIN}},
                                {"rank": 0, "node": "node-b", "culprit": False,
                                 "threads": {"main": CULPRIT_MAIN[:5]}}]}}


def _attempts() -> list[AttemptView]:
    # Segment 0 try 1 hangs at 35; try 2 launches from 35 and hands its processes over at
    # 60 to segment 1, which adopts them, hands them to segment 2 at 120; they reach 180.
    common = {"fault": None, "decision": None}
    return [
        AttemptView(0, 1, "r1", ["node-a", "node-b"], 0, 60, "faulted", T0, T0 + 45, T0 + 10,
                    35, HANG, {"action": "restart_elsewhere", "rule": "rules.hang"}, 0, 35,
                    attempt_dir="/runs/s0/t1"),
        AttemptView(0, 2, "r2", ["node-b", "node-c"], 35, 60, "completed", T0 + 46, T0 + 70,
                    T0 + 50, 180, attempt_dir="/runs/s0/t2", handed_over_at=60, **common),
        AttemptView(1, 1, "r3", ["node-b", "node-c"], 60, 120, "completed", T0 + 66, T0 + 90,
                    T0 + 70, 120, attempt_dir="/runs/s1/t1", handed_over_at=120,
                    adopted_at=60, adopted_workload="/runs/s0/t2", **common),
        AttemptView(2, 1, "r4", ["node-b", "node-c"], 120, 180, "completed", T0 + 86, T0 + 110,
                    T0 + 90, 180, attempt_dir="/runs/s2/t1", adopted_at=120,
                    adopted_workload="/runs/s0/t2", **common),
    ]


def _view(outcome: str = "completed", ended: float | None = T0 + 110) -> RunView:
    goodput = {"elapsed_seconds": 110.0, "productive_seconds": 90.0, "ettr": 0.82,
               "lost_seconds_by_fault": {"hang": 12.0}}
    return RunView("demo", "relay_demo", "manual__1", "p1", outcome, 180, "ab" * 32, T0,
                   ended, _attempts(), [FaultRow(0, "hang", "rank 1, node-a", 3.4,
                                                 "restart_elsewhere", 0, 5.0)],
                   180, goodput, 0.0 if ended else 42.0)


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", " ", html)))


def test_the_stack_starts_with_the_culprits_user_frame_under_where_it_stopped() -> None:
    html = run_html(_view(), "n", "relay_demo")
    text = _text(html)
    stack = text.index("Culprit's stack: rank 1 on node-a (the culprit), main thread")
    assert text.index("Where it stopped: " + WHERE) < stack
    first_frame = text.index("train", stack + 60)
    assert "charlm.py:121" in text[first_frame:first_frame + 200]
    assert text.index("charlm.py:121") < text.index("charlm.py:140") < text.index(
        "inject.py", stack)
    # The rest is folded in a <details> that is closed, and the other rank in another.
    assert "<details class='folded'><summary>8 more frames: Relay 4, the standard library 4" \
        in html
    assert "1 more thread(s) and rank(s)" in text and "rank 0 on node-b, main thread" in text


def _explained(view: RunView) -> list[str]:
    text = _text(run_html(view, "n", "relay_demo"))
    return [term for term, line in GLOSSARY.items() if f"{term}: {line}" in text
            or f"{term} {line}" in text or f"{term.capitalize()}: {line}" in text]


def test_a_culprit_that_did_not_answer_is_said_so_above_the_first_stack_that_did() -> None:
    view = _view()
    fault = {**HANG, "evidence": {**HANG["evidence"], "stacks": HANG["evidence"]["stacks"][1:]}}
    view.attempts[0] = replace(view.attempts[0], fault=fault)
    text = _text(run_html(view, "n", "relay_demo"))
    assert "Culprit's stack" not in text
    assert "The culprit did not answer (stopped or frozen); the first stack that did: rank 0 " \
        "on node-b, main thread" in text


def test_every_figure_and_term_is_explained_beside_it() -> None:
    assert _explained(_view("running", None)) == list(GLOSSARY)
    assert _explained(_view()) == [t for t in GLOSSARY if t != "ETA"]  # ended: no ETA


def test_an_ended_run_shows_goodput_without_eta_and_does_not_reload() -> None:
    html = run_html(_view(), "n", "relay_demo")
    assert "<h2>Goodput</h2>" in html and "Goodput so far" not in html
    assert "ETA" not in _text(html).replace(GLOSSARY["ETA"], "")
    assert 'http-equiv="refresh"' not in html


def test_a_running_run_shows_its_eta_and_reloads() -> None:
    html = run_html(_view("running", None), "n", "relay_demo")
    assert "Goodput so far" in html and "ETA 42.0s" in _text(html)
    assert '<meta http-equiv="refresh" content="10">' in html


def test_the_attempts_table_says_who_adopted_whose_training_processes() -> None:
    attempts = _attempts()
    launcher, middle, last = attempts[1], attempts[2], attempts[3]
    assert adoption_note(attempts[0], attempts) == ""
    assert adoption_note(launcher, attempts) == (
        "handed over at step 60 to segment 1 try 1, which adopted its training processes: "
        "they went on training past this segment's end, to step 180")
    assert adoption_note(middle, attempts) == (
        "adopted at step 60: took over the training processes that segment 0 try 2 "
        "launched, without a restart; handed over at step 120 to segment 2 try 1, which "
        "adopted its training processes: they went on training past this segment's end")
    assert adoption_note(last, attempts) == (
        "adopted at step 120: took over the training processes that segment 0 try 2 "
        "launched, without a restart")
    # The launcher's row reads "reached 60" (where its segment ended), not the processes' 180.
    text = _text(run_html(_view(), "n", "relay_demo"))
    assert "[35, 60) completed" in text
    row = text[text.index("[35, 60) completed"):]
    assert re.match(r"\[35, 60\) completed \S+ \S+ UTC 4\.0s 60 handed over at step 60", row)


def test_an_attempt_whose_partners_are_unknown_still_reads() -> None:
    alone = replace(_attempts()[2], adopted_workload="/elsewhere")
    note = adoption_note(alone, [alone])
    assert "the training processes of an earlier segment" in note
    assert "handed over at step 120 to the next segment" in note
