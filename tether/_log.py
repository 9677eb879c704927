"""Logging with rank context: every tether record says which rank wrote it and on which host
(``[rank 3 on node1]``: a job on many nodes has many rank 0s of its local groups, and one log
collector for all), and reaches stderr in one piece.

Ranks of a job usually share one stderr (torchrun's, a terminal, a pipe to a log collector). A
line written in several ``write`` calls (``print`` writes the text, then the newline; an
unbuffered stderr passes each on at once) can be cut by another rank's line. So each record, and
each of tether's own user-facing lines (:func:`say`), goes out in a single ``os.write``, which a
pipe keeps whole up to ``PIPE_BUF`` (4 KiB on Linux) and a terminal or file in practice.

Until the application configures logging (any handler a record of tether's reaches: on the
root logger, on ``tether``, on one of tether's modules), tether's records at WARNING and above go
to stderr, as Python's last-resort handler would send them; once it has, they go to its handlers
only, as usual.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from typing import TextIO

__all__ = ["get_logger", "say", "set_rank"]

_rank: str = "?"
_HOST = socket.gethostname()


def set_rank(rank: int) -> None:
    global _rank
    _rank = str(rank)


class _RankAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    def process(self, msg: object, kwargs: object) -> tuple[str, object]:  # type: ignore[override]
        return f"[rank {_rank} on {_HOST}] {msg}", kwargs


def get_logger(name: str) -> logging.LoggerAdapter:  # type: ignore[type-arg]
    return _RankAdapter(logging.getLogger(name), {})


def say(line: str, stream: TextIO | None = None) -> None:
    """Write ``line`` and a newline to ``stream`` (stderr by default) in one write. Never raises:
    a stderr that is gone (a closed pipe, a closed file) must not stop what comes after the
    line (a hung rank's abort)."""
    try:
        write_whole(line + "\n", sys.stderr if stream is None else stream)
    except (OSError, ValueError):
        if stream is None:  # sys.stderr's object failed (closed, replaced): its descriptor may not
            with contextlib.suppress(OSError):
                os.write(2, (line + "\n").encode(errors="backslashreplace"))


def write_whole(text: str, stream: TextIO) -> None:
    """``text`` in one ``os.write`` to ``stream``'s file descriptor, after what the stream still
    buffers; to a stream without one (pytest's capture, a StringIO) in one ``write``."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        stream.write(text)
        stream.flush()
        return
    stream.flush()  # what was written through the stream before comes first
    data = text.encode(stream.encoding or "utf-8", errors="backslashreplace")
    while data:  # one call unless interrupted or the reader is slow: then the rest follows
        data = data[os.write(fd, data) :]


class _WholeLineHandler(logging.Handler):
    """Python's last-resort handler (stderr, WARNING, the bare message), writing each record in
    one piece, and only while the application has not configured logging."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def handle(self, record: logging.LogRecord) -> bool:
        if logging.lastResort is None or self._others_take(record):
            return False  # the application's handlers take it (or it silenced the last resort)
        return bool(super().handle(record))

    def _others_take(self, record: logging.LogRecord) -> bool:
        """Whether the record reaches a handler besides this one, as ``Logger.callHandlers``
        walks the loggers: from the record's up, until one does not propagate."""
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return True
            if not logger.propagate:
                return False
            logger = logger.parent
        return False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            write_whole(self.format(record) + "\n", sys.stderr)
        except Exception:
            self.handleError(record)


def _install() -> None:
    tether = logging.getLogger("tether")
    if not any(isinstance(h, _WholeLineHandler) for h in tether.handlers):  # module reloaded
        tether.addHandler(_WholeLineHandler())


_install()
