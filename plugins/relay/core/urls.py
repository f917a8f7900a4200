"""URLs as Relay shows them: never with the credentials they may carry."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redact(url: str, *, keep_query: bool = False) -> str:
    """Return ``url`` without user, password, fragment and (unless kept) query: safe to log.

    A URL with none of them comes back unchanged (``sqlite:////abs/mlflow.db`` too).
    """
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<unreadable URL>"
    if "@" not in parts.netloc and not parts.fragment and (keep_query or not parts.query):
        return url
    query = ("?" + parts.query if keep_query else "?...") if parts.query else ""
    return urlunsplit((parts.scheme, f"{host}{port}", parts.path, "", "")) + query
