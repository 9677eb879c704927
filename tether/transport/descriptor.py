"""Descriptors: what one process hands another so that it can reach a registered buffer.

torch 2.15's wire format and rules: a JSON envelope ``{"version": 1, "backend": NAME,
"fields": {...}}``, bytes as base64, each backend declaring its fields and their types. Never
pickle: a descriptor comes from another process and may be hostile, so decoding builds plain
values only, and every field is checked (unknown, missing or duplicate fields, a wrong type,
version or backend, a negative int or a bool where an int belongs: :class:`DescriptorError`, a
``ValueError``; input that is not bytes: ``TypeError``). tether also bounds what torch leaves
open: ints fit 64 bits, strings 4096 characters, a descriptor 64 KiB.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from tether._exceptions import DescriptorError

__all__ = ["MAX_BYTES", "VERSION", "FieldValue", "WireDescriptor", "decode", "encode"]

VERSION = 1
MAX_BYTES = 64 * 1024
"""A descriptor is a few hundred bytes; anything this large is not one."""
_MAX_STR = 4096
_U64 = 1 << 64

FieldValue = int | str | bytes


def _check(fields: Mapping[str, Any], schema: Mapping[str, type]) -> None:
    if set(fields) != set(schema):
        missing, unknown = sorted(set(schema) - set(fields)), sorted(set(fields) - set(schema))
        raise DescriptorError(f"invalid descriptor fields: missing {missing}, unknown {unknown}")
    for name, kind in schema.items():
        value = fields[name]
        # type() and not isinstance(): a bool is an int in Python, never in a descriptor.
        if type(value) is not kind:
            raise DescriptorError(f"invalid descriptor field {name!r}: not {kind.__name__}")
        if isinstance(value, int) and not 0 <= value < _U64:
            raise DescriptorError(f"invalid descriptor field {name!r}: not an unsigned 64-bit int")
        if isinstance(value, str) and len(value) > _MAX_STR:
            raise DescriptorError(f"invalid descriptor field {name!r}: over {_MAX_STR} characters")


def encode(backend: str, fields: Mapping[str, FieldValue], schema: Mapping[str, type]) -> bytes:
    """The descriptor of ``fields`` (checked against ``schema``, as ``decode`` will)."""
    _check(fields, schema)
    wire = {
        name: base64.b64encode(value).decode("ascii") if type(value) is bytes else value
        for name, value in fields.items()
    }
    envelope = {"version": VERSION, "backend": backend, "fields": wire}
    return json.dumps(
        envelope, separators=(",", ":"), sort_keys=True, ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DescriptorError(f"duplicate descriptor field {key!r}")
        out[key] = value
    return out


def decode(
    data: bytes, schema_of: Callable[[str], Mapping[str, type]]
) -> tuple[str, dict[str, FieldValue]]:
    """The backend's name and the fields of descriptor ``data``. ``schema_of(name)`` gives the
    fields a descriptor of that backend has, or raises DescriptorError for a backend the caller
    does not take."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"serialized descriptor must be bytes, not {type(data).__name__}")
    if len(data) > MAX_BYTES:
        raise DescriptorError(f"descriptor of {len(data)} bytes is too large to be one")
    try:
        envelope = json.loads(bytes(data).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeError, ValueError, RecursionError) as exc:  # deep nesting: RecursionError
        if isinstance(exc, DescriptorError):
            raise
        raise DescriptorError(f"malformed descriptor (not JSON, or truncated): {exc}") from exc
    if type(envelope) is not dict or set(envelope) != {"version", "backend", "fields"}:
        raise DescriptorError("invalid descriptor envelope: want version, backend, fields")
    if type(envelope["version"]) is not int or envelope["version"] != VERSION:
        raise DescriptorError(
            f"unsupported descriptor version {envelope['version']!r} (this tether reads version "
            f"{VERSION}); upgrade the older side"
        )
    name = envelope["backend"]
    if type(name) is not str:
        raise DescriptorError("invalid descriptor envelope: backend is not a string")
    schema = schema_of(name)
    raw = envelope["fields"]
    if type(raw) is not dict:
        raise DescriptorError("invalid descriptor fields: not an object")
    fields = dict(raw)
    for field, kind in schema.items():
        if kind is bytes and field in fields:
            if type(fields[field]) is not str:
                raise DescriptorError(f"invalid descriptor field {field!r}: not base64 text")
            try:
                fields[field] = base64.b64decode(fields[field], validate=True)
            except (binascii.Error, ValueError) as exc:
                raise DescriptorError(f"invalid descriptor field {field!r}: not base64") from exc
    _check(fields, schema)
    return name, fields


class WireDescriptor:
    """A descriptor class of one backend: a (frozen) dataclass whose ``_fields`` are its fields,
    as torch 2.15's backends declare theirs."""

    __slots__ = ()
    _backend: ClassVar[str]
    _fields: ClassVar[Mapping[str, type]]

    def serialize(self) -> bytes:
        return encode(
            self._backend, {name: getattr(self, name) for name in self._fields}, self._fields
        )

    @classmethod
    def deserialize(cls, data: bytes) -> Any:
        _, fields = decode(data, cls._schema)
        return cls(**fields)

    @classmethod
    def _schema(cls, backend: str) -> Mapping[str, type]:
        if backend != cls._backend:
            raise DescriptorError(
                f"descriptor belongs to a different backend ({backend!r}, not {cls._backend!r})"
            )
        return cls._fields
