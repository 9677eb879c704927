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

__all__ = ["load_dump", "loads_dump"]

_MAX_BYTES = 1 << 31


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeDumpError(
            f"refusing to load {module}.{name}: a dump holds plain data only"
        )

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
