"""Ranks other than 0 wait for rank 0's rendezvous store instead of torch's 1-s backoff."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from relay_train.rendezvous import wait_for_store


def _reserved_port() -> socket.socket:
    """A bound socket that does not listen yet: its port refuses connections."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def test_it_returns_once_the_store_listens() -> None:
    sock = _reserved_port()
    port = sock.getsockname()[1]
    listening: list[bool] = []

    def listen_later() -> None:
        time.sleep(0.3)
        sock.listen()
        listening.append(True)

    thread = threading.Thread(target=listen_later)
    started = time.monotonic()
    thread.start()
    try:
        assert wait_for_store("127.0.0.1", port, timeout_seconds=60)
        assert time.monotonic() - started >= 0.25  # it waited for the store to listen
    finally:
        thread.join()
        sock.close()
    assert listening


def test_it_gives_up_after_its_timeout_and_leaves_the_error_to_torch() -> None:
    sock = _reserved_port()
    try:
        started = time.monotonic()
        assert not wait_for_store("127.0.0.1", sock.getsockname()[1], timeout_seconds=0.3)
        assert time.monotonic() - started >= 0.25
    finally:
        sock.close()


def test_a_real_store_serves_its_clients_after_being_probed() -> None:
    """The probe connects and closes without a word; torch's store must shrug that off."""
    master = dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True,
                           timeout=timedelta(seconds=30), wait_for_workers=False)
    for _ in range(3):
        assert wait_for_store("127.0.0.1", master.port, timeout_seconds=30)
    client = dist.TCPStore("127.0.0.1", master.port, world_size=2, is_master=False,
                           timeout=timedelta(seconds=30))
    client.set("rank-1", "ready")
    assert master.get("rank-1") == b"ready"
    del client, master


def test_a_host_name_that_does_not_resolve_yet_is_asked_for_gently(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's pod not up yet: its Service name fails in DNS; no lookup every 10 ms."""
    lookups: list[float] = []

    def unresolved(address: tuple[str, int], timeout: float) -> socket.socket:
        lookups.append(time.monotonic())
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "create_connection", unresolved)
    assert not wait_for_store("relay-rank0.invalid", 29500, timeout_seconds=0.6)
    assert 1 <= len(lookups) <= 4  # every 0.25 s, not the 60 tries of a 10-ms probe
