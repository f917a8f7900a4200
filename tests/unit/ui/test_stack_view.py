"""The culprit's stack reads innermost first, the user's frames open and the rest folded."""

from __future__ import annotations

import pytest

from relay.ui.stack_view import FrameKind, frame_kind, relay_files, stacks_of, thread_stack

REPO = "/home/ci/relay"
VENV = f"{REPO}/.venv/lib/python3.11/site-packages"
STDLIB = "/root/.pyenv/versions/3.11.7/lib/python3.11"
# A stalled rank's main thread as evidence.py records it: outermost first, the node agent's
# and multiprocessing's frames above the user's loop, chaos's sleep under it.
CULPRIT_MAIN = [
    "<frozen runpy>:198 in _run_module_as_main",
    f"{REPO}/training/agent/node.py:291 in <module>: sys.exit(main())",
    f"{STDLIB}/multiprocessing/process.py:121 in start: self._popen = self._Popen(self)",
    f"{STDLIB}/multiprocessing/popen_fork.py:71 in _launch: code = process_obj._bootstrap()",
    f"{REPO}/training/worker.py:75 in run_rank: code = run_entrypoint(cfg.entrypoint)",
    f"{STDLIB}/runpy.py:229 in run_module: return _run_code(code, {{}}, init_globals)",
    f"{REPO}/training/examples/charlm.py:140 in main: train(session, model)",
    f"{REPO}/training/examples/charlm.py:121 in train: session.report(step, loss=loss.item())",
    f"{REPO}/training/api.py:300 in report: self._chaos.stall(step)",
    f"{REPO}/training/inject.py:50 in stall: time.sleep(seconds)",
]


@pytest.mark.parametrize(("file", "kind"), [
    (f"{REPO}/training/examples/charlm.py", FrameKind.USER),
    ("/home/me/project/train.py", FrameKind.USER),
    ("/home/me/training/train.py", FrameKind.USER),  # a folder named training is not Relay
    (f"{REPO}/training/agent/node.py", FrameKind.RELAY),
    (f"{REPO}/plugins/relay/recover/evidence.py", FrameKind.RELAY),
    (f"{VENV}/relay_train/api.py", FrameKind.RELAY),
    (f"{VENV}/relay_train/examples/charlm.py", FrameKind.USER),
    (f"{VENV}/torch/distributed/distributed_c10d.py", FrameKind.TORCH),
    (f"{VENV}/numpy/core/numeric.py", FrameKind.LIBRARY),
    (f"{STDLIB}/threading.py", FrameKind.STDLIB),
    ("/usr/lib/python3.11/multiprocessing/process.py", FrameKind.STDLIB),
    ("<frozen runpy>", FrameKind.STDLIB),
])
def test_each_frame_is_classified_by_its_file(file: str, kind: FrameKind) -> None:
    assert frame_kind(file) is kind


def test_relay_files_are_this_checkouts_modules_and_not_its_examples() -> None:
    files = relay_files()
    assert {"training/api.py", "relay_train/api.py", "relay/ui/stack_view.py"} <= files
    assert not any("examples/" in f or "baselines/" in f for f in files)


def test_the_culprits_innermost_user_frame_comes_first_and_the_rest_is_folded() -> None:
    stack = thread_stack("rank 1, main thread", CULPRIT_MAIN)
    assert [(f.function, f.line) for f in stack.shown] == [("train", 121), ("main", 140)]
    assert stack.shown[0].code == "session.report(step, loss=loss.item())"
    # Folded, innermost first: chaos's sleep in Relay, then its report, ... the runpy frame.
    assert [f.function for f in stack.folded][:2] == ["stall", "report"]
    assert stack.folded[-1].function == "_run_module_as_main"
    assert stack.folded_label == ("8 more frames: Relay 4, the standard library 4")
    assert stack.raw == []


def test_a_thread_without_user_frames_keeps_its_innermost_ones_open() -> None:
    lines = [line for line in CULPRIT_MAIN if "examples" not in line]
    stack = thread_stack("t", lines)
    assert [f.function for f in stack.shown] == ["stall", "report", "run_module"]
    assert len(stack.folded) == len(lines) - 3


def test_a_c_level_dump_is_read_innermost_first_as_faulthandler_writes_it() -> None:
    text = ["Current thread 0x00007f (most recent call first):",
            f'  File "{VENV}/torch/distributed/distributed_c10d.py", line 2800 in all_reduce',
            f'  File "{REPO}/training/examples/charlm.py", line 118 in train',
            f'  File "{REPO}/training/worker.py", line 75 in run_rank']
    stacks, text_only = stacks_of([{"rank": 1, "culprit": True, "faulthandler": text}])
    assert text_only is None
    (stack,) = stacks
    assert [f.function for f in stack.shown] == ["train"]
    assert [f.kind for f in stack.folded] == [FrameKind.TORCH, FrameKind.RELAY]
    assert stack.raw == [text[0]]
    assert "faulthandler" in stack.title and "the culprit" in stack.title


def test_the_culprits_threads_come_first_then_the_other_ranks() -> None:
    recorded = [
        {"rank": 0, "node": "node-a", "culprit": False, "threads": {"main": CULPRIT_MAIN[:3]}},
        {"rank": 1, "node": "node-b", "culprit": True,
         "threads": {"main": CULPRIT_MAIN, "evidence": CULPRIT_MAIN[:2]}},
    ]
    stacks, _ = stacks_of(recorded)
    assert [s.title for s in stacks] == ["rank 1 on node-b (the culprit), main thread",
                                         "rank 1 on node-b (the culprit), thread evidence",
                                         "rank 0 on node-a, main thread"]


@pytest.mark.parametrize("recorded", ["<script>a stack as text</script>", {"not": "a list"},
                                      [{"rank": 1, "threads": "not a dict"}], [1, 2]])
def test_a_record_of_another_shape_shows_as_its_text(recorded: object) -> None:
    stacks, text = stacks_of(recorded)
    assert stacks == [] and text is not None
    assert (text == recorded) if isinstance(recorded, str) else ("\n" in text or "[" in text)


def test_no_record_is_no_stack() -> None:
    assert stacks_of(None) == ([], None)
