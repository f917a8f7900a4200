"""One signed request from Relay to a node agent (or an aggregator), and its fencing.

Every request is signed with the attempt's channel secret and names the attempt; a reply
is used only if the agent signed it back (:mod:`relay_train.protocol.channel_auth`). A
reply from an agent serving another attempt (409, or a body naming another attempt), or
an agent that refuses our credential (401), is refused: nothing in it is used, a warning
is logged and the refusal kept in :attr:`AgentRequests.refused`. The channel that polls
every agent is :class:`relay.launchers.agent_client.AgentChannel`.
"""

from __future__ import annotations

import http.client
import json
import logging
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import msgspec

from relay.core.exceptions import StaleAgentError
from relay_train.protocol.channel_auth import NONCE_HEADER, reply_is_signed, sign
from relay_train.protocol.routes import ATTEMPT, ERROR, HEARTBEATS, Route, route_path

log = logging.getLogger("relay.launchers.agent_client")  # the channel's log: one place to read

REQUEST_TIMEOUT_SECONDS = 2.0
_DECODE = msgspec.json.Decoder().decode


class AgentRequests:
    """Send one request to an agent of one attempt (the request half of
    :class:`~relay.launchers.agent_client.AgentChannel`, which sets these attributes)."""

    attempt_id: str
    _secret: str  # the attempt's channel secret: never logged
    addresses: dict[str, str]  # node -> its agent's URL
    aggregators: dict[str, str]  # aggregator name -> its URL
    tls: ssl.SSLContext | None
    tls_refused: set[str]  # nodes whose TLS handshake failed (warned once)
    refused: list[dict[str, Any]]

    def call(self, node: str, route: Route, *, body: dict[str, Any] | None = None,
             query: dict[str, Any] | None = None,
             timeout: float = REQUEST_TIMEOUT_SECONDS) -> dict[str, Any] | bytes | None:
        """Send one request to ``node``'s agent; return its reply, or None if it is unreachable.

        Raise :class:`StaleAgentError` (after recording the refusal) when the agent serves
        another attempt.
        """
        url = self.addresses.get(node) or self.aggregators.get(node)
        if url is None:
            return None
        params = {ATTEMPT: self.attempt_id, **(query or {})}
        data = None
        if body is not None:
            data = json.dumps({ATTEMPT: self.attempt_id, **body}).encode()
        method = "POST" if data is not None else "GET"
        target = f"{route_path(route)}?{urllib.parse.urlencode(params)}"
        signed = sign(self._secret, method, target, data or b"")
        request = urllib.request.Request(
            f"{url}{target}", data=data, method=method,
            headers={"Content-Type": "application/json", **signed})
        nonce = signed[NONCE_HEADER]
        try:
            with urllib.request.urlopen(request, timeout=timeout,  # noqa: S310 - our URL
                                        context=self.tls) as reply:
                raw = reply.read()
                kind = reply.headers.get("Content-Type", "")
                if not reply_is_signed(self._secret, nonce, reply.status, raw, reply.headers):
                    self._unsigned(node, route, reply.status)
                    return None
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            if exc.code == 401:
                self._refuse(node, str(route), None, {}, why="refused our credential")
            if not reply_is_signed(self._secret, nonce, exc.code, raw, exc.headers):
                self._unsigned(node, route, exc.code)
                return None
            payload = parse_answer(raw)
            if exc.code == 409:
                self._refuse(node, str(route), payload.get(ATTEMPT), payload)
            log.warning("Agent of %s answered %d to %s: %s", node, exc.code, route,
                        payload.get(ERROR, ""))
            return None
        # Refused, reset, timed out, or cut off mid-reply (an agent exiting as its ranks
        # stop: http.client.IncompleteRead is no OSError): unreachable for now.
        except (OSError, ValueError, http.client.HTTPException) as exc:
            tls_refused = isinstance(getattr(exc, "reason", exc), ssl.SSLError)
            if tls_refused and node not in self.tls_refused:  # not the network: trust (once)
                self.tls_refused.add(node)
                log.warning("TLS with the agent of %s refused (%s): %s. Check the channel CA "
                            "and the agents' certificate (docs/security.md)", node, route, exc)
            else:
                log.debug("Agent of %s unreachable (%s): %s", node, route, exc)
            return None
        if not kind.startswith("application/json"):
            return raw
        payload = parse_answer(raw)
        if payload.get(ATTEMPT) != self.attempt_id:
            self._refuse(node, str(route), payload.get(ATTEMPT), payload)
        return payload

    def _unsigned(self, node: str, route: Route, code: int) -> None:
        """Log a reply without the agent's signature (not used: not the agent's word)."""
        log.warning("A reply (%d) to %s at the address of %s's agent (%s) is not signed with "
                    "this attempt's channel secret: not used", code, route, node,
                    self.addresses.get(node))

    def _refuse(self, node: str, what: str, found: object, payload: dict[str, Any],
                why: str = "it speaks for another attempt") -> None:
        """Record a message from another attempt (or an agent that refused our credential);
        raise :class:`StaleAgentError`."""
        now = time.time()
        beats = payload.get(HEARTBEATS) or []
        for seen in self.refused:
            if (seen["node"], seen["found_attempt"], seen["what"]) == (node, found, what):
                seen["count"] += 1
                seen["last_at"] = now
                seen["heartbeats"] += len(beats)
                break
        else:
            self.refused.append({
                "node": node, "address": self.addresses.get(node), "what": what,
                "expected_attempt": self.attempt_id, "found_attempt": found, "at": now,
                "last_at": now, "count": 1, "heartbeats": len(beats),
                "steps": sorted({int(b.get("step", 0)) for b in beats}), "why": why,
            })
            log.warning("Refused %s from the agent of %s at %s: %s (attempt %r; this is %r): "
                        "a stale node, fenced", what, node, self.addresses.get(node), why,
                        found, self.attempt_id)
        raise StaleAgentError(f"{node}: attempt {found!r}, expected {self.attempt_id!r}")

    def ask(self, node: str, what: Route, **body: Any) -> dict[str, Any] | None:  # noqa: ANN401
        """POST a request (``stop``, ``drain``, ``rescue``, ``stacks``...); None if not heard."""
        try:
            reply = self.call(node, what, body=body)
        except StaleAgentError:
            return None
        return reply if isinstance(reply, dict) else None

    def call_quietly(self, node: str, what: Route, timeout: float,
                     **body: Any) -> dict[str, Any] | None:  # noqa: ANN401
        """POST ``what`` with a short ``timeout``; None if not heard (or a stale agent)."""
        try:
            reply = self.call(node, what, body=body, timeout=timeout)
        except StaleAgentError:
            return None
        return reply if isinstance(reply, dict) else None

    def fetch(self, node: str, what: Route, **query: Any) -> dict[str, Any] | bytes | None:  # noqa: ANN401
        """GET an answer (``rescue``, ``rescue/file``, ``stacks``); None if not heard."""
        try:
            return self.call(node, what, query=query)
        except StaleAgentError:
            return None


def parse_answer(raw: bytes) -> dict[str, Any]:
    """Return an agent's or aggregator's JSON answer as a dict ({} where it is none)."""
    try:  # msgspec (Airflow's) parses an aggregator's summary in a third of json's time
        payload = _DECODE(raw or b"{}")
    except msgspec.DecodeError:
        try:  # what msgspec refuses, e.g. a NaN loss, which Python's json writes and reads
            payload = json.loads(raw or b"{}")
        except ValueError:
            return {}
    return payload if isinstance(payload, dict) else {}
