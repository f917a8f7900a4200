"""Work beside running ranks yields to them: a thread's nice value, a session's weight."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relay_train.agent.priority import (
    NICE_INCREMENT,
    restore_session,
    session_nice,
    yield_session,
    yielding_thread,
)


def test_a_yielding_thread_lowers_only_its_own_priority() -> None:
    seen: list[int] = []
    main = os.getpriority(os.PRIO_PROCESS, 0)
    yielding_thread(lambda: seen.append(os.getpriority(os.PRIO_PROCESS, 0)), "t").join(10)
    assert seen == [min(main + NICE_INCREMENT, 19)]
    assert os.getpriority(os.PRIO_PROCESS, 0) == main  # the thread that forks keeps its own


def test_the_session_nice_value_is_read_from_the_autogroup_file(tmp_path: Path) -> None:
    autogroup = tmp_path / "autogroup"
    autogroup.write_text("/autogroup-2815 nice 5\n")
    assert session_nice(autogroup) == 5
    autogroup.write_text("garbage\n")
    assert session_nice(autogroup) is None
    assert session_nice(tmp_path / "missing") is None


def test_a_process_that_does_not_lead_its_session_leaves_the_session_alone(
        tmp_path: Path) -> None:
    autogroup = tmp_path / "autogroup"
    autogroup.write_text("/autogroup-1 nice 0\n")
    if os.getsid(0) == os.getpid():
        pytest.skip("this test process leads its own session")
    assert yield_session(path=autogroup) is None
    assert session_nice(autogroup) == 0


def _in_new_session(path: Path) -> None:
    """In a forked child: lead a new session, yield it, then check a grandchild's."""
    os.setsid()
    returned = yield_session()
    after = session_nice()
    grandchild = os.fork()
    if grandchild == 0:
        os.setsid()
        path.with_suffix(".grandchild").write_text(str(session_nice()))
        os._exit(0)
    os.waitpid(grandchild, 0)
    restored = restore_session(returned) if returned is not None else False
    path.write_text(f"{returned} {after} {restored} {session_nice()}")


@pytest.mark.skipif(session_nice() is None, reason="no autogroup scheduling on this kernel")
def test_a_session_leader_yields_its_session_and_a_new_session_starts_at_normal_weight(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    pid = os.fork()
    if pid == 0:
        try:
            _in_new_session(out)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    returned, after, restored, final = out.read_text().split()
    assert returned == "0" and after == "19"  # a new session starts at 0; yielded: 19
    assert out.with_suffix(".grandchild").read_text() == "0"
    if os.geteuid() == 0:  # raising a weight back needs the privilege
        assert restored == "True" and final == "0"


def test_restoring_a_sessions_weight_retries_the_kernels_rate_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CAP_SYS_ADMIN the kernel takes one autogroup change per 100 ms on the host
    (EAGAIN): a resident that gave up there would wait at the lowest weight."""
    import errno

    from relay_train.agent import priority
    path = tmp_path / "autogroup"
    refusals = [OSError(errno.EAGAIN, "rate limit"), OSError(errno.EAGAIN, "rate limit")]
    real_write = Path.write_text

    def write(self: Path, text: str, *args: object, **kwargs: object) -> int:
        if self == path and refusals:
            raise refusals.pop(0)
        return real_write(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write)
    monkeypatch.setattr(priority.time, "sleep", lambda _s: None)
    assert priority.restore_session(0, path)
    assert path.read_text() == "0"
    refusals.append(OSError(errno.EPERM, "not allowed"))
    assert not priority.restore_session(-5, path)  # anything else: no retry
