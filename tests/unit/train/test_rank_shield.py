"""Shielded ranks (``$RELAY_SHIELD_RANKS``, set by the Slurm launcher): Slurm's SIGTERM
reaches every process of a step; the ranks leave it to their agent, which ends them with
SIGUSR1."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from relay_train.agent.ranks import end_signal, stop_ranks, take_rank_signals
from relay_train.protocol.env import ENV_SHIELD_RANKS


def _rank(ready: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    take_rank_signals()
    ready.set()
    time.sleep(60)


def _started(shielded: bool, monkeypatch: pytest.MonkeyPatch) -> multiprocessing.Process:
    if shielded:
        monkeypatch.setenv(ENV_SHIELD_RANKS, "1")
    else:
        monkeypatch.delenv(ENV_SHIELD_RANKS, raising=False)
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    proc = context.Process(target=_rank, args=(ready,))
    proc.start()
    assert ready.wait(30), "the rank did not start"
    return proc


def test_a_shielded_rank_outlives_the_platforms_sigterm_and_ends_on_its_agents_signal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    proc = _started(True, monkeypatch)
    try:
        assert end_signal() == signal.SIGUSR1
        os.kill(proc.pid, signal.SIGTERM)  # as `scancel --signal=TERM` sends it
        proc.join(0.5)
        assert proc.exitcode is None, "a shielded rank died of the platform's SIGTERM"
        stop_ranks([proc], "test", grace_seconds=30.0)
        assert proc.exitcode == -signal.SIGUSR1  # the agent's end, not the grace's SIGKILL
    finally:
        proc.kill()
        proc.join()


def test_an_unshielded_rank_ends_on_sigterm(monkeypatch: pytest.MonkeyPatch) -> None:
    proc = _started(False, monkeypatch)
    try:
        assert end_signal() == signal.SIGTERM
        stop_ranks([proc], "test", grace_seconds=30.0)
        assert proc.exitcode == -signal.SIGTERM
    finally:
        proc.kill()
        proc.join()
