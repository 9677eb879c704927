"""Loading dumps safely: only plain data, never code.

Dumps travel between machines, and plain ``pickle.load`` runs whatever a file asks it to. This
unpickler resolves no global at all, so a file can only produce dicts, lists, tuples, strings,
bytes, numbers, booleans and None; anything else is refused with :class:`UnsafeDumpError`.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any

from tether._exceptions import UnsafeDumpError

__all__ = ["load_dump", "load_event", "loads_dump", "resolve_event"]

_MAX_BYTES = 1 << 31


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeDumpError(f"refusing to load {module}.{name}: a dump holds plain data only")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeDumpError("refusing a persistent reference: a dump holds plain data only")


def loads_dump(raw: bytes, *, source: str = "<bytes>") -> dict[str, Any]:
    """Parse a dump (pickle or JSON) from bytes."""
    if raw[:1] in (b"{", b" ", b"\n"):
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
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
    if not isinstance(data, dict) or "entries" not in data or "version" not in data:
        raise UnsafeDumpError(
            f"{source}: not a flight-recorder dump (expected a dict with 'version' and 'entries')"
        )
    return data


def load_dump(path: str | Path) -> dict[str, Any]:
    """Load one rank's dump file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > _MAX_BYTES:
            raise UnsafeDumpError(f"{path}: {size} bytes is larger than any dump tether reads")
        raw = path.read_bytes()
    except OSError as exc:
        raise UnsafeDumpError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    return loads_dump(raw, source=str(path))


def resolve_event(path: str | Path, event: str | None = None) -> Path:
    """``path`` is an event directory, or a dump directory holding events (the newest is taken,
    or the one named ``event``)."""
    path = Path(path)
    if not path.is_dir():
        raise UnsafeDumpError(f"{path}: no such directory")
    if event is not None:
        chosen = path / event
        if not chosen.is_dir():
            raise UnsafeDumpError(f"{path}: no event {event!r} (events: {_event_names(path)})")
        return chosen
    if _rank_files(path):
        return path
    names = _event_names(path)
    if not names:
        raise UnsafeDumpError(f"{path}: holds no dump event and no rank_<N> file")
    return path / names[-1]


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
    from tether.recorder.dump import FILE_PREFIX

    out: dict[int, Path] = {}
    for p in directory.iterdir():
        suffix = p.name[len(FILE_PREFIX) :]
        if p.name.startswith(FILE_PREFIX) and suffix.isdigit() and p.is_file():
            out[int(suffix)] = p
    return out


def _event_names(directory: Path) -> list[str]:
    # Event ids start with a UTC timestamp, so name order is time order.
    return sorted(p.name for p in directory.iterdir() if p.is_dir() and _rank_files(p))
