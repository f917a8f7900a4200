"""What a node agent's channel costs a stranger, bounded; where a standby may go.

The channel's server (:mod:`relay_train.agent.server`) handles at most ``MAX_HANDLERS``
requests at once (the next is answered 503 at once, unread), closes a connection silent
for ``SOCKET_TIMEOUT_SECONDS``, hangs up on a request it has not read and authenticated
within ``READ_DEADLINE_SECONDS`` (a client trickling bytes), and reads a body only when
its ``Content-Length`` is a count of at most ``MAX_BODY_BYTES``. Stdlib only.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO

from relay_train.protocol.routes import MAX_BODY_BYTES

log = logging.getLogger("relay_train.agent.server")

SOCKET_TIMEOUT_SECONDS = 10.0  # a connection silent this long (reading or writing) is closed
READ_DEADLINE_SECONDS = 20.0  # a request not read and authenticated by then is hung up on
MAX_HANDLERS = 16  # requests handled at once; the next is answered 503 at once
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
         b"Connection: close\r\n\r\n")


class Deadline:
    """Hang up on a connection unless cancelled within ``seconds`` (a daemon timer)."""

    def __init__(self, connection: socket.socket, seconds: float | None = None) -> None:
        self.connection = connection
        self.timer = threading.Timer(READ_DEADLINE_SECONDS if seconds is None else seconds,
                                     self._hang_up)
        self.timer.daemon = True
        self.timer.start()

    def _hang_up(self) -> None:
        log.warning("channel: hung up on a request not read within its deadline")
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def cancel(self) -> None:
        """The request is read and authenticated: let it finish."""
        self.timer.cancel()


class Refused(Exception):
    """A request refused before any route saw it: its code and error."""

    def __init__(self, code: int, error: str) -> None:
        super().__init__(error)
        self.code = code
        self.error = error


def read_body(headers: Message, rfile: BinaryIO) -> bytes:
    """Read a request's body, bounded; raise :class:`Refused` for a bad length (unread)."""
    if headers.get("Transfer-Encoding"):
        raise Refused(411, "expected a Content-Length, found a Transfer-Encoding")
    raw = (headers.get("Content-Length") or "0").strip()
    if len(raw) > 20:  # no count of bytes, or far too many
        raise Refused(413, f"expected a body of at most {MAX_BODY_BYTES} bytes")
    if not raw.isdigit() or not raw.isascii():
        raise Refused(400, f"expected a Content-Length of 0 or more bytes, found {raw[:40]!r}")
    length = int(raw)
    if length > MAX_BODY_BYTES:
        raise Refused(413, f"expected a body of at most {MAX_BODY_BYTES} bytes, "
                            f"found {length}")
    body = rfile.read(length) if length else b""
    if len(body) != length:
        raise Refused(400, f"expected {length} bytes of body, found {len(body)}")
    return body


def bounded_seconds(value: object, name: str, most: float, *, positive: bool = False) -> float:
    """Return ``value`` as seconds in [0, ``most``] (above 0 if ``positive``); else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"standby: expected {name} in seconds, found {value!r}")
    seconds = float(value)
    if not (0.0 < seconds if positive else 0.0 <= seconds) or not seconds <= most:
        raise ValueError(f"standby: expected {name} between 0 and {most:g} seconds, "
                         f"found {seconds!r}")
    return seconds


def standby_home(root: Path) -> Path:
    """Return the folder a standby of the agent of attempt ``root`` may be forked into (or
    anywhere below): its DAG run's folder (``<dag>/<run>/segment-NNN/try-N``), else, for
    any other ``.../try-N``, the folder its tries share (where the launcher keeps the
    segment's standbys), else the attempt's own folder (a pod's fixed one)."""
    root = Path(os.path.realpath(root))
    parts = root.parts
    if len(parts) >= 5 and parts[-2].startswith("segment-") and parts[-1].startswith("try-"):
        return root.parents[1]
    if len(parts) >= 3 and parts[-1].startswith("try-"):
        return root.parent
    return root


class BoundedServer(ThreadingHTTPServer):
    """A threading HTTP server that handles at most ``MAX_HANDLERS`` requests at once."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 max_handlers: int = MAX_HANDLERS) -> None:
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(max_handlers)

    def process_request(self, request: Any, client_address: Any) -> None:  # noqa: ANN401
        if not self.slots.acquire(blocking=False):
            log.warning("channel: %d requests in hand; refusing one from %s", MAX_HANDLERS,
                        client_address)
            try:
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:  # noqa: ANN401
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()
