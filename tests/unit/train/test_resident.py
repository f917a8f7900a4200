"""Resident agents: the ask handshake, the idle exit, and a real resident forking a standby."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from residents import ResidentRun

from relay.core.proctree import group_members
from relay.launchers.local.launcher import LocalLauncher
from relay.launchers.local.warm_agents import live_resident, record, recorded_pid, release_run
from relay_train.agent import resident
from relay_train.agent.priority import session_nice
from relay_train.agent.resident import RESIDENT_DIR, Resident, ask_standby, asks_dir, ready_file


def _ready(directory: Path, node: str = "node-c") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    ready_file(directory, node).write_text(json.dumps({"pid": os.getpid()}))


def _answer(directory: Path, node: str, pid: int, delay: float = 0.0) -> threading.Thread:
    """Play the resident: take the first ask, then (after ``delay``) answer ``pid``."""

    def work() -> None:
        while True:
            asks = list(asks_dir(directory, node).glob("*.ask"))
            if asks:
                taken = asks[0].with_suffix(".taken")
                os.rename(asks[0], taken)
                time.sleep(delay)
                resident.write_atomically(asks[0].with_suffix(".pid"), json.dumps({"pid": pid}))
                return
            time.sleep(0.005)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def test_a_resident_not_ready_is_not_asked(tmp_path: Path) -> None:
    assert ask_standby(tmp_path, "node-c", tmp_path / "standby", 60, 0) is None
    assert not asks_dir(tmp_path, "node-c").exists()


def test_a_resident_still_preloading_is_asked_when_the_asker_waits_for_it(
        tmp_path: Path) -> None:
    _answer(tmp_path, "node-c", 4141, delay=0.3)  # answers once "preloaded"
    assert ask_standby(tmp_path, "node-c", tmp_path / "standby", 60, 0, wait_seconds=0.1,
                       preloading_wait_seconds=5) == 4141


def _autogroup_nice(pid: int) -> int | None:
    return session_nice(Path(f"/proc/{pid}/autogroup"))


def _until(condition: Callable[[], bool], what: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


needs_autogroup = pytest.mark.skipif(
    session_nice() is None or os.geteuid() != 0,
    reason="needs autogroup scheduling, and root to raise a session's weight")


@contextlib.contextmanager
def _forked_resident(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """Yield the PID of a forked session leader running a resident's preload, which lasts
    until ``tmp_path/go`` exists; the child stays until the block ends."""
    go, done = tmp_path / "go", tmp_path / "done"
    monkeypatch.setattr(resident, "_preload_stack", lambda: _until(go.exists, "go", 60))
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            Resident(tmp_path, "node-c").preload()
            _until(done.exists, "done", 60)
        finally:
            os._exit(0)
    try:
        _until(lambda: _autogroup_nice(pid) == 19, "the preloading resident did not yield")
        yield pid
    finally:
        go.touch()
        done.touch()
        os.waitpid(pid, 0)


@needs_autogroup
def test_a_resident_yields_while_preloading_until_asked_for_a_standby(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a forked session leader, a preload that lasts until the test says so."""
    with _forked_resident(tmp_path, monkeypatch) as pid:
        asks_dir(tmp_path, "node-c").mkdir(parents=True)
        (asks_dir(tmp_path, "node-c") / "x.ask").write_text("{}")
        # Back to a new session's weight (0), whatever this test process's session has.
        _until(lambda: _autogroup_nice(pid) == 0, "asked, the resident kept yielding")


