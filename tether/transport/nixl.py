"""NIXL backend: transfers through NVIDIA's NIXL agent (``pip install tether[nixl]``).

NIXL moves bytes one-sidedly: once an agent holds the owner's metadata (a UCX remote key per
registered region) it reads and writes that memory with no code of the owner running — DRAM↔DRAM
through UCX's cross-process copy on one host or TCP between hosts, VRAM through RDMA/NVLink where
UCX finds them. That is what it is for, and it is also why NIXL enforces almost nothing:

What NIXL enforces
    A transfer must fall inside a region that the owner registered, as far as the initiator's
    copy of the owner's metadata knows; that is all.

What NIXL cannot enforce, and what this backend does instead
    - *Keys.* NIXL has no per-request key, and its metadata is a capability for every region it
      names. Here the owner publishes each registration (state word: generation and an active
      bit, id, 128-bit key, address, size) in a control table that is itself NIXL-registered; before
      each transfer the initiator READs the rows it needs and refuses, with
      :class:`RemoteAccessError`, a wrong key, an unknown or unregistered buffer, a range outside
      the registration or a descriptor that does not match it. These checks run in the
      *initiator's* process: they stop stale and misdirected descriptors from well-behaved peers,
      not a hostile peer, which can call NIXL directly with the metadata it was given (the keys
      of the ``local`` backend have the same limit; only ``tcp`` checks on the owner's side).
    - *Unregister while a peer's transfer is in flight.* The owner's CPU never sees a peer's
      transfer, so ``unregister_memory`` cannot refuse because of one (it still refuses for this
      side's own transfers). A peer that passed its check just before the owner unregistered may
      still complete that one transfer into the memory; afterwards every transfer on it is
      refused. Unregister only once peers are done with the memory (a barrier in your protocol).
    - *Revoking access.* After ``unregister_memory`` the NIXL registration is gone, but a peer's
      UCX may still reach the pages (cross-process copy needs no registration): the table check
      above is what refuses it.

Dead peers: UCX reports a failed transfer (the cross-process copy into a dead process fails at
once; TCP notices a reset) and this raises :class:`PeerDiedError`; a transfer that just never
completes raises :class:`TransportTimeoutError` at its deadline (NIXL is then asked to cancel it).

Two NIXL defaults are changed: the agent's progress thread, which by default spins a whole core
(``pthrDelay = 0``), sleeps ``config.nixl.progress_us`` between rounds; and NIXL's Python logger,
which prints INFO lines to stdout for every agent, is set to WARNING.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import importlib
import importlib.util
import logging
import os
import threading
import time
from collections import OrderedDict
from types import ModuleType
from typing import Any, ClassVar, cast

import torch

from tether import _log
from tether._exceptions import (
    BackendUnavailableError,
    DescriptorError,
    PeerDiedError,
    RemoteAccessError,
    TransportError,
    TransportTimeoutError,
)
from tether.transport import _mem, descriptor
from tether.transport.backend import Backend, Op
from tether.transport.config import TransportConfig
from tether.transport.memory import COMMON_FIELDS, Pair, RegisteredMemory, RemoteRange

__all__ = ["NixlRemoteBuffer", "NixlTransport"]

logger = _log.get_logger(__name__)

_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")
"""Where NIXL's Python API lives: the wheels ``nixl-cu12``/``nixl-cu13`` or the meta package."""
_INSTALL_HINT = (
    "the nixl backend needs NIXL's Python package: pip install 'tether[nixl]' (the nixl-cu12 "
    "wheel; with an existing torch, pip install --no-deps nixl-cu12 avoids a second torch)"
)
_SCHEME = b"nixl://"
_ENDPOINT = "nixl-endpoint"
_ENDPOINT_FIELDS: dict[str, type] = {
    "agent": str,
    "md": bytes,
    "ctrl": int,
    "slots": int,
    "id": str,
    "pid": int,
}
"""What a nixl URL carries: the agent, its metadata and its control table."""

_MAGIC = 0x314E726568746574  # "tetherN1"
_HEADER = 4  # magic, version, max_buffers, instance
_SLOT = 6  # state, id, key_lo, key_hi, addr, size
_ACTIVE = 1
_ROW = _SLOT * 8
_HANDLES = 64
"""Transfer handles kept for reposting: repeating a transfer (weight sync) skips NIXL's setup."""
_patch_lock = threading.Lock()


def _endpoint_schema(backend: str) -> dict[str, type]:
    if backend != _ENDPOINT:
        raise DescriptorError(f"not a nixl endpoint: {backend!r}")
    return _ENDPOINT_FIELDS


