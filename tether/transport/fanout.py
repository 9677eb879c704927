"""One-to-many sync of a set of tensors (a model's weights): one publisher, N subscribers.

The publisher packs its tensors into one registered buffer, a version at a time. Subscribers form
a chain: subscriber k pulls each chunk of the newest version from subscriber k-1 (subscriber 0
from the publisher) as soon as k-1 has it, and serves it on to k+1. Every link carries the bytes
once, so a sync of B bytes to N hosts takes about B / link rate plus one chunk per hop, where the
publisher alone would send N x B. The publisher's link is not the bottleneck for any N.

Each side's buffer comes with a head, two int64 words ``(version, chunks ready)``, that the next
in the chain reads (16 B) to learn what it may pull. A side about to overwrite its buffer with a
newer version first sets its count to 0, then the version; a reader checks the head again after
each read, and drops what it read unless the version is the same and the count not 0 (a seqlock
read through the network). A subscriber copies into its tensors only a whole version, so its
tensors never mix two updates and never hold a torn one: an error leaves them at the version
before.

Faults:
- a subscriber that dies: the next one's read fails (its peer's connection is reset) and it
  goes on from the one before, where it stopped; the others lose nothing;
- an upstream that gives up (it could reach no one before it) sets its count to -1: the next
  one goes round it in the same way;
- the publisher gone: the subscribers that reach it raise :class:`PeerDiedError` saying which
  version was lost; the others, round the chain to the publisher, end the same way;
- a link down: reads wait up to the transport's timeout (TCP carries on if it comes back), then
  go round it; every wait is bounded by ``pull``'s timeout.

The store carries descriptors and counters only, under ``tether/fanout/<name>/``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]

from tether import _log
from tether._exceptions import ConfigError, PeerDiedError, TransportError, TransportTimeoutError
from tether.transport.base import Transport
from tether.transport.config import TransportConfig
from tether.transport.memory import RemoteRange
from tether.transport.registry import new_transport

__all__ = ["Publisher", "Subscriber"]

logger = _log.get_logger(__name__)

CHUNK_BYTES = 2 << 20
"""What a subscriber pulls before the next one may pull it: 17 ms at 1 Gb/s, which a hop adds to
a sync. Measured on 1 Gb/s links, 4 hosts, 64 MiB: 1.17x bytes / rate at 2 MiB, 1.24x at 1 MiB
(a head read per chunk), 1.27x at 4 MiB."""
_ALIGN = 64
_PUBLISHER = -1
"""The chain's head, as an upstream index."""
_POLL_S = 0.0002
"""A subscriber waiting for its upstream reads the upstream's head after 0.2 ms at first, then
twice as long each time (a 16 B read costs the upstream's server ~50 us of CPU)..."""
_POLL_MAX_S = 0.02
"""... up to 20 ms while no newer version is there,"""
_POLL_MAX_MID_S = 0.002
"""... and 2 ms in the middle of a version, whose next chunk is a chunk's time away."""
_GAVE_UP = -1
"""A head's count once its side stopped pulling a version it will not finish."""


Layout = list[tuple[str, str, list[int], int]]