@needs_autogroup
def test_a_preloaded_resident_waits_at_its_sessions_weight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never asked while preloading, it must not wait at the lowest weight: an ask
    would then be answered only when busy ranks leave it the CPU."""
    with _forked_resident(tmp_path, monkeypatch) as pid:
        (tmp_path / "go").touch()  # the preload ends, with no ask
        _until(lambda: _autogroup_nice(pid) == 0, "preloaded, the resident kept yielding")


def test_an_answered_ask_returns_the_forked_pid(tmp_path: Path) -> None:
    _ready(tmp_path)
    _answer(tmp_path, "node-c", 4242)
    assert ask_standby(tmp_path, "node-c", tmp_path / "standby", 60, 0, wait_seconds=60) == 4242
    assert list(asks_dir(tmp_path, "node-c").iterdir()) == []  # nothing left behind


def test_an_ask_names_the_node_its_standby_is_for(tmp_path: Path) -> None:
    """The local launcher's one resident per run forks the standbys of every node."""
    _ready(tmp_path)
    seen: list[dict[str, object]] = []

    def answer() -> None:
        while not (asks := list(asks_dir(tmp_path, "node-c").glob("*.ask"))):
            time.sleep(0.005)
        seen.append(json.loads(asks[0].read_text()))
        os.rename(asks[0], asks[0].with_suffix(".taken"))
        resident.write_atomically(asks[0].with_suffix(".pid"), json.dumps({"pid": 4545}))

    threading.Thread(target=answer, daemon=True).start()
    assert ask_standby(tmp_path, "node-c", tmp_path / "standby", 60, 0, wait_seconds=60,
                       for_node="node-d") == 4545
    assert seen[0]["node"] == "node-d"


def test_live_resident_prefers_the_nodes_own_and_skips_the_dead(tmp_path: Path) -> None:
    import subprocess
    import sys

    assert live_resident(tmp_path) is None
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record(tmp_path, "node-a", dead.pid)
    assert live_resident(tmp_path) is None, "a recorded resident that exited serves nobody"
    record(tmp_path, "node-c", os.getpid())
    record(tmp_path, "node-d", os.getpid())
    assert live_resident(tmp_path) == "node-c"
    assert live_resident(tmp_path, prefer="node-d") == "node-d"
    assert live_resident(tmp_path, prefer="node-e") == "node-c"


def test_an_unanswered_ask_is_withdrawn(tmp_path: Path) -> None:
    _ready(tmp_path)
    assert ask_standby(tmp_path, "node-c", tmp_path / "standby", 60, 0, wait_seconds=0.2) is None
    assert list(asks_dir(tmp_path, "node-c").iterdir()) == [], "a resident could still fork it"


def _take_on_ask(monkeypatch: pytest.MonkeyPatch, pid: int | None, delay: float) -> None:
    """Play a resident that takes each ask the instant it is written, and answers
    ``pid`` ``delay`` seconds later (never when ``pid`` is None): whatever the CI
    machine's load, the ask is taken before its asker's wait ends."""
    write = resident.write_atomically

    def write_and_take(path: Path, text: str) -> None:
        write(path, text)
        os.rename(path, path.with_suffix(".taken"))
        if pid is not None:
            reply = path.with_suffix(".pid")
            # atomically, as a resident answers: a bare write_text can be read half-written
            threading.Timer(delay, write, [reply, json.dumps({"pid": pid})]).start()

    monkeypatch.setattr(resident, "write_atomically", write_and_take)


