"""Loading dumps safely: only plain data, never code.

Dumps travel between machines, and plain ``pickle.load`` runs whatever a file asks it to. This
unpickler resolves no global at all, so a file can only produce dicts, lists, tuples, strings,
bytes, numbers, booleans and None; anything else is refused with :class:`UnsafeDumpError`.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tether._exceptions import UnsafeDumpError
from tether.events.layout import FILE_PREFIX, rank_of
from tether.events.ringfile import RINGS_DIR

__all__ = [
    "find_dump_files",
    "load_dump",
    "load_event",
    "load_trace",
    "loads_dump",
    "loads_trace",
    "resolve_dump_event",
    "resolve_event",
]

_MAX_BYTES = 1 << 31


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeDumpError(f"refusing to load {module}.{name}: a dump holds plain data only")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeDumpError("refusing a persistent reference: a dump holds plain data only")


def loads_dump(raw: bytes, *, source: str = "<bytes>") -> dict[str, Any]:
    """Parse a dump (pickle or JSON) from bytes."""
    data = _parse(raw, source)
    if not isinstance(data, dict) or "entries" not in data or "version" not in data:
        raise UnsafeDumpError(
            f"{source}: not a flight-recorder dump (expected a dict with 'version' and 'entries')"
        )
    return data


def loads_trace(raw: bytes, *, source: str = "<bytes>") -> dict[str, Any]:
    """Like :func:`loads_dump`, but also takes what other recorders write: torchcomms leaves
    ``entries`` out when it recorded nothing, and a JSON dump may start with any whitespace."""
    data = _parse(raw.lstrip() if raw[:1].isspace() else raw, source)
    if not isinstance(data, dict) or "version" not in data:
        raise UnsafeDumpError(f"{source}: not a flight-recorder dump (no 'version' key)")
    entries = data.setdefault("entries", [])
    if not isinstance(entries, list):
        raise UnsafeDumpError(f"{source}: 'entries' is a {type(entries).__name__}, not a list")
    return data


def load_trace(path: str | Path) -> dict[str, Any]:
    """Load one rank's dump file with :func:`loads_trace`."""
    return loads_trace(_read(Path(path)), source=str(path))


def _parse(raw: bytes, source: str) -> Any:
    if raw[:1] in (b"{", b" ", b"\n"):
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, deep nesting
            raise UnsafeDumpError(f"{source}: not valid JSON ({exc})") from exc
    else:
        try:
            data = _PlainDataUnpickler(io.BytesIO(raw)).load()
        except UnsafeDumpError as exc:
            raise UnsafeDumpError(f"{source}: {exc}") from exc
        except Exception as exc:  # truncated or corrupt pickles raise many types
            raise UnsafeDumpError(
                f"{source}: not a readable dump ({type(exc).__name__}: {exc}); "
                "the file is truncated or corrupt"
            ) from exc
    return data


def load_dump(path: str | Path) -> dict[str, Any]:
    """Load one rank's dump file."""
    path = Path(path)
    return loads_dump(_read(path), source=str(path))


def _read(path: Path) -> bytes:
    try:
        size = path.stat().st_size
        if size > _MAX_BYTES:
            raise UnsafeDumpError(f"{path}: {size} bytes is larger than any dump tether reads")
        return path.read_bytes()
    except OSError as exc:
        raise UnsafeDumpError(f"{path}: cannot read ({exc.strerror or exc})") from exc


def resolve_event(path: str | Path, event: str | None = None) -> Path:
    """``path`` is an event directory, or a dump directory holding events (the newest is taken,
    or the one named ``event``)."""
    return _resolve(Path(path), event, _rank_files, "no rank_<N> file")


def load_event(event_dir: str | Path) -> tuple[dict[int, dict[str, Any]], dict[str, str]]:
    """Every rank's dump in an event directory, by global rank, and the files that could not be
    loaded with the reason."""
    dumps: dict[int, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for rank, path in sorted(_rank_files(Path(event_dir)).items()):
        try:
            dumps[rank] = load_dump(path)
        except UnsafeDumpError as exc:
            errors[str(path)] = str(exc)
    return dumps, errors


def _rank_files(directory: Path) -> dict[int, Path]:
    out: dict[int, Path] = {}
    for p in directory.iterdir():
        rank = rank_of(p)
        if rank is not None and p.is_file():
            out[rank] = p
    return out


# torch names its files <prefix><global rank>: rank_3, comm_lib_trace_rank_3, torchcomm_fr_trace_3,
# some tools add an extension. Anything else in an event directory (stacks_3.txt, a half-written
# .rank_3.123.tmp) is not a rank's dump.
_DUMP_NAME = re.compile(r"^(?P<prefix>[^.].*?)(?P<rank>\d+)(?:\.(?:json|pkl|pickle|bin))?$")
_NOT_DUMPS = ("stacks_",)


def find_dump_files(directory: str | Path) -> dict[int, Path]:
    """Every rank's dump file in ``directory`` by global rank, whatever prefix torch or tether
    gave them. ``rank_<N>`` wins when present; otherwise the prefix most files share."""
    directory = Path(directory)
    by_prefix: dict[str, dict[int, Path]] = {}
    for p in directory.iterdir():
        m = _DUMP_NAME.match(p.name)
        if m is None or p.name.startswith(_NOT_DUMPS) or not p.is_file():
            continue
        by_prefix.setdefault(m["prefix"], {})[int(m["rank"])] = p
    if not by_prefix:
        return {}
    if FILE_PREFIX in by_prefix:
        return by_prefix[FILE_PREFIX]
    best = max(sorted(by_prefix), key=lambda k: len(by_prefix[k]))
    return by_prefix[best]


def resolve_dump_event(path: str | Path, event: str | None = None) -> Path:
    """Like :func:`resolve_event`, for dumps with any file prefix (torch's own recorder,
    torchcomms): ``path`` is an event directory, or a directory holding events."""
    path = Path(path)
    if path.name == RINGS_DIR:  # <host>-<pid> looks like <prefix><rank> to the pattern
        raise UnsafeDumpError(
            f"{path} holds the processes' ring files, not dumps: tether run turns a dead "
            "rank's ring file into its dump in the crash's event; analyze that event"
        )
    return _resolve(path, event, find_dump_files, "no dump file (<prefix><rank>)")


def _resolve(path: Path, event: str | None, files: Callable[[Path], Any], none: str) -> Path:
    if not path.is_dir():
        raise UnsafeDumpError(f"{path}: no such directory")
    if event is None and files(path):
        return path
    # Event ids start with a UTC timestamp, so name order is time order. A dot directory
    # (.rings, .stacks, .jobs) is tether's own bookkeeping, never an event.
    names = sorted(
        p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith(".") and files(p)
    )
    if event is not None:
        chosen = path / event
        if not chosen.is_dir():
            raise UnsafeDumpError(f"{path}: no event {event!r} (events: {names})")
        return chosen
    if not names:
        raise UnsafeDumpError(f"{path}: holds no dump event and {none}")
    return path / names[-1]
