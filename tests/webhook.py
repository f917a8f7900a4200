"""A local webhook for escalation tests: records each POST (body and headers)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any


class LocalWebhook:
    """Listen on 127.0.0.1; answer each POST with the next of ``statuses``, then 204."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.statuses: list[int] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.received.append(json.loads(body))
                hook.headers.append(dict(self.headers))
                self.send_response(hook.statuses.pop(0) if hook.statuses else 204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, userinfo: str = "") -> str:
        """Return the hook's URL (``userinfo``: e.g. ``user:password@``)."""
        return f"http://{userinfo}127.0.0.1:{self.port}/hook"

    def close(self) -> None:
        """Stop listening."""
        self.server.shutdown()
        self.server.server_close()