def _layout(tensors: Mapping[str, torch.Tensor]) -> tuple[Layout, int]:
    """Name, dtype, shape and byte offset of each tensor in the packed buffer (by name); the
    buffer's size."""
    out: Layout = []
    offset = size = 0
    for name in sorted(tensors):
        tensor = tensors[name]
        if tensor.device.type != "cpu":
            raise ConfigError(f"tensor {name!r} is on {tensor.device}: a sync moves CPU tensors")
        if not tensor.is_contiguous():
            raise ConfigError(f"tensor {name!r} is not contiguous: a sync moves contiguous ones")
        out.append((name, str(tensor.dtype), list(tensor.shape), offset))
        size = offset + tensor.numel() * tensor.element_size()
        offset = -(-size // _ALIGN) * _ALIGN
    return out, size


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


class _Side:
    """A packed buffer and its head, registered with a transport that serves them."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], backend: str, config: TransportConfig):
        self.layout, self.size = _layout(tensors)
        self.buffer = torch.zeros(max(self.size, 1), dtype=torch.uint8)
        self.head = torch.zeros(2, dtype=torch.int64)
        self.backend, self.config = backend, config
        self.server = new_transport(backend, config=config)
        self.url = self.server.bind()
        self._memories = [self.server.register_memory(t) for t in (self.buffer, self.head)]

    def card(self) -> str:
        """What a reader needs to reach this side: its URL and its two descriptors."""
        buffer, head = (m.to_remote_buffer().serialize().decode() for m in self._memories)
        return json.dumps({"url": self.url.decode(), "buffer": buffer, "head": head})

    def starting(self, version: int) -> None:
        """About to overwrite the buffer with ``version``: count first, so that a reader that
        sees the old version sees no chunk ready."""
        self.head[1] = 0
        self.head[0] = version

    def close(self, timeout: float) -> None:
        try:
            self.server.close(timeout=timeout)
        except TransportError as exc:  # a peer still reading: its transfer fails, not ours
            logger.warning("fanout: closing the transport: %s", exc)


def _scoped(store: Store, name: str) -> Store:
    if not name or "/" in name:
        raise ConfigError(f"a sync's name is a non-empty word without '/', not {name!r}")
    return PrefixStore(f"tether/fanout/{name}/", store)


class Publisher:
    """The source of a sync: ``publish()`` makes the tensors' current values the next version.

    ``tensors``: name -> CPU tensor (a ``state_dict``), read at each ``publish``; subscribers
    give tensors of the same names, dtypes and shapes. ``config.tcp.host``: an address the
    subscribers reach (loopback by default)."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        store: Store,
        name: str = "weights",
        backend: str = "tcp",
        config: TransportConfig | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        if chunk_bytes < 4096:
            raise ConfigError(f"chunk_bytes is at least 4096, not {chunk_bytes}")
        self.tensors = dict(tensors)
        self.config = config or TransportConfig()
        self._store = _scoped(store, name)
        self._side = _Side(self.tensors, backend, self.config)
        self._chunk = chunk_bytes
        self._chunks = max(-(-self._side.size // chunk_bytes), 1)
        self.version = 0
        """The last version published."""
        card = json.loads(self._side.card())
        card.update(layout=self._side.layout, size=self._side.size, chunk=chunk_bytes)
        self._store.set("publisher", json.dumps(card))

    def publish(self) -> int:
        """Packs the tensors as the next version; returns it. Subscribers still pulling the
        version before drop it for this one."""
        version = self.version + 1
        side, chunk = self._side, self._chunk
        side.starting(version)
        # Chunk by chunk, each counted once packed: subscriber 0 starts on the first while the
        # rest is packed (a 1 GiB copy takes ~0.1 s).
        for name, _, _, offset in side.layout:
            data = _bytes_of(self.tensors[name])
            for at in range(0, data.numel(), chunk):
                piece = data[at : at + chunk]
                side.buffer[offset + at : offset + at + piece.numel()].copy_(piece)
                side.head[1] = (offset + at + piece.numel()) // chunk
        side.head[1] = self._chunks
        self.version = version
        return version

    def pulled(self, version: int) -> int:
        """How many subscribers have pulled ``version`` into their tensors."""
        return int(self._store.add(f"pulled/{version}", 0))

    def close(self, *, timeout: float | None = None) -> None:
        self._side.close(self.config.timeout if timeout is None else timeout)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Subscriber:
    """Subscriber ``index`` (0, 1, ...) of a sync: ``pull()`` brings the next version into
    ``tensors`` and serves it on to subscriber ``index + 1``."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        store: Store,
        index: int,
        name: str = "weights",
        backend: str = "tcp",
        config: TransportConfig | None = None,
        timeout: float | None = None,
    ) -> None:
        if index < 0:
            raise ConfigError(f"a subscriber's index is 0 or more, not {index}")
        self.index = index
        self.tensors = dict(tensors)
        self.config = config or TransportConfig()
        self._store = _scoped(store, name)
        layout, _ = _layout(self.tensors)  # (refused before anything listens)
        wait = self.config.timeout if timeout is None else timeout
        try:
            self._store.wait(["publisher"], timedelta(seconds=wait))
        except dist.DistStoreError as exc:
            raise TransportTimeoutError(f"fanout: no publisher of {name!r} in {wait:g} s") from exc
        card = json.loads(self._store.get("publisher"))
        if [list(x) for x in layout] != card["layout"]:
            raise ConfigError(
                f"subscriber {index}'s tensors differ from the publisher's (names, dtypes, "
                "shapes): a sync moves the same tensors"
            )
        self._side = _Side(self.tensors, backend, self.config)
        self.size, self.chunk = int(card["size"]), int(card["chunk"])
        self.chunks = max(-(-self.size // self.chunk), 1)
        self._store.set(f"subscriber/{index}", self._side.card())
        self.version = 0
        """The version in ``tensors`` (0: none pulled yet)."""
        self.superseded = 0
        """Versions this subscriber dropped half pulled for a newer one (or found overwritten
        under it: they are pulled again)."""
        self.upstream = index - 1 if index else _PUBLISHER
        """Where this subscriber pulls from: the subscriber before it, or the publisher."""
        self._pull: tuple[Transport, Any, RemoteRange, RemoteRange] | None = None
        self._cards: dict[int, dict[str, str]] = {_PUBLISHER: card}
        self._head_in = torch.zeros(2, dtype=torch.int64)
        """The upstream's head, read into here (registered with each pull transport)."""
        self._head_mem: Any = None

    # -- reaching the upstream ------------------------------------------------------------------
    def _reach(self, deadline: float) -> tuple[Transport, Any, RemoteRange, RemoteRange]:
        if self._pull is not None:
            return self._pull
        card = self._card(self.upstream, deadline)
        transport = new_transport(self._side.backend, config=self.config)
        try:
            transport.connect(card["url"].encode(), timeout=self._io(deadline))
            mine = transport.register_memory(self._side.buffer)
            self._head_mem = transport.register_memory(self._head_in)
        except BaseException:
            _close_quietly(transport)
            raise
        buffer = RemoteRange.deserialize(card["buffer"].encode())
        head = RemoteRange.deserialize(card["head"].encode())
        self._pull = (transport, mine, buffer, head)
        return self._pull

    def _card(self, upstream: int, deadline: float) -> dict[str, str]:
        """How to reach ``upstream``: from the store the first time, kept (the store may be
        gone with the node that hosted it, the publisher's often)."""
        card = self._cards.get(upstream)
        if card is not None:
            return card
        key = f"subscriber/{upstream}"
        try:
            if not self._store.check([key]):  # not joined yet: wait for it (bounded)
                self._store.wait([key], timedelta(seconds=self._io(deadline)))
            loaded: dict[str, str] = json.loads(self._store.get(key))
        except dist.DistStoreError as exc:  # the wait's timeout
            raise TransportTimeoutError(f"subscriber {upstream} never joined") from exc
        except dist.DistError as exc:
            raise PeerDiedError(f"subscriber {upstream}'s address: the store is gone") from exc
        self._cards[upstream] = loaded
        return loaded

    def _go_round(self, why: BaseException | str) -> None:
        """The upstream is gone, stalled or gave up: pull from the one before it."""
        if self._pull is not None:
            _close_quietly(self._pull[0])
            self._pull = None
        if self.upstream == _PUBLISHER:
            self._side.head[1] = _GAVE_UP
            kind = TransportTimeoutError if isinstance(why, TimeoutError) else PeerDiedError
            raise kind(
                f"fanout: subscriber {self.index} cannot pull from the publisher ({why}); its "
                f"tensors keep version {self.version}"
            ) from (why if isinstance(why, BaseException) else None)
        logger.warning(
            "fanout: subscriber %d cannot pull from subscriber %d (%s): pulling from %s",
            self.index,
            self.upstream,
            why,
            "the publisher" if self.upstream == 0 else f"subscriber {self.upstream - 1}",
        )
        self.upstream = self.upstream - 1 if self.upstream > 0 else _PUBLISHER

    def _read_head(self, deadline: float) -> tuple[int, int]:
        transport, _, _, head = self._reach(deadline)
        transport.read(self._head_mem.to_mutable_view(), head, timeout=self._io(deadline))
        return int(self._head_in[0]), int(self._head_in[1])

    def _io(self, deadline: float) -> float:
        """One wait's bound: the transport's timeout (a link down that long is gone round),
        within the pull's."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise _PastDeadline
        return min(left, self.config.timeout)

    # -- a pull ---------------------------------------------------------------------------------
    def pull(self, *, timeout: float | None = None) -> int:
        """Waits for a version newer than :attr:`version`, reads the newest one whole and copies
        it into the tensors; returns it. Raises :class:`PeerDiedError` when the publisher is
        gone, :class:`TransportTimeoutError` after ``timeout`` (the transport's by default);
        either way the tensors keep the version they had."""
        deadline = time.monotonic() + (self.config.timeout if timeout is None else timeout)
        try:
            version = self._pull_whole(deadline)
        except _PastDeadline:
            self._side.head[1] = _GAVE_UP
            raise TransportTimeoutError(
                f"fanout: subscriber {self.index} found no whole version newer than "
                f"{self.version} in time; its tensors keep it"
            ) from None
        side = self._side
        for name, _, _, offset in side.layout:
            data = _bytes_of(self.tensors[name])
            data.copy_(side.buffer[offset : offset + data.numel()])
        self.version = version
        try:
            self._store.add(f"pulled/{version}", 1)
        except dist.DistError as exc:  # a count for the publisher: the pull itself is whole
            logger.warning("fanout: could not count version %d as pulled: %s", version, exc)
        return version

    def _pull_whole(self, deadline: float) -> int:
        """Pulls the newest version into the buffer, chunk by chunk; returns it."""
        side, chunk = self._side, self.chunk
        version, have, idle = 0, 0, _POLL_S
        moved = time.monotonic()  # when the upstream last had something new for this one
        head: tuple[int, int] | None = None  # the upstream's, read after the last chunk
        while True:
            try:
                up_version, up_count = head or self._read_head(deadline)
                head = None
                if up_count == _GAVE_UP:
                    self._go_round(f"subscriber {self.upstream} gave up on version {up_version}")
                    continue
                if (
                    up_version <= self.version
                    or up_count == 0
                    or (up_version == version and up_count <= have)
                ):  # nothing new yet
                    if version and time.monotonic() - moved > self.config.timeout:
                        self._go_round(f"no chunk in {self.config.timeout:g} s")
                        moved = time.monotonic()
                        continue
                    time.sleep(idle)
                    idle = min(idle * 2, _POLL_MAX_MID_S if version else _POLL_MAX_S)
                    continue
                idle, moved = _POLL_S, time.monotonic()
                if up_version != version:  # the first chunk of a version, or a newer one
                    self.superseded += bool(version)
                    version, have = up_version, 0
                    side.starting(version)
                # One chunk at a time, even with more there: the next subscriber waits for what
                # this one reads (at most 2 at a time: 1.48x bytes / rate, 4: 1.84x, measured).
                upto = min(up_count, have + 1, self.chunks)
                start, stop = have * chunk, min(upto * chunk, self.size)
                transport, mine, buffer, _ = self._reach(deadline)
                if stop > start:
                    transport.read(
                        mine.to_mutable_view(start, stop - start),
                        buffer.view(start, stop - start),
                        timeout=self._io(deadline),
                    )
                # One read of the head checks what was read and tells what is next.
                head = self._read_head(deadline)
                if head[0] != version or head[1] in (0, _GAVE_UP):
                    continue  # overwritten meanwhile: what was read may be torn
                have = upto
                side.head[1] = have
                if have == self.chunks:
                    return version
            except (PeerDiedError, TransportTimeoutError) as exc:
                head = None
                self._go_round(exc)

    def close(self, *, timeout: float | None = None) -> None:
        if self._pull is not None:
            _close_quietly(self._pull[0])
            self._pull = None
        self._side.close(self.config.timeout if timeout is None else timeout)

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _PastDeadline(Exception):
    """The pull's own deadline passed (not a peer's fault: nothing to go round)."""


def _close_quietly(transport: Transport) -> None:
    try:
        transport.close(timeout=1.0)
    except TransportError as exc:
        logger.warning("fanout: closing a transport to a gone peer: %s", exc)
