"""Same-host backend: zero copy between processes through shared pages.

Registering a tensor moves the pages it fully covers onto a ``memfd`` mapped at the very same
address (MAP_FIXED over the tensor's own pages, after copying their contents), so the tensor and
every view of it keep working while a peer maps the same pages and reads or writes them with a
plain ``memcpy``: no socket, no syscall, no helper thread on the data path. The at most two pages
at the ends that the tensor shares with other allocations are never remapped: another thread could
write them between copy and remap (a lost write to an unrelated object or to malloc's own chunk
headers), and shared pages stay shared across ``fork``, so a child's heap activity there would
corrupt the parent. Bytes there move with a ``pread``/``pwrite`` of the peer's ``/proc/PID/mem``
(small transfers: one C call, no ctypes) or ``process_vm_readv``/``writev`` (larger ones).
Unregistering copies the pages back onto private memory, so a stale peer mapping can no longer
touch the tensor.

Each transport owns a control block (another memfd) that peers map: a table of registrations
(state word = generation and an active bit, id, 128-bit key, address, size, memfd) and one
"busy" flag per row and registration, where each thread of a peer process that transfers owns
a row (so each flag has one writer and needs no atomic operation). A transfer sets its busy
flag, then checks the registration is still active; ``unregister_memory`` clears the active bit,
then looks for busy flags — so either the transfer sees the registration gone, or unregister sees
the transfer (the Dekker pattern). The hot side needs no fence because the unregistering side
issues ``membarrier(MEMBARRIER_CMD_GLOBAL)`` between its store and its loads (the asymmetric
fence; where membarrier is missing, transfers take a lock, a full barrier on x86-64).
A row's flags are trusted only while its owner holds the row's OFD lock, which the kernel drops
when the owner dies. The peer's death is watched through a pidfd by a named daemon thread.

Keys here catch stale or misdirected descriptors; they are not a security boundary, since a
process that may open ``/proc/PID/fd`` of another may also read its memory.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import mmap
import os
import select
import struct
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import ClassVar, cast

import torch

from tether import _log
from tether._exceptions import (
    DescriptorError,
    PeerDiedError,
    RemoteAccessError,
    TransferInFlightError,
    TransportError,
)
from tether.transport import _mem
from tether.transport.backend import Backend, Op
from tether.transport.config import TransportConfig
from tether.transport.memory import COMMON_FIELDS, Pair, RegisteredMemory, RemoteRange

__all__ = ["LocalRemoteBuffer", "LocalTransport"]

logger = _log.get_logger(__name__)

_MAGIC = 0x314C726568746574  # "tetherL1"
_HEADER = 16
_SLOT = 9  # state, id, key_hi, key_lo, addr, size, memfd, map_start, map_len
_ACTIVE = 1
_PAGE = mmap.PAGESIZE
_SCHEME = b"local://"
_FLOCK = "hh4xqqi4x"  # struct flock on 64-bit Linux
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_NR_MEMBARRIER = {"x86_64": 324, "aarch64": 283}.get(os.uname().machine, -1)
_MEMBARRIER_GLOBAL = 1
_SMALL = 1 << 16
"""Copies up to this size go through memoryviews: ~0.3 us against ~1.3 us for ctypes.memmove."""


_REFUSED = "peer refused: unknown or unregistered buffer, or wrong key"


def _membarrier_supported() -> bool:
    if _NR_MEMBARRIER < 0:
        return False
    mask = _mem.libc.syscall(_NR_MEMBARRIER, 0, 0, 0)  # MEMBARRIER_CMD_QUERY
    return mask > 0 and bool(mask & _MEMBARRIER_GLOBAL)


_HAVE_MEMBARRIER = sys.platform == "linux" and _membarrier_supported()


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def _ofd_lock(fd: int, byte: int, *, test: bool) -> bool:
    """Takes (or, with ``test``, probes) a write lock on one byte; False when someone holds it."""
    req = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0)
    try:
        got = fcntl.fcntl(fd, _F_OFD_GETLK if test else _F_OFD_SETLK, req)
    except OSError:
        return False
    return not test or struct.unpack(_FLOCK, got)[0] == fcntl.F_UNLCK


_libc = _mem.libc
_vm_readv = _libc.process_vm_readv
_vm_writev = _libc.process_vm_writev
for _fn in (_vm_readv, _vm_writev):
    _fn.restype = ctypes.c_ssize_t
_iov = threading.local()


def _cma(op: Op, pid: int, local: int, remote: int, nbytes: int) -> None:
    """Moves bytes at the ends of a registration, which are not in shared pages."""
    fn = _vm_writev if op == "write" else _vm_readv
    iov = getattr(_iov, "arr", None)
    if iov is None:  # per thread, built once: ctypes object creation dominates a 16 B copy
        arr = (ctypes.c_size_t * 4)()
        iov = _iov.arr = (arr, ctypes.byref(arr), ctypes.byref(arr, 16))
    arr, lref, rref = iov
    while nbytes:
        arr[0], arr[1], arr[2], arr[3] = local, nbytes, remote, nbytes
        got = fn(pid, lref, 1, rref, 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            raise PeerDiedError(f"peer process {pid} is gone ({os.strerror(err)})")
        local, remote, nbytes = local + got, remote + got, nbytes - got


def _proc_mem(op: Op, peer: _Peer, local: memoryview, remote: int) -> None:
    """Moves a few bytes through the peer's ``/proc/PID/mem`` (same permission as CMA: ptrace
    access). Only registered byte ranges, bounds-checked by the caller, are ever addressed."""
    try:
        if op == "write":  # pwrite: no iovec list to build (measured ~0.2 us less than pwritev)
            got = os.pwrite(peer.mem_fd, local, remote)
        else:
            got = os.preadv(peer.mem_fd, [local], remote)
    except OSError as exc:
        raise PeerDiedError(f"peer process {peer.pid} is gone ({exc.strerror})") from exc
    if got != len(local):
        if got > 0:  # short: finish through process_vm_*v, which loops
            addr = ctypes.addressof(ctypes.c_char.from_buffer(local))
            _cma(op, peer.pid, addr + got, remote + got, len(local) - got)
            return
        raise PeerDiedError(f"peer process {peer.pid} is gone")


class _Control:
    """A control block: this process's own, or a peer's mapped here."""

    def __init__(self, fd: int, max_buffers: int, max_peers: int, *, create: bool) -> None:
        self.max_buffers, self.max_peers = max_buffers, max_peers
        self.busy_base = _HEADER + max_buffers * _SLOT
        self.size = (self.busy_base + max_buffers * max_peers) * 8
        if create:
            os.ftruncate(fd, self.size)
        self.fd = fd
        self.fd_number = fd  # for a peer's block: its number in the owner process (set by caller)
        self.mm = mmap.mmap(fd, self.size)
        self.q = memoryview(self.mm).cast("Q")

    def close(self) -> None:
        self.q.release()
        self.mm.close()
        os.close(self.fd)


class _Reg:
    __slots__ = ("map_len", "map_start", "memfd", "slot", "word")

    def __init__(self, slot: int, word: int, memfd: int, map_start: int, map_len: int) -> None:
        self.slot, self.word, self.memfd = slot, word, memfd
        self.map_start, self.map_len = map_start, map_len


class _Mapped:
    """A peer's registration as seen here: where its shared pages are mapped in this process."""

    __slots__ = (
        "addr",
        "key",
        "local",
        "map_len",
        "map_start",
        "mv",
        "size",
        "slot",
        "state",
        "word",
    )

    def __init__(
        self,
        *,
        addr: int,
        key: bytes,
        local: int,
        map_len: int,
        map_start: int,
        mv: memoryview,
        size: int,
        slot: int,
        state: int,
        word: int,
    ) -> None:
        self.addr, self.local, self.map_len, self.map_start = addr, local, map_len, map_start
        self.key, self.mv, self.size = key, mv, size
        self.slot, self.state, self.word = slot, state, word