def test_an_ask_taken_at_the_deadline_waits_for_its_pid(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Taken, then answered after the asker's wait: never a standby nobody recorded."""
    _ready(tmp_path)
    _take_on_ask(monkeypatch, 4343, delay=0.4)
    assert ask_standby(tmp_path, "node-c", tmp_path / "standby", 60, 0, wait_seconds=0.2) == 4343
    assert list(asks_dir(tmp_path, "node-c").iterdir()) == []


def test_an_ask_taken_and_never_answered_is_given_up_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resident killed between taking an ask and answering it must not hang the retry."""
    _ready(tmp_path)
    _take_on_ask(monkeypatch, None, delay=0)
    monkeypatch.setattr(resident, "TAKEN_WAIT_SECONDS", 0.3)
    assert ask_standby(tmp_path, "node-c", tmp_path / "standby", 60, 0, wait_seconds=0.1) is None
    assert list(asks_dir(tmp_path, "node-c").iterdir()) == []


def test_a_resident_leaves_once_its_run_writes_no_heartbeat(resident_run: ResidentRun) -> None:
    resident_run.ranks_beat_for(1.2)
    started = time.monotonic()
    assert resident_run.resident(idle_seconds=0.3).run() == 0
    assert time.monotonic() - started >= 1.2, "left while its run was still writing heartbeats"
    assert not resident_run.ready()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_real_resident_forks_standbys_and_leaves_with_its_run(tmp_path: Path) -> None:
    """A real resident process (it imports the training stack): prestart forks the
    standby from it, and the run's end stops it. Generous waits, no speed asserted."""
    launcher, run = LocalLauncher(), tmp_path / "run"
    standby_dir = run / "segment-000" / "standby"
    launcher.reside(run, ["node-c"])
    directory = run / RESIDENT_DIR
    resident_pid = recorded_pid(directory, "node-c")
    assert resident_pid is not None
    try:
        # The resident preloads the stack at the lowest priority: on a host loaded ~10x
        # that alone took over 2 minutes. A stuck preload still fails, after 10.
        deadline = time.monotonic() + 600
        while not ready_file(directory, "node-c").exists():
            assert time.monotonic() < deadline, (directory / "node-c.log").read_text()
            time.sleep(0.1)
        launcher.warm_standbys(standby_dir, ["node-c"], 60.0)
        standby_pid = recorded_pid(standby_dir, "node-c")
        assert standby_pid is not None and _parent(standby_pid) == resident_pid
        while not ready_file(standby_dir, "node-c").exists():
            assert time.monotonic() < deadline, (standby_dir / "node-c.log").read_text()
            time.sleep(0.05)
        assert group_members(standby_pid) == [standby_pid]  # a session of its own
        # Autogroup scheduling (sessions share the CPU first); root may raise a weight.
        if session_nice() is not None and os.geteuid() == 0:
            # preloaded: back to a new session's weight, to answer asks at once
            assert session_nice(Path(f"/proc/{resident_pid}/autogroup")) == 0
            assert session_nice(Path(f"/proc/{standby_pid}/autogroup")) == 0
        launcher.warm_standbys(run / "segment-001" / "standby", ["node-c"], 60.0)  # and again
        assert _parent(recorded_pid(run / "segment-001" / "standby", "node-c")) == resident_pid
        # A retry moving onto another node: the run's one resident forks its standby too
        # (the nodes share this host), and no second resident imports the stack again.
        launcher.reside(run, ["node-d"])
        assert recorded_pid(directory, "node-d") is None, "a second resident for the run"
        other = run / "segment-002" / "standby"
        launcher.warm_standbys(other, ["node-d"], 60.0)
        assert _parent(recorded_pid(other, "node-d")) == resident_pid
        while not ready_file(other, "node-d").exists():
            assert time.monotonic() < deadline, (other / "node-d.log").read_text()
            time.sleep(0.05)
    finally:
        for folder in (standby_dir, *(run / f"segment-00{i}" / "standby" for i in (1, 2))):
            launcher.release_standbys(folder)
        release_run(run)
    deadline = time.monotonic() + 30
    while group_members(resident_pid):
        assert time.monotonic() < deadline, "the resident outlived its run"
        time.sleep(0.1)
    assert not (directory / "node-c.standby").exists()


def test_the_end_of_a_run_stops_its_untaken_standbys(tmp_path: Path) -> None:
    """A spare warmed in a segment whose boundary came first is nobody's to take."""
    import subprocess
    import sys

    from relay.launchers.local.launcher import LocalLauncher

    standby_dir = tmp_path / "run" / "segment-000" / "standby"
    standby_dir.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            start_new_session=True)
    try:
        record(standby_dir, "node-c", proc.pid)
        LocalLauncher().continuity.end_run(tmp_path / "run", stop_workloads=False)
        assert proc.wait(30) is not None
        assert not (standby_dir / "node-c.standby").exists()
    finally:
        proc.kill()
        proc.wait()
