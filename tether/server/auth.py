"""Who may talk to a debug server.

A server on loopback (127.0.0.1, localhost, ::1) answers any local process, as a shell on that
host could read the same state with py-spy. Anywhere else it answers only requests carrying the
job's token (``Authorization: Bearer <token>``, or ``?token=`` for a browser's links). Every rank
gets the same token through the job's store, so rank 0 can call the others and hand the token to
its page.

Two browser attacks are refused even without a token: a page of another site posting to
``/dump`` (cross-origin ``Origin``), and a rebound DNS name pointing at a loopback server (a
``Host`` that is not a loopback name).
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import secrets
from collections.abc import Mapping
from email.message import Message
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

__all__ = ["TOKEN_KEY", "Guard", "Refusal", "is_loopback", "job_token", "needs_token"]

TOKEN_KEY = "tether/debug_token"

_TRUSTED_BINDS = frozenset({"127.0.0.1", "localhost", "::1"})


def needs_token(bind_host: str) -> bool:
    """Whether a server bound to ``bind_host`` must ask for the token: anything but the usual
    loopback names does, other 127.x addresses included (so tests can exercise the token)."""
    return bind_host not in _TRUSTED_BINDS


def is_loopback(hostname: str) -> bool:
    if hostname.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(hostname).is_loopback
    except ValueError:
        return False


def job_token(store: Any) -> str:
    """The job's token: the first rank to ask proposes one; every rank gets that one."""
    got = store.compare_set(TOKEN_KEY, "", secrets.token_urlsafe(32))
    return got.decode() if isinstance(got, bytes) else str(got)


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    status: HTTPStatus
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class Guard:
    token: str | None
    """Required from every request when set; None for a loopback server."""

    def check(
        self, method: str, headers: Message, query: Mapping[str, list[str]]
    ) -> Refusal | None:
        """Why this request is refused, or None to let it through."""
        host = headers.get("Host")
        if self.token is None:
            if host is not None and not is_loopback(_hostname(host)):
                return Refusal(HTTPStatus.FORBIDDEN, f"Host {host!r} is not a loopback name")
        elif not hmac.compare_digest(_presented(headers, query).encode(), self.token.encode()):
            return Refusal(
                HTTPStatus.UNAUTHORIZED,
                "this server needs the job's token: 'Authorization: Bearer <token>' or ?token=",
            )
        origin = headers.get("Origin")
        if method != "GET" and origin is not None and _netloc(origin) != host:
            return Refusal(HTTPStatus.FORBIDDEN, f"cross-origin {method} from {origin!r}")
        return None


def _presented(headers: Message, query: Mapping[str, list[str]]) -> str:
    scheme, _, value = (headers.get("Authorization") or "").partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    return (query.get("token") or [""])[0]


def _hostname(host: str) -> str:
    """``Host`` without its port: ``[::1]:80`` -> ``::1``, ``localhost:80`` -> ``localhost``."""
    try:
        return urlsplit(f"//{host}").hostname or ""
    except ValueError:  # an unbalanced bracket
        return ""


def _netloc(origin: str) -> str:
    try:
        return urlsplit(origin).netloc
    except ValueError:
        return ""
