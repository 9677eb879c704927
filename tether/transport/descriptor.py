"""Descriptors: what one process hands another so it can reach a registered buffer.

A descriptor is a versioned JSON envelope, ``{"version": 1, "backend": NAME, "fields": {...}}``,
with bytes as base64 — the same shape as torch 2.15's ``RemoteBuffer.serialize()``. Never pickle:
a descriptor comes from another process and may be hostile, so decoding only ever builds plain
values, and every field is checked against a schema (unknown, missing or duplicate fields, a wrong
type, version or backend are all rejected with :class:`DescriptorError`).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any

from tether._exceptions import DescriptorError

__all__ = ["VERSION", "FieldValue", "decode", "encode"]

VERSION = 1
MAX_BYTES = 64 * 1024
"""A descriptor is a few hundred bytes; anything this large is not one."""

FieldValue = int | str | bytes
_U64 = 1 << 64


def encode(backend: str, fields: Mapping[str, FieldValue]) -> bytes:
    out: dict[str, int | str] = {}
    for name, value in fields.items():
        out[name] = base64.b64encode(value).decode() if isinstance(value, bytes) else value
    envelope = {"version": VERSION, "backend": backend, "fields": out}
    return json.dumps(envelope, separators=(",", ":"), sort_keys=True).encode()


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DescriptorError(f"descriptor has the field {key!r} twice")
        out[key] = value
    return out


def decode(
    data: bytes | str, schema: Mapping[str, type], *, backend: str | None = None
) -> tuple[str, dict[str, FieldValue]]:
    """Checks ``data`` against ``schema`` (field name -> int, str or bytes); returns the backend
    name and the fields. ``backend``: the backend it must be for (None: any; the caller then
    checks the name before trusting the schema it passed)."""
    if isinstance(data, str):
        data = data.encode()
    if not isinstance(data, bytes | bytearray | memoryview):
        raise DescriptorError(f"a descriptor is bytes or str, not {type(data).__name__}")
    if len(data) > MAX_BYTES:
        raise DescriptorError(f"descriptor of {len(data)} bytes is too large to be one")
    try:
        envelope = json.loads(bytes(data), object_pairs_hook=_no_duplicates)
    except DescriptorError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # deep nesting: Recursion
        raise DescriptorError(f"descriptor is not valid JSON (truncated?): {exc}") from exc
    if not isinstance(envelope, dict) or set(envelope) != {"version", "backend", "fields"}:
        raise DescriptorError("descriptor must be an object with exactly version, backend, fields")
    if envelope["version"] != VERSION or type(envelope["version"]) is not int:
        raise DescriptorError(
            f"descriptor version {envelope['version']!r} is not supported (this tether reads "
            f"version {VERSION}); upgrade the older side"
        )
    name = envelope["backend"]
    if not isinstance(name, str):
        raise DescriptorError("descriptor backend must be a string")
    if backend is not None and name != backend:
        raise DescriptorError(f"descriptor is for backend {name!r}, not {backend!r}")
    raw = envelope["fields"]
    if not isinstance(raw, dict):
        raise DescriptorError("descriptor fields must be an object")
    if set(raw) != set(schema):
        missing, unknown = set(schema) - set(raw), set(raw) - set(schema)
        raise DescriptorError(
            f"descriptor fields do not match backend {name!r}: "
            f"missing {sorted(missing)}, unknown {sorted(unknown)}"
        )
    fields: dict[str, FieldValue] = {}
    for field, kind in schema.items():
        value = raw[field]
        if kind is int:
            # bool is an int in Python; a descriptor saying `true` for a size is malformed.
            if type(value) is not int or not 0 <= value < _U64:
                raise DescriptorError(f"descriptor field {field!r} must be an unsigned 64-bit int")
            fields[field] = value
        elif kind is str:
            if not isinstance(value, str) or len(value) > 4096:
                raise DescriptorError(f"descriptor field {field!r} must be a short string")
            fields[field] = value
        else:
            if not isinstance(value, str):
                raise DescriptorError(f"descriptor field {field!r} must be base64 text")
            try:
                fields[field] = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise DescriptorError(f"descriptor field {field!r} is not base64") from exc
    return name, fields
