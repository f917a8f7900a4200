"""The local launcher's ports: where a rendezvous store and the agents' channels listen.

A port picked now and bound seconds later (by rank 0's TCPStore once its agent has
started and forked it; by an agent once it has preloaded torch) may be taken in
between. :func:`free_port` asks the kernel for one, and the kernel answers from its
ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by
default): where every outgoing TCP connection on the machine takes its local port
too. :func:`listen_ports` picks below that range instead, where only a process
that binds a port by number can take it, and falls back to :func:`free_port` when
the range cannot be read or leaves no room below it.
"""

from __future__ import annotations

import logging
import random
import socket
from pathlib import Path

log = logging.getLogger(__name__)

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Picked from [LISTEN_PORTS_FROM, the ephemeral range's low end): above the ports
# services are usually configured on, below the kernel's own picks.
LISTEN_PORTS_FROM = 20000
MIN_ROOM = 1000  # fewer ports than this below the range: pick as free_port() does
TRIES_PER_PORT = 20  # random picks found busy before giving up on the range


def free_port() -> int:
    """Return a free TCP port on loopback, from the kernel's ephemeral range."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int] | None:
    """Return the kernel's ephemeral port range (low, high), or None if it cannot be read."""
    try:
        low, high = (int(word) for word in path.read_text().split())
    except (OSError, ValueError) as exc:
        log.debug("Cannot read the ephemeral port range from %s: %s", path, exc)
        return None
    return (low, high) if 0 < low <= high <= 65535 else None


def bindable(port: int) -> bool:
    """Return whether ``port`` can be bound on every address now (nobody holds it)."""
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))  # noqa: S104 - a probe, closed at once
        except OSError:
            return False
    return True


def listen_ports(count: int) -> list[int]:
    """Return ``count`` distinct free ports for servers that bind them seconds from now
    (a rendezvous store, an agent's channel): below the ephemeral range if there is
    room there, else from :func:`free_port`."""
    found = ephemeral_range()
    if found is None or found[0] - LISTEN_PORTS_FROM < MIN_ROOM:
        log.debug("Listening ports from the kernel's ephemeral range: expected a readable "
                  "range in %s starting above %d, found %s", EPHEMERAL_RANGE_FILE,
                  LISTEN_PORTS_FROM + MIN_ROOM, found)
        return _free_ports(count)
    low = found[0]
    picked: list[int] = []
    for _ in range(TRIES_PER_PORT * count):
        port = random.randrange(LISTEN_PORTS_FROM, low)  # noqa: S311 - not a secret
        if port not in picked and bindable(port):
            picked.append(port)
            if len(picked) == count:
                return picked
    log.warning("Found only %d free port(s) of %d in [%d, %d): the rest from the ephemeral "
                "range", len(picked), count, LISTEN_PORTS_FROM, low)
    return picked + _free_ports(count - len(picked), set(picked))


def listen_port() -> int:
    """Return one free port for a server that binds it seconds from now (see listen_ports)."""
    return listen_ports(1)[0]


def _free_ports(count: int, taken: set[int] | None = None) -> list[int]:
    """Return ``count`` ports from :func:`free_port`, none twice and none in ``taken``."""
    seen = set(taken or ())
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in seen:
            seen.add(port)
            ports.append(port)
    return ports
