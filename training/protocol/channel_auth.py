"""The channel's credential: every request signed with the attempt's secret, every reply too.

Relay makes a fresh random secret for each attempt (:func:`new_secret`) and gives it to
that attempt's agents only (the launch file's ``channel_secret``, written 0600; or the
environment variable :data:`relay_train.protocol.env.ENV_CHANNEL_SECRET`, which wins when set).
A request carries three headers:

- :data:`TIME_HEADER`: the sender's wall clock (seconds);
- :data:`NONCE_HEADER`: a random value, new for every request;
- :data:`SIGNATURE_HEADER`: HMAC-SHA256, keyed by the secret, over the method, the
  request target (path and query), the time, the nonce and the body's sha256.

The agent (:class:`Verifier`) checks the signature in constant time, refuses a time more
than :data:`REPLAY_WINDOW_SECONDS` from its own clock either way (wide: node clocks are
off by tens of seconds, and a skewed clock must never look like a stranger), and refuses a
nonce it has seen inside that window (a bounded cache; when it overflows, everything no
newer than what it forgot is refused, so nothing can be replayed). A refused request gets
401 and a body that names nothing.

A reply the agent sends to a verified request carries :data:`REPLY_HEADER`: HMAC over the
request's nonce, the status code and the reply body's sha256. Relay uses no reply without
it, so whatever answers at an agent's address without the secret (an agent of another
attempt, a stranger on a reused address) is never taken for the agent.

TLS is a separate layer: these headers ride inside it unchanged. Stdlib only.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping

SECRET_BYTES = 32
TIME_HEADER = "X-Relay-Time"
NONCE_HEADER = "X-Relay-Nonce"
SIGNATURE_HEADER = "X-Relay-Signature"
REPLY_HEADER = "X-Relay-Reply"
REPLAY_WINDOW_SECONDS = 600.0  # either way: far wider than any clock skew Relay tolerates
NONCES_KEPT = 16384  # seen nonces remembered (a few requests a second per client, ten minutes)
MAX_NONCE_CHARS = 64
UNAUTHORIZED = "unauthorized"  # the whole error a refused request is told

_REQUEST_TAG = b"relay-channel-request-v1"
_REPLY_TAG = b"relay-channel-reply-v1"


def new_secret() -> str:
    """Return a fresh random secret for one attempt's channel (hex)."""
    return secrets.token_hex(SECRET_BYTES)


def _key(secret: str) -> bytes:
    return secret.encode("utf-8")


def request_signature(secret: str, method: str, target: str, at: str, nonce: str,
                      body: bytes) -> str:
    """Return the signature of one request (hex)."""
    message = b"\n".join([_REQUEST_TAG, method.upper().encode(), target.encode("utf-8"),
                          at.encode(), nonce.encode(), hashlib.sha256(body).hexdigest().encode()])
    return hmac.new(_key(secret), message, hashlib.sha256).hexdigest()


def reply_signature(secret: str, nonce: str, code: int, body: bytes) -> str:
    """Return the signature of the reply to the request that carried ``nonce`` (hex)."""
    message = b"\n".join([_REPLY_TAG, nonce.encode(), str(int(code)).encode(),
                          hashlib.sha256(body).hexdigest().encode()])
    return hmac.new(_key(secret), message, hashlib.sha256).hexdigest()


def sign(secret: str, method: str, target: str, body: bytes = b"",
         now: float | None = None) -> dict[str, str]:
    """Return the headers that authenticate one request (Relay's side)."""
    at = repr(time.time() if now is None else now)
    nonce = secrets.token_hex(16)
    return {TIME_HEADER: at, NONCE_HEADER: nonce,
            SIGNATURE_HEADER: request_signature(secret, method, target, at, nonce, body)}


def reply_is_signed(secret: str, nonce: str, code: int, body: bytes,
                    headers: Mapping[str, str] | None) -> bool:
    """Return whether a reply carries the agent's signature for our request (constant time)."""
    found = (headers or {}).get(REPLY_HEADER) or ""
    return hmac.compare_digest(found.encode("ascii", "replace"),
                               reply_signature(secret, nonce, code, body).encode())


class Verifier:
    """The agent's side: check requests' signatures, times and nonces (thread-safe)."""

    def __init__(self, secret: str, window_seconds: float = REPLAY_WINDOW_SECONDS,
                 kept: int = NONCES_KEPT) -> None:
        if not secret:
            raise ValueError("a channel verifier needs a non-empty secret")
        self.secret = secret
        self.window = window_seconds
        self.kept = kept
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> its request's time
        self._floor = float("-inf")  # requests no newer than a forgotten nonce are refused
        self._lock = threading.Lock()

    def verify(self, method: str, target: str, headers: Mapping[str, str], body: bytes,
               now: float | None = None) -> str | None:
        """Return the request's nonce if it is authentic and fresh, else None (no effect)."""
        at = headers.get(TIME_HEADER) or ""
        nonce = headers.get(NONCE_HEADER) or ""
        found = headers.get(SIGNATURE_HEADER) or ""
        if not at or not nonce or len(nonce) > MAX_NONCE_CHARS or len(at) > 32:
            return None
        expected = request_signature(self.secret, method, target, at, nonce, body)
        if not hmac.compare_digest(found.encode("ascii", "replace"), expected.encode()):
            return None
        try:
            sent = float(at)
        except ValueError:
            return None
        now = time.time() if now is None else now
        if not abs(now - sent) <= self.window:  # also refuses NaN
            return None
        with self._lock:
            self._forget(now)
            if nonce in self._seen or sent <= self._floor:
                return None
            self._seen[nonce] = sent
        return nonce

    def _forget(self, now: float) -> None:
        """Drop nonces too old to be accepted again; past the bound, the oldest (raising
        the floor, so that none of them can come back)."""
        while self._seen:
            nonce, sent = next(iter(self._seen.items()))
            if sent < now - self.window:
                del self._seen[nonce]
            elif len(self._seen) >= self.kept:
                del self._seen[nonce]
                self._floor = max(self._floor, sent)
            else:
                break