def _release(m: _Mapped) -> None:
    m.mv.release()
    if m.map_len:
        _mem.unmap(m.local, m.map_len)


class _RowClaim:
    """A thread's row in a peer's control block, held in that thread's ``threading.local``: when
    the thread ends the claim is dropped and the row given back, so short-lived threads do not
    use up the peer's ``max_peers`` rows."""

    def __init__(self, peer: _Peer, fd: int, row: int) -> None:
        self.row = row
        weakref.finalize(self, peer.release_row, fd, row)


class _Peer:
    def __init__(self, pid: int, ctrl: _Control) -> None:
        self.pid, self.ctrl = pid, ctrl
        self.mapped: dict[int, _Mapped] = {}
        self.stale: list[_Mapped] = []
        """Mappings of registrations gone, waiting for this process's transfers to leave them."""
        self.my_rows: set[int] = set()
        """The rows of this process's threads (each thread's busy flags start there)."""
        self.dead = False
        self.rows = threading.local()
        self.row_fds: list[int] = []
        self.row_lock = threading.Lock()
        self.pidfd = os.pidfd_open(pid)
        try:  # small transfers at a registration's partial pages; -1: process_vm_*v instead
            self.mem_fd = os.open(f"/proc/{pid}/mem", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            self.mem_fd = -1
        try:
            self.stop_r, self.stop_w = os.pipe()
        except OSError:  # out of fds: give back what this peer opened
            os.close(self.pidfd)
            if self.mem_fd >= 0:
                os.close(self.mem_fd)
            raise
        self.thread = threading.Thread(
            target=self._watch, name=f"tether-transport-local-watch-{pid}", daemon=True
        )
        self.thread.start()

    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        poller.register(self.stop_r, select.POLLIN)
        while True:
            try:
                events = poller.poll(1000)  # a timeout so the thread never blocks forever
            except OSError:
                logger.exception("watching peer %d failed; retrying", self.pid)
                time.sleep(0.1)  # back off: a persistent error must not spin a core
                continue
            fds = {fd for fd, _ in events}
            if self.pidfd in fds:
                self.dead = True
                logger.warning("local transport peer process %d exited", self.pid)
                return
            if self.stop_r in fds:
                return

    def row(self) -> int:
        """This thread's row of busy flags in the peer's control block (claimed on first use)."""
        claim: _RowClaim | None = getattr(self.rows, "claim", None)
        if claim is not None:
            return claim.row
        ctrl = self.ctrl
        try:
            fd = os.open(f"/proc/{self.pid}/fd/{ctrl.fd_number}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise PeerDiedError(f"local transport peer process {self.pid} is gone") from exc
        for slot in range(ctrl.max_peers):
            if _ofd_lock(fd, ctrl.size + slot, test=False):
                break
        else:
            os.close(fd)
            raise TransportError(
                f"peer {self.pid} has all {ctrl.max_peers} rows in use (threads of connected "
                "processes that transfer); raise max_peers on the peer"
            )
        row = ctrl.busy_base + slot * ctrl.max_buffers
        with self.row_lock:
            self.row_fds.append(fd)
            self.my_rows.add(row)
        for i in range(ctrl.max_buffers):  # flags a dead previous owner left behind
            ctrl.q[row + i] = 0
        self.rows.claim = _RowClaim(self, fd, row)
        return row

    def release_row(self, fd: int, row: int) -> None:
        """Give a row back (its thread ended): closing the fd drops the OFD lock on it."""
        with self.row_lock:
            if fd not in self.row_fds:  # the peer was closed first
                return
            self.row_fds.remove(fd)
            self.my_rows.discard(row)
        os.close(fd)

    def unmap_stale(self, own_row: int) -> None:
        """Unmaps the stale mappings no other thread of this process copies through: a thread
        sets its busy flag before it checks the registration, so a thread that may still copy
        through a mapping has its flag set on that slot."""
        q, rows = self.ctrl.q, tuple(self.my_rows)  # tuple(set) is atomic under the GIL
        for m in self.stale[:]:
            if any(q[r + m.slot] for r in rows if r != own_row):
                continue
            try:
                self.stale.remove(m)  # atomic: of two threads here, one unmaps
            except ValueError:
                continue
            _release(m)

    def close(self) -> None:
        os.write(self.stop_w, b"x")
        self.thread.join(5.0)
        for m in [*self.mapped.values(), *self.stale]:  # no transfer of ours runs any more
            _release(m)
        self.mapped.clear()
        self.stale.clear()
        # Closing the row fds drops their OFD locks: the peer stops trusting those rows.
        with self.row_lock:
            rows, self.row_fds = self.row_fds, []
        for fd in (self.pidfd, self.stop_r, self.stop_w, *rows):
            os.close(fd)
        if self.mem_fd >= 0:
            os.close(self.mem_fd)
        self.ctrl.close()


@dataclasses.dataclass(frozen=True, slots=True)
class LocalRemoteBuffer(RemoteRange):
    """A descriptor of the local backend: where the owner's control table row and memory are."""

    _backend: ClassVar[str] = "local"
    _fields: ClassVar[dict[str, type]] = {**COMMON_FIELDS, "pid": int, "slot": int, "addr": int}

    pid: int
    """The owner's process (its pages are reached through a pidfd)."""
    slot: int
    """The registration's row in the owner's control table."""
    addr: int
    """The registered memory's address in the owner's address space."""


class LocalTransport(Backend):
    """Zero-copy transfers between processes of one host (Linux)."""

    name: ClassVar[str] = "local"
    remote_buffer_type: ClassVar[type[RemoteRange]] = LocalRemoteBuffer

    @staticmethod
    def supported() -> bool:
        return (
            sys.platform == "linux"
            and hasattr(os, "memfd_create")
            and hasattr(os, "pidfd_open")
            and Path("/proc/self/fd").is_dir()
        )

    def __init__(
        self, device: torch.device | str | None = None, *, config: TransportConfig | None = None
    ) -> None:
        super().__init__(device, config=config)
        fd = os.memfd_create(f"tether-ctrl-{self.instance_id}", os.MFD_CLOEXEC)
        cfg = self.config.local
        self._ctrl = _Control(fd, cfg.max_buffers, cfg.max_peers, create=True)
        q = self._ctrl.q
        q[0], q[1], q[2] = _MAGIC, 1, os.getpid()
        q[3], q[4], q[5] = cfg.max_buffers, cfg.max_peers, int(self.instance_id, 16)
        self._free = list(range(cfg.max_buffers - 1, -1, -1))
        self._remote: _Peer | None = None
        # Guards this process's busy counters; its acquire/release are the barriers that order a
        # busy-counter store before the following state load (see the module docstring).
        self._busy_lock = threading.Lock()

    # -- this side: the memory peers reach ------------------------------------------------------
    def _bind(self, deadline: float) -> bytes:
        return b"%s%s/%d/%d/%s" % (
            _SCHEME,
            _boot_id().encode(),
            os.getpid(),
            self._ctrl.fd,
            self.instance_id.encode(),
        )

    def _register(self, memory: RegisteredMemory) -> None:
        if memory.tensor.device.type != "cpu":
            raise TransportError("the local backend moves CPU memory only")
        if not self._free:
            raise TransportError(f"all {self._ctrl.max_buffers} registration slots are in use")
        start = -(-memory.ptr // _PAGE) * _PAGE
        end = (memory.ptr + memory.nbytes) // _PAGE * _PAGE
        map_len = max(end - start, 0)
        memfd = -1
        if map_len:
            memfd = os.memfd_create(f"tether-buf-{memory.id:x}", os.MFD_CLOEXEC)
            try:
                os.ftruncate(memfd, map_len)
                staging = _mem.map_fd(memfd, map_len)
                _mem.copy(staging, start, map_len)
                _mem.unmap(staging, map_len)
                _mem.map_fd(memfd, map_len, addr=start)  # the tensor's pages become shared
            except BaseException:
                os.close(memfd)
                raise
        slot = self._free.pop()
        q, base = self._ctrl.q, _HEADER + slot * _SLOT
        word = ((q[base] >> 1) + 1) << 1 | _ACTIVE
        q[base + 1] = memory.id
        q[base + 2] = int.from_bytes(memory.key[:8], "little")
        q[base + 3] = int.from_bytes(memory.key[8:], "little")
        q[base + 4], q[base + 5] = memory.ptr, memory.nbytes
        q[base + 6] = memfd & 0xFFFFFFFFFFFFFFFF
        q[base + 7], q[base + 8] = start, map_len
        q[base] = word  # published last: a peer never sees a half-written slot as active
        memory.state = _Reg(slot, word, memfd, start, map_len)

    def _descriptor_fields(self, memory: RegisteredMemory) -> dict[str, int | str | bytes]:
        return {"pid": os.getpid(), "slot": memory.state.slot, "addr": memory.ptr}

    def _unregister(self, memory: RegisteredMemory) -> None:
        reg: _Reg = memory.state
        q, base, ctrl = self._ctrl.q, _HEADER + reg.slot * _SLOT, self._ctrl
        q[base] = reg.word & ~_ACTIVE
        if _HAVE_MEMBARRIER:  # every peer thread's busy-flag store is now visible to our loads
            _mem.libc.syscall(_NR_MEMBARRIER, _MEMBARRIER_GLOBAL, 0, 0)
        else:
            with self._busy_lock:  # a full barrier on x86-64 (peers take it too)
                pass
        for peer in range(ctrl.max_peers):
            idx = ctrl.busy_base + peer * ctrl.max_buffers + reg.slot
            if q[idx]:
                if not _ofd_lock(ctrl.fd, ctrl.size + peer, test=True):
                    q[base] = reg.word
                    raise TransferInFlightError(f"a peer's transfer on {memory!r} is in flight")
                q[idx] = 0  # left by a peer that died mid-transfer
        self._revoke(reg)

    def _revoke(self, reg: _Reg) -> None:
        q, base = self._ctrl.q, _HEADER + reg.slot * _SLOT
        q[base] = (reg.word >> 1) + 1 << 1  # a new generation: stale descriptors never match
        if reg.map_len:
            # Back onto private pages: peers' mappings now point at an orphaned memfd.
            saved = torch.empty(reg.map_len, dtype=torch.uint8)
            _mem.copy(saved.data_ptr(), reg.map_start, reg.map_len)
            _mem.map_anonymous(reg.map_start, reg.map_len)
            _mem.copy(reg.map_start, saved.data_ptr(), reg.map_len)
            os.close(reg.memfd)
        self._free.append(reg.slot)

    # -- the peer's memory ------------------------------------------------------------------------
    def _connect(self, url: bytes, deadline: float) -> str:
        if not url.startswith(_SCHEME):
            raise DescriptorError(f"not a local transport URL: {url[:60]!r}")
        try:
            boot, pid_s, fd_s, instance = url[len(_SCHEME) :].decode().split("/")
            pid, fd, inst_id = int(pid_s), int(fd_s), int(instance, 16)
        except ValueError as exc:
            raise DescriptorError(f"malformed local transport URL: {url[:80]!r}") from exc
        if boot != _boot_id():
            raise TransportError(
                "the peer runs on another host (or VM); the local backend cannot reach it: "
                "use backend='tcp'"
            )
        try:
            ctrl_fd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise PeerDiedError(f"local transport peer process {pid} is gone") from exc
        except OSError as exc:
            raise TransportError(
                f"cannot open peer {pid}'s control block ({exc}); processes in different "
                "containers or users cannot use the local backend: use backend='tcp'"
            ) from exc
        try:
            head = os.pread(ctrl_fd, 48, 0)
            if len(head) != 48:
                raise DescriptorError("the URL does not name a live tether local transport")
            magic, _, owner, max_buffers, max_peers, inst = struct.unpack("<6Q", head)
            if magic != _MAGIC or owner != pid or inst != inst_id:
                raise DescriptorError("the URL does not name a live tether local transport")
            ctrl = _Control(ctrl_fd, max_buffers, max_peers, create=False)
        except BaseException:
            os.close(ctrl_fd)
            raise
        ctrl.fd_number = fd
        try:
            self._remote = _Peer(pid, ctrl)
        except BaseException as exc:
            ctrl.close()  # its mapping and fd
            if isinstance(exc, ProcessLookupError):
                raise PeerDiedError(f"local transport peer process {pid} is gone") from exc
            raise
        return instance

    def _map(self, peer: _Peer, buf: RemoteRange) -> _Mapped:
        """Checks a descriptor against the peer's table and maps its shared pages (once)."""
        own = cast(LocalRemoteBuffer, buf)  # _dispatch let only this backend's class through
        buf_id, buf_slot, key, size, addr = own.id, own.slot, own.key, own.size, own.addr
        q, ctrl = peer.ctrl.q, peer.ctrl
        if buf_slot >= ctrl.max_buffers:
            raise RemoteAccessError("peer refused: no such registration")
        base = _HEADER + buf_slot * _SLOT
        word = q[base]
        key_ok = q[base + 2] == int.from_bytes(key[:8], "little") and q[base + 3] == int.from_bytes(
            key[8:], "little"
        )
        if not word & _ACTIVE or q[base + 1] != buf_id or not key_ok:
            raise RemoteAccessError(_REFUSED)
        if q[base + 4] != addr or q[base + 5] != size:
            raise RemoteAccessError("peer refused: the descriptor does not match its registration")
        map_start, map_len, local = q[base + 7], q[base + 8], 0
        if map_len:
            try:
                fd = os.open(f"/proc/{peer.pid}/fd/{q[base + 6]}", os.O_RDWR | os.O_CLOEXEC)
            except OSError as exc:
                raise PeerDiedError(f"cannot map peer {peer.pid}'s buffer: {exc}") from exc
            try:
                local = _mem.map_fd(fd, map_len)
            finally:
                os.close(fd)
        if q[base] != word:  # unregistered meanwhile: the fd may have been another file
            if map_len:
                _mem.unmap(local, map_len)
            raise RemoteAccessError("peer refused: the buffer was unregistered")
        mv = _mem.ptr_memoryview(local, map_len) if map_len else memoryview(b"")
        m = _Mapped(
            addr=addr,
            state=base,
            word=word,
            local=local,
            map_start=map_start,
            map_len=map_len,
            key=key,
            size=size,
            slot=buf_slot,
            mv=mv,
        )
        # Another thread may have mapped it meanwhile: keep one mapping, drop ours (never leak it).
        got = peer.mapped.setdefault(buf_id, m)
        if got is not m:
            mv.release()
            if map_len:
                _mem.unmap(local, map_len)
        return got

    def _transfer(self, op: Op, pairs: list[Pair], deadline: float) -> None:
        # The hot path of small messages: a 16 B transfer is a few microseconds, most of it
        # interpreter, so everything here is a local or a slot, and nothing is looked up twice.
        peer = self._remote
        assert peer is not None
        if peer.dead:
            raise PeerDiedError(f"local transport peer process {peer.pid} has exited")
        claim = getattr(peer.rows, "claim", None)
        row = claim.row if claim is not None else peer.row()
        q, mapped = peer.ctrl.q, peer.mapped
        if peer.stale:
            peer.unmap_stale(row)
        for view, buf in pairs:
            m = mapped.get(buf.id) or self._map(peer, buf)
            busy = row + m.slot
            q[busy] = 1  # one writer per row: a plain store (see the module docstring)
            if not _HAVE_MEMBARRIER:
                with self._busy_lock:
                    pass
            try:
                word = q[m.state]
                if word != m.word:
                    if word >> 1 != m.word >> 1:  # a new generation: unregistered for good
                        self._forget(peer, buf.id, m, row)
                    # (Else the owner's unregister is under way, and may yet be refused: the
                    # mapping stays, as other threads may be copying through it.)
                    raise RemoteAccessError("peer refused: the buffer is (being) unregistered")
                if buf.key != m.key:
                    raise RemoteAccessError(_REFUSED)
                n, off = view.length, buf.offset
                if off < 0 or off + n > m.size:
                    # A RemoteRange built by hand (not deserialize/view): never address past the
                    # registration in the peer's memory.
                    raise RemoteAccessError(
                        f"range [{off}, {off + n}) is outside the peer's registration of "
                        f"{m.size} bytes"
                    )
                if n > _SMALL:
                    self._copy(op, peer.pid, m, view.ptr, m.addr + off, n)
                    continue
                local = view.memory.bytes_view
                if n != len(local):
                    local = local[view.offset : view.offset + n]
                at = off + m.addr - m.map_start
                if at >= 0 and at + n <= m.map_len:  # in shared pages: one memoryview copy
                    if op == "write":
                        m.mv[at : at + n] = local
                    else:
                        local[:] = m.mv[at : at + n]
                elif peer.mem_fd >= 0:
                    # (Partly) in a page the peer shares with other allocations: one
                    # pread/pwrite of /proc/PID/mem, a C call with no ctypes marshalling.
                    _proc_mem(op, peer, local, m.addr + off)
                else:
                    self._copy(op, peer.pid, m, view.ptr, m.addr + off, n)
            finally:
                q[busy] = 0
        if peer.dead:  # it died during the copy: the bytes may have gone nowhere
            raise PeerDiedError(f"local transport peer process {peer.pid} exited mid-transfer")

    @staticmethod
    def _forget(peer: _Peer, buf_id: int, m: _Mapped, row: int) -> None:
        """Drops a stale mapping. Several threads may find it stale at once: only the one that
        takes it out of the map queues it for unmapping (a second munmap could hit whatever was
        mapped there since), and it is unmapped once no other thread copies through it."""
        if peer.mapped.get(buf_id) is m and peer.mapped.pop(buf_id, None) is m:
            peer.stale.append(m)
        peer.unmap_stale(row)

    @staticmethod
    def _copy(op: Op, pid: int, m: _Mapped, local: int, remote: int, n: int) -> None:
        lo, hi = m.map_start, m.map_start + m.map_len
        if lo <= remote and remote + n <= hi:  # the common case: all in shared pages
            shared = m.local + (remote - lo)
            if op == "write":
                _mem.copy(shared, local, n)
            else:
                _mem.copy(local, shared, n)
            return
        head = min(max(lo - remote, 0), n) if m.map_len else n
        if head:
            _cma(op, pid, local, remote, head)
        mid = min(max(hi - (remote + head), 0), n - head) if m.map_len else 0
        if mid:
            shared = m.local + (remote + head - lo)
            if op == "write":
                _mem.copy(shared, local + head, mid)
            else:
                _mem.copy(local + head, shared, mid)
        tail = n - head - mid
        if tail:
            _cma(op, pid, local + head + mid, remote + head + mid, tail)

    def _close(self, deadline: float) -> None:
        if self._remote is not None:
            self._remote.close()
            self._remote = None
        for memory in list(self._memories.values()):
            self._revoke(memory.state)
        self._ctrl.close()


_ = time  # deadlines: every local copy is bounded by memory bandwidth; none can block
