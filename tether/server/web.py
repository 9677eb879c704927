"""The HTTP plumbing under the debug server: a bounded threading server and one request handler
that turns every request into a :class:`Request` for a route and every outcome into a reply.

Whatever a client sends, the training process must not notice: requests and bodies are bounded
(64 KiB), every socket operation times out, connections beyond a cap are dropped, a malformed
request gets a 4xx, and an error in a route is logged and answered with a 500.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from email.message import Message
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tether._log import get_logger
from tether.server.auth import Guard

__all__ = [
    "MAX_BODY",
    "App",
    "DebugHTTPServer",
    "Request",
    "Response",
    "Route",
    "error_response",
    "json_response",
]

logger = get_logger(__name__)

MAX_BODY = 64 * 1024
MAX_QUERY_FIELDS = 16
LINGER_S = 1.0
LINGER_BYTES = 1 << 20

_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    # Links carry ?token= when a token is needed: never pass them on to another site.
    "Referrer-Policy": "no-referrer",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    query: Mapping[str, list[str]]
    headers: Message
    body: bytes

    def param(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[0] if values else None


@dataclasses.dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    content_type: str
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)


Route = Callable[[Request], Response]


def json_response(data: Any, status: int = HTTPStatus.OK) -> Response:
    # Plain JSON: tuples become lists, None null, and NaN is refused rather than sent.
    body = json.dumps(data, allow_nan=False, separators=(",", ":")).encode()
    return Response(status, body, "application/json")


def error_response(
    status: int, message: str, *, headers: Mapping[str, str] | None = None, **extra: Any
) -> Response:
    response = json_response({"error": message, **extra}, status)
    return dataclasses.replace(response, headers=headers or {})


@dataclasses.dataclass(frozen=True, slots=True)
class App:
    """What a server answers: routes by path, then by method, behind a guard."""

    routes: Mapping[str, Mapping[str, Route]]
    guard: Guard

    def allowed(self, path: str) -> str:
        return ", ".join(sorted(self.routes.get(path, {})))


class DebugHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # closing must not wait for a client that stopped reading
    request_queue_size = 16

    def __init__(
        self,
        address: tuple[str, int],
        app: App,
        *,
        request_timeout: float,
        max_connections: int,
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.app = app
        self.request_timeout = request_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # One thread per connection, up to the cap; past it a connection is closed unanswered
        # rather than queued, so a flood of slow clients costs no more than the cap.
        if not self._slots.acquire(blocking=False):
            self.close_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def shutdown_request(self, request: Any) -> None:
        """Close after reading what the client still sends, within bounds (a "lingering close"):
        closing with unread input makes the kernel reset the connection, which can destroy the
        reply, a refusal such as 413 included, before the client reads it."""
        deadline = time.monotonic() + LINGER_S
        drained = 0
        try:
            request.shutdown(socket.SHUT_WR)
            while drained < LINGER_BYTES and (left := deadline - time.monotonic()) > 0:
                request.settimeout(left)
                chunk = request.recv(65536)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass  # reset, timed out: close anyway
        self.close_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hung up mid-reply, mostly; socketserver would print to stderr.
        logger.debug("debug server: connection from %s failed", client_address, exc_info=True)


class Handler(BaseHTTPRequestHandler):
    server: DebugHTTPServer
    server_version = "tether"
    sys_version = ""
    # Headers and body go out in two writes; with Nagle's algorithm the second waits for the
    # client's delayed ACK of the first: 40 ms a reply.
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.request_timeout)  # every read and write

    # http.server calls do_<METHOD>; every other method gets a 501, turned into a 405 below.
    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        if self.request_version == "HTTP/0.9":
            self.send_error(HTTPStatus.BAD_REQUEST, "the request line needs an HTTP version")
            return
        try:
            url = urlsplit(self.path)
            query = parse_qs(url.query, keep_blank_values=True, max_num_fields=MAX_QUERY_FIELDS)
        except ValueError as exc:
            self.send_error(HTTPStatus.BAD_REQUEST, f"bad request target: {exc}")
            return
        # Authorised first: a client without the token learns nothing, not even the routes.
        refusal = self.server.app.guard.check(self.command, self.headers, query)
        if refusal is not None:
            challenge = {"WWW-Authenticate": "Bearer"} if refusal.status == 401 else {}
            self._reply(error_response(refusal.status, refusal.message, headers=challenge))
            return
        methods = self.server.app.routes.get(url.path)
        if methods is None:
            self._reply(error_response(HTTPStatus.NOT_FOUND, "not found", endpoints=self._index()))
            return
        route = methods.get(self.command)
        if route is None:
            self.send_error(HTTPStatus.METHOD_NOT_ALLOWED)
            return
        body = self._read_body()
        if body is None:
            return
        try:
            response = route(Request(self.command, url.path, query, self.headers, body))
        except Exception:
            logger.exception("debug server: %s %s failed", self.command, url.path)
            response = error_response(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error")
        self._reply(response)

    def _read_body(self) -> bytes | None:
        """The request's body, or None once a refusal has been sent."""
        if self.headers.get("Transfer-Encoding") is not None:
            self.send_error(HTTPStatus.LENGTH_REQUIRED, "send a Content-Length, not chunks")
            return None
        length = (self.headers.get("Content-Length") or "0").strip()
        if not (length.isascii() and length.isdigit()):
            self.send_error(HTTPStatus.BAD_REQUEST, f"bad Content-Length {length!r}")
            return None
        if int(length) > MAX_BODY:
            self.send_error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"bodies are at most {MAX_BODY}")
            return None
        body = self.rfile.read(int(length))
        if len(body) < int(length):
            self.close_connection = True  # the client hung up: nobody to answer
            return None
        return body

    def _index(self) -> list[str]:
        routes = self.server.app.routes
        return sorted(f"{method} {path}" for path, methods in routes.items() for method in methods)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Every refusal, http.server's own included, as a JSON error. http.server answers an
        unknown method with 501 and HTTP/2 with 505: both are the client's mistake, so 4xx."""
        status = HTTPStatus({501: 405, 505: 400}.get(code, code))
        if self.request_version == "HTTP/0.9":
            # An HTTP/0.9 reply is a bare body: answer in 1.0 so the client sees the status.
            self.request_version = "HTTP/1.0"
        headers = {}
        if status == HTTPStatus.METHOD_NOT_ALLOWED:
            headers["Allow"] = self.server.app.allowed(_path_of(getattr(self, "path", "")))
        self.close_connection = True
        self._reply(error_response(status, message or status.phrase, headers=headers))

    def _reply(self, response: Response) -> None:
        self.send_response(response.status)
        headers = {
            **_HEADERS,
            "Content-Type": response.content_type,
            "Content-Length": str(len(response.body)),
            **response.headers,
        }
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)

    def log_message(self, format: str, *args: Any) -> None:
        # Not to stderr: that is the training job's log. The request line may carry the token.
        line = _TOKEN_IN_QUERY.sub(r"\1***", format % args)
        logger.debug("debug server: %s - %s", self.address_string(), line)


_TOKEN_IN_QUERY = re.compile(r"([?&]token=)[^&\s\"]*")


def _path_of(target: str) -> str:
    try:
        return urlsplit(target).path
    except ValueError:
        return ""