def _find() -> str | None:
    for name in _MODULES:
        try:
            if importlib.util.find_spec(f"{name}._api") is not None:
                return name
        except (ImportError, ValueError):
            continue
    return None


def _import() -> ModuleType:
    """NIXL's ``_api`` module, imported on first use (it loads UCX and numpy)."""
    name = _find()
    if name is None:
        raise BackendUnavailableError(_INSTALL_HINT)
    try:
        api = importlib.import_module(f"{name}._api")
    except ImportError as exc:
        raise BackendUnavailableError(
            f"NIXL ({name}) failed to import: {exc}; {_INSTALL_HINT}"
        ) from exc
    # NIXL's own logger prints INFO to stdout for each agent: keep a program's stdout its own.
    logging.getLogger("nixl").setLevel(logging.WARNING)
    return api


def _new_agent(api: ModuleType, name: str, backends: list[str], progress_us: int) -> Any:
    """``nixl_agent`` with its progress thread sleeping ``progress_us`` between rounds.

    The wrapper hard-codes ``pthrDelay = 0`` (the thread spins a core: 99 % CPU measured on an
    idle agent, against 2 % at 100 us) and offers no setting, so the constructor it calls is
    wrapped for the duration of this one call. Without a progress thread the owner's UCX never
    answers connection set-up and the first transfer hangs.
    """
    bind = api.nixlBind
    real = bind.nixlAgent

    def make(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = progress_us
        return real(agent_name, agent_config)

    config = api.nixl_agent_config(
        enable_prog_thread=True,
        enable_listen_thread=False,
        backends=backends,
        # Transfers run on callers' threads and the async runner at once: NIXL takes its lock.
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    with _patch_lock:
        bind.nixlAgent = make
        try:
            agent = api.nixl_agent(name, config)
        finally:
            bind.nixlAgent = real
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        raise BackendUnavailableError(
            f"NIXL has no plugin for backend(s) {missing} here (it has {agent.plugin_list})"
        )
    return agent


def _mem_type(tensor: torch.Tensor) -> tuple[str, int]:
    if tensor.device.type == "cuda":
        return "VRAM", tensor.device.index or 0
    return "DRAM", 0


class _Reg:
    __slots__ = ("descs", "dev", "kind", "slot", "word")

    def __init__(self, descs: Any, kind: str, dev: int, slot: int, word: int) -> None:
        self.descs, self.kind, self.dev, self.slot, self.word = descs, kind, dev, slot, word


class _Scratch:
    """This thread's registered buffer that control rows are read into."""

    __slots__ = ("descs", "q", "rows", "tensor")

    def __init__(self, tensor: torch.Tensor, descs: Any) -> None:
        self.tensor, self.descs = tensor, descs
        self.rows = tensor.numel() // _SLOT
        self.q = _mem.ptr_memoryview(tensor.data_ptr(), tensor.numel() * 8).cast("q")


@dataclasses.dataclass(frozen=True, slots=True)
class NixlRemoteBuffer(RemoteRange):
    """A descriptor of the nixl backend: the registration's row in the owner's control table,
    and what the peer's NIXL agent needs to reach the memory."""

    _backend: ClassVar[str] = "nixl"
    _fields: ClassVar[dict[str, type]] = {
        **COMMON_FIELDS,
        "slot": int,
        "addr": int,
        "dev": int,
        "mem": str,
        "md": bytes,
    }

    slot: int
    addr: int
    """The registered memory's address in the owner's address space."""
    dev: int
    """The device index (0 for host memory)."""
    mem: str
    """NIXL's memory kind: DRAM or VRAM."""
    md: bytes
    """This registration's part of the owner agent's metadata."""


def _own(buf: RemoteRange) -> NixlRemoteBuffer:
    return cast(NixlRemoteBuffer, buf)  # _dispatch lets only this backend's class through


class NixlTransport(Backend):
    """Transfers through a NIXL agent (UCX): CPU and CUDA tensors. See the module docstring for
    what NIXL can and cannot enforce."""

    name: ClassVar[str] = "nixl"
    remote_buffer_type: ClassVar[type[RemoteRange]] = NixlRemoteBuffer
    supports_cuda: ClassVar[bool] = True

    @staticmethod
    def supported() -> bool:
        """NIXL is installed (found without importing it: that loads UCX)."""
        return _find() is not None

    def __init__(
        self, device: torch.device | str | None = None, *, config: TransportConfig | None = None
    ) -> None:
        super().__init__(device, config=config)
        self._api = _import()
        self._agent = _new_agent(
            self._api,
            f"tether-{self.instance_id}",
            list(self.config.nixl.backends),
            self.config.nixl.progress_us,
        )
        n = self._slots = self.config.nixl.max_buffers  # the table's size, fixed from here on
        self._ctrl = torch.zeros(_HEADER + n * _SLOT, dtype=torch.int64)
        self._ctrl[:_HEADER] = torch.tensor(
            [_MAGIC, 1, n, int(self.instance_id, 16) >> 1], dtype=torch.int64
        )
        self._ctrl_descs = self._agent.register_memory(self._ctrl)
        self._ctrl_q = _mem.ptr_memoryview(self._ctrl.data_ptr(), self._ctrl.numel() * 8).cast("q")
        self._free = list(range(n - 1, -1, -1))
        self._lock = threading.Lock()
        # The peer, once connected.
        self._remote_agent = ""
        self._remote_ctrl = 0
        self._remote_slots = 0
        self._loaded: set[int] = set()
        self._scratch = threading.local()
        self._scratches: list[_Scratch] = []
        self._handles: OrderedDict[tuple[Any, ...], tuple[Any, tuple[int, ...]]] = OrderedDict()
        self._expected: dict[tuple[Any, ...], tuple[int, list[int]]] = {}
        self._stuck: list[Any] = []

    # -- this side: the memory peers reach ------------------------------------------------------
    def _bind(self, deadline: float) -> bytes:
        envelope = descriptor.encode(
            _ENDPOINT,
            {
                "agent": self._agent.name,
                "md": self._agent.get_agent_metadata(),
                "ctrl": self._ctrl.data_ptr(),
                "slots": self._slots,
                "id": self.instance_id,
                "pid": os.getpid(),
            },
            _ENDPOINT_FIELDS,
        )
        return _SCHEME + base64.urlsafe_b64encode(envelope)

    def _register(self, memory: RegisteredMemory) -> None:
        with self._lock:
            if not self._free:
                raise TransportError(f"all {self._slots} registration slots are in use")
            slot = self._free.pop()
        kind, dev = _mem_type(memory.tensor)
        try:
            descs = self._agent.register_memory(
                self._agent.get_reg_descs([(memory.ptr, memory.nbytes, dev, "")], kind)
            )
        except Exception as exc:
            with self._lock:
                self._free.append(slot)
            raise TransportError(f"NIXL refused to register {memory!r}: {exc}") from exc
        q, base = self._ctrl_q, _HEADER + slot * _SLOT
        word = ((q[base] >> 1) + 1) << 1 | _ACTIVE
        q[base + 1] = _signed(memory.id)
        q[base + 2] = _signed(int.from_bytes(memory.key[:8], "little"))
        q[base + 3] = _signed(int.from_bytes(memory.key[8:], "little"))
        q[base + 4], q[base + 5] = _signed(memory.ptr), memory.nbytes
        q[base] = word  # published last: a peer never sees a half-written row as active
        memory.state = _Reg(descs, kind, dev, slot, word)

    def _descriptor_fields(self, memory: RegisteredMemory) -> dict[str, int | str | bytes]:
        reg: _Reg = memory.state
        # This registration's part of the agent metadata: what a peer's NIXL needs to reach it.
        md = self._agent.get_partial_agent_metadata(reg.descs, False)
        return {"slot": reg.slot, "addr": memory.ptr, "dev": reg.dev, "mem": reg.kind, "md": md}

    def _unregister(self, memory: RegisteredMemory) -> None:
        reg: _Reg = memory.state
        q, base = self._ctrl_q, _HEADER + reg.slot * _SLOT
        # A new generation, inactive: peers' checks refuse it from now on. A peer's transfer
        # that passed its check already cannot be seen from here (see the module docstring).
        q[base] = (reg.word >> 1) + 1 << 1
        self._drop_handles(memory.id)
        self._agent.deregister_memory(reg.descs)
        with self._lock:
            self._free.append(reg.slot)

    # -- the peer's memory ------------------------------------------------------------------------
    def _connect(self, url: bytes, deadline: float) -> str:
        if not url.startswith(_SCHEME):
            raise DescriptorError(f"not a nixl transport URL: {url[:60]!r}")
        try:
            raw = base64.urlsafe_b64decode(url[len(_SCHEME) :])
        except (binascii.Error, ValueError) as exc:
            raise DescriptorError(f"malformed nixl transport URL: {url[:80]!r}") from exc
        _, fields = descriptor.decode(raw, _endpoint_schema)
        try:
            name = self._agent.add_remote_agent(fields["md"])
        except Exception as exc:
            raise DescriptorError(f"NIXL rejected the peer's metadata: {exc}") from exc
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != fields["agent"]:
            raise DescriptorError(f"the URL names agent {fields['agent']!r}, its metadata {name!r}")
        self._remote_agent, self._remote_ctrl = name, int(fields["ctrl"])
        self._remote_slots = int(fields["slots"])
        try:
            self._agent.make_connection(name)
        except Exception as exc:
            raise PeerDiedError(f"NIXL cannot connect to the peer agent {name}: {exc}") from exc
        return str(fields["id"])

    def _scratch_for(self, rows: int) -> _Scratch:
        scratch: _Scratch | None = getattr(self._scratch, "s", None)
        if scratch is None or scratch.rows < rows:
            tensor = torch.zeros(max(rows, 4) * _SLOT, dtype=torch.int64)
            descs = self._agent.register_memory(tensor)
            scratch = _Scratch(tensor, descs)
            with self._lock:
                self._scratches.append(scratch)
            self._scratch.s = scratch
        return scratch

    def _run(
        self,
        op: Op,
        local: list[tuple[int, int, int]],
        kind: str,
        remote: list[tuple[int, int, int]],
        rkind: str,
        key: tuple[Any, ...],
        ids: tuple[int, ...],
        deadline: float,
    ) -> None:
        """One NIXL transfer request: set up (or reuse the handle kept under ``key``, which uses
        the memories ``ids``), post, poll to the deadline."""
        agent = self._agent
        with self._lock:
            entry = self._handles.pop(key, None)  # in use: no other thread reposts it
        handle = None if entry is None else entry[0]
        if handle is None:
            try:
                handle = agent.initialize_xfer(
                    "WRITE" if op == "write" else "READ",
                    agent.get_xfer_descs(local, kind),
                    agent.get_xfer_descs(remote, rkind),
                    self._remote_agent,
                )
            except Exception as exc:
                raise RemoteAccessError(
                    f"NIXL refused the {op}: the range is not in the peer's registered memory "
                    f"({exc})"
                ) from exc
        try:
            state = agent.transfer(handle)
            while state == "PROC":
                if time.monotonic() > deadline:
                    self._abandon(handle)
                    raise TransportTimeoutError(
                        f"nixl {op} did not complete in time (NIXL was asked to cancel it)"
                    )
                state = agent.check_xfer_state(handle)
        except TransportError:
            raise
        except Exception as exc:  # NIXL's errors (nixlRemoteDisconnectError, ...) derive from it
            state = f"{type(exc).__name__}: {exc}"
        if state != "DONE":
            self._abandon(handle)
            raise PeerDiedError(
                f"NIXL reported the {op} failed ({state}): the peer agent "
                f"{self._remote_agent} is gone or unreachable"
            )
        evicted = []
        with self._lock:
            old = self._handles.pop(key, None)
            self._handles[key] = (handle, ids)
            while len(self._handles) > _HANDLES:
                evicted.append(self._handles.popitem(last=False)[1][0])
        if old is not None:
            evicted.append(old[0])
        for handle in evicted:
            self._release(handle)

    def _abandon(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)  # NIXL cancels it if it can
        except Exception:
            logger.warning("nixl: a failed transfer could not be cancelled; released at close")
            self._stuck.append(handle)

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            self._stuck.append(handle)

    def _drop_handles(self, memory_id: int | None) -> None:
        """Releases the kept handles that use ``memory_id`` (a local or remote id; None: all)."""
        with self._lock:
            dead = [k for k, (_, ids) in self._handles.items() if memory_id in (None, *ids)]
            handles = [self._handles.pop(k)[0] for k in dead]
        for handle in handles:
            self._release(handle)

    def _expect(self, buf: RemoteRange) -> tuple[int, list[int]]:
        """The slot of ``buf``'s registration and the row (less the state word) it must have."""
        # Keyed by everything the row is built from: a forged descriptor gets a row of its own.
        own = _own(buf)
        ident = (own.id, own.key, own.size, own.addr, own.slot)
        got = self._expected.get(ident)
        if got is None:
            slot = own.slot
            if slot >= self._remote_slots:
                raise RemoteAccessError("peer refused: no such registration")
            row = [
                _signed(buf.id),
                _signed(int.from_bytes(buf.key[:8], "little")),
                _signed(int.from_bytes(buf.key[8:], "little")),
                _signed(own.addr),
                buf.size,
            ]
            got = self._expected[ident] = (slot, row)
        return got

    def _check(self, pairs: list[Pair], deadline: float) -> None:
        """READs the peer's control rows for ``pairs`` and refuses what they do not allow."""
        slots: dict[int, int] = {}
        for _, buf in pairs:
            slots.setdefault(self._expect(buf)[0], len(slots))
        scratch = self._scratch_for(len(slots))
        base = scratch.tensor.data_ptr()
        local = [(base + i * _ROW, _ROW, 0) for i in range(len(slots))]
        remote = [(self._remote_ctrl + (_HEADER + s * _SLOT) * 8, _ROW, 0) for s in slots]
        self._run("read", local, "DRAM", remote, "DRAM", (base, *slots), (), deadline)
        rows = scratch.q
        for _, buf in pairs:
            slot, expected = self._expect(buf)
            i = slots[slot] * _SLOT
            if not rows[i] & _ACTIVE or rows[i + 1 : i + 4].tolist() != expected[:3]:
                self._loaded.discard(buf.id)
                self._expected = {k: v for k, v in self._expected.items() if k[0] != buf.id}
                self._drop_handles(buf.id)
                raise RemoteAccessError(
                    "peer refused: unknown or unregistered buffer, or wrong key"
                )
            if rows[i + 4 : i + 6].tolist() != expected[3:]:
                raise RemoteAccessError(
                    "peer refused: the descriptor does not match its registration"
                )
            if buf.offset + buf.length > buf.size:
                raise RemoteAccessError("peer refused: range outside the registration")

    def _transfer(self, op: Op, pairs: list[Pair], deadline: float) -> None:
        for _, buf in pairs:
            if buf.id not in self._loaded:
                self._load(buf)
        self._check(pairs, deadline)
        if len(pairs) == 1:  # the common case, without the grouping below
            view, buf = pairs[0][0], _own(pairs[0][1])
            lstate: _Reg = view.memory.state
            self._run(
                op,
                [(view.ptr, view.length, lstate.dev)],
                lstate.kind,
                [(buf.addr + buf.offset, view.length, buf.dev)],
                buf.mem,
                (op, view.memory.id, view.offset, view.length, buf.id, buf.offset),
                (view.memory.id, buf.id),
                deadline,
            )
            return
        groups: dict[tuple[str, str], list[Pair]] = {}
        for view, buf in pairs:
            lkind = view.memory.state.kind
            groups.setdefault((lkind, _own(buf).mem), []).append((view, buf))
        for (lkind, rkind), group in groups.items():
            local = [(v.ptr, v.length, v.memory.state.dev) for v, _ in group]
            remote = [(_own(b).addr + b.offset, v.length, _own(b).dev) for v, b in group]
            key = (op, *(x for v, b in group for x in (v.memory.id, b.id)), *local, *remote)
            ids = tuple({*(v.memory.id for v, _ in group), *(b.id for _, b in group)})
            self._run(op, local, lkind, remote, rkind, key, ids, deadline)

    def _load(self, buf: RemoteRange) -> None:
        """Loads ``buf``'s part of the peer's metadata into this agent (once per buffer)."""
        try:
            name = self._agent.add_remote_agent(_own(buf).md)
        except Exception as exc:
            raise DescriptorError(f"NIXL rejected the descriptor's metadata: {exc}") from exc
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != self._remote_agent:
            raise DescriptorError("the descriptor's metadata is for another NIXL agent")
        self._loaded.add(buf.id)

    def _close(self, deadline: float) -> None:
        self._drop_handles(None)
        agent = self._agent
        for memory in list(self._memories.values()):
            try:
                agent.deregister_memory(memory.state.descs)
            except Exception as exc:
                logger.warning("nixl: deregistering %r at close failed: %s", memory, exc)
        for scratch in self._scratches:
            agent.deregister_memory(scratch.descs)
        agent.deregister_memory(self._ctrl_descs)
        if self._remote_agent:
            try:
                agent.remove_remote_agent(self._remote_agent)
            except Exception as exc:
                logger.debug("nixl: removing the peer agent failed: %s", exc)
        for handle in self._stuck:
            try:
                agent.release_xfer_handle(handle)
            except Exception:
                logger.warning("nixl: a transfer handle could not be released at close")
        self._stuck.clear()
        del self._agent  # the agent's destructor stops its progress thread


def _signed(value: int) -> int:
    """A u64 as the i64 the control table stores."""
    return value - (1 << 64) if value >= 1 << 63 else value
