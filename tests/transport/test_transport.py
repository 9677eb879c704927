"""The transport contract, run against every backend: fake in process, the others against a real
peer process (tests/workers/transport_peer.py) driven through a real TCPStore."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tether.transport as tt
from tests._jobs import WORKERS, new_store, worker_env
from tether._versions import TORCH_TRANSPORT
from tether.transport.fake import FakeRemoteBuffer, FakeTransport
from tether.transport.memory import RegisteredMemory
from tether.transport.tcp import TcpRemoteBuffer

pytestmark = pytest.mark.every_torch

BACKENDS = [
    "fake",
    "local",
    "tcp",
    pytest.param(
        "nixl",
        marks=pytest.mark.skipif("nixl" not in tt.supported_transports(), reason="no nixl"),
    ),
]


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class Peer:
    """The far side: a real process (or, for ``fake``, a transport in this process)."""

    def __init__(self, backend: str, store: dist.TCPStore) -> None:
        self.backend = backend
        self.store = dist.PrefixStore(f"t{uuid.uuid4().hex}/", store)
        self.n = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.transport = tt.new_transport(backend, config=tt.TransportConfig(timeout=20))
        if backend == "fake":
            self.inproc = FakeTransport()
            self.memories: dict[int, RegisteredMemory] = {}
            self.transport.connect(self.inproc.bind())
            self.inproc.connect(self.transport.bind())
            return
        prefix = self.store.prefix if hasattr(self.store, "prefix") else None
        self.prefix = prefix or f"p{uuid.uuid4().hex}/"
        self.store = dist.PrefixStore(self.prefix, store)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(WORKERS / "transport_peer.py"),
                "--backend",
                backend,
                "--port",
                str(store.port),
                "--prefix",
                self.prefix,
            ],
            env=worker_env(),
        )
        self.store.set("url/test", self.transport.bind())
        self.transport.connect(self.store.get("url/peer"))

    def call(self, op: str, **kw: Any) -> Any:
        if self.proc is None:
            return self._inproc(op, **kw)
        self.n += 1
        self.store.set(f"cmd/{self.n}", json.dumps({"op": op, **kw}))
        return json.loads(self.store.get(f"res/{self.n}"))

    def _inproc(self, op: str, **kw: Any) -> Any:
        if op == "register":
            m = self.inproc.register_memory(pattern(kw["nbytes"], kw["seed"]))
            self.memories[m.id] = m
            return m.to_remote_buffer().serialize().decode()
        if op == "digest":
            return digest(self.memories[kw["id"]].tensor)
        if op == "unregister":
            try:
                self.inproc.unregister_memory(self.memories[kw["id"]])
                return "ok"
            except tt.TransportError as exc:
                return f"{type(exc).__name__}: {exc}"
        raise AssertionError(op)

    def register(self, nbytes: int, seed: int = 0) -> tt.RemoteRange:
        return tt.RemoteRange.deserialize(self.call("register", nbytes=nbytes, seed=seed).encode())

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.call("exit")
                self.proc.wait(30)
        else:
            self.inproc.close()
        self.transport.close()


@pytest.fixture(scope="module")
def module_store() -> dist.TCPStore:
    return new_store()


@pytest.fixture(scope="module", params=BACKENDS)
def peer(request: pytest.FixtureRequest, module_store: dist.TCPStore) -> Iterator[Peer]:
    p = Peer(request.param, module_store)
    yield p
    p.close()


def local(t: tt.Transport, tensor: torch.Tensor) -> tt.Memory:
    return t.register_memory(tensor)


# -- the contract ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("nbytes", "dtype"),
    [
        (1, torch.uint8),
        (16, torch.float32),
        (4099, torch.uint8),
        (1 << 20, torch.bfloat16),
        (9 << 20, torch.int64),
    ],
)
def test_round_trip(peer: Peer, nbytes: int, dtype: torch.dtype) -> None:
    t = peer.transport
    remote = peer.register(nbytes + 8192, seed=nbytes)
    count = nbytes // torch.empty(0, dtype=dtype).element_size() or 1
    src = torch.randint(0, 100, (count,)).to(dtype)
    size = src.numel() * src.element_size()
    mem = t.register_memory(src)
    assert t.write(mem.to_view(), remote.view(100, size)) == 0
    back = torch.zeros_like(src)
    out = t.register_memory(back)
    assert t.read(out.to_mutable_view(), remote.view(100, size)) == 0
    assert torch.equal(back.view(torch.uint8), src.view(torch.uint8))
    # the bytes around the range are untouched
    edge = torch.empty(200, dtype=torch.uint8)
    em = t.register_memory(edge)
    t.read(em.to_mutable_view(0, 100), remote.view(0, 100))
    assert torch.equal(edge[:100], pattern(nbytes + 8192, nbytes)[:100])
    for m in (mem, out, em):
        t.unregister_memory(m)


@pytest.mark.timeout(60)
def test_batch_offsets_and_async(peer: Peer) -> None:
    t = peer.transport
    remote = peer.register(1 << 16, seed=1)
    a, b = torch.full((1000,), 7, dtype=torch.uint8), torch.full((3000,), 9, dtype=torch.uint8)
    ma, mb = t.register_memory(a), t.register_memory(b)
    work = t.write(
        [ma.to_view(), mb.to_view()], [remote.view(0, 1000), remote.view(5000, 3000)], async_op=True
    )
    assert isinstance(work, dist.Work)
    assert work.wait() is True and work.is_completed() and work.is_success()
    expected = pattern(1 << 16, 1)
    expected[:1000], expected[5000:8000] = 7, 9
    assert peer.call("digest", id=remote.id) == digest(expected)

    whole = torch.empty(1 << 16, dtype=torch.uint8)
    mw = t.register_memory(whole)

    async def go() -> None:
        await t.read_async(mw.to_mutable_view(), remote)

    asyncio.run(go())
    assert torch.equal(whole, expected)
    fut = t.read(mw.to_mutable_view(0, 10), remote.view(0, 10), async_op=True).get_future()
    assert fut.wait() == []  # torch 2.15's: an empty list on success


@pytest.mark.timeout(60)
def test_refusals(peer: Peer) -> None:
    t = peer.transport
    remote = peer.register(4096, seed=2)
    src = torch.ones(8192, dtype=torch.uint8)
    m = t.register_memory(src)
    with pytest.raises(tt.RemoteAccessError):  # checked here, before anything is sent
        remote.view(4000, 200)
    with pytest.raises(tt.RemoteAccessError):
        t.write(m.to_view(0, 5000), remote)
    # A forged descriptor claiming more than was registered: the owner refuses.
    forged = tt.RemoteRange.deserialize(
        remote.serialize()
        .replace(b'"length":4096', b'"length":8192')
        .replace(b'"size":4096', b'"size":8192')
    )
    with pytest.raises(tt.RemoteAccessError):
        t.write(m.to_view(0, 8192), forged)
    # nixl: refused by the initiator's check of the owner's table (see tether/transport/nixl.py)
    bad_key = dataclasses.replace(remote, key=bytes(16))
    with pytest.raises(tt.RemoteAccessError):
        t.write(m.to_view(0, 16), bad_key)
    # the peer is still serving
    t.write(m.to_view(0, 16), remote.view(0, 16))
    assert peer.call("unregister", id=remote.id) == "ok"
    with pytest.raises(tt.RemoteAccessError):
        t.write(m.to_view(0, 16), remote.view(0, 16))
    foreign = dataclasses.replace(remote, peer="0" * 16)
    with pytest.raises(tt.DescriptorError):
        t.write(m.to_view(0, 16), foreign)


@pytest.mark.timeout(60)
def test_unregister_refuses_while_in_flight(peer: Peer) -> None:
    t = peer.transport
    remote = peer.register(1 << 20, seed=3)
    src = torch.ones(1 << 20, dtype=torch.uint8)
    m = t.register_memory(src)
    t._hold = threading.Event()  # the async transfer starts only when we say
    try:
        work = t.write(m.to_view(), remote, async_op=True)
        with pytest.raises(tt.TransferInFlightError):
            t.unregister_memory(m)
        assert m.registered
    finally:
        t._hold.set()
        t._hold = None
    work.wait()
    t.unregister_memory(m)
    assert not m.registered
    assert peer.call("digest", id=remote.id) == digest(src)


@pytest.mark.timeout(30)
def test_owner_refuses_unregister_while_peer_transfers() -> None:
    """The owner's side of the rule (the fake backend can hold a transfer inside the owner)."""
    a, b = FakeTransport(), FakeTransport()
    a.connect(b.bind())
    b.connect(a.bind())
    owned = b.register_memory(torch.zeros(64, dtype=torch.uint8))
    src = a.register_memory(torch.ones(64, dtype=torch.uint8))
    a.hold_inside = threading.Event()
    work = a.write(src.to_view(), owned.to_remote_buffer(), async_op=True)
    while not owned.state:  # the transfer has marked the owner's memory
        time.sleep(0.001)
    with pytest.raises(tt.TransferInFlightError):
        b.unregister_memory(owned)
    a.hold_inside.set()
    work.wait()
    b.unregister_memory(owned)
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_local_owner_refuses_unregister_while_a_peer_row_is_busy() -> None:
    """The local backend's Dekker check: a live peer's busy flag blocks unregister; a dead one's
    (its row lock released) does not."""
    from tether.transport.local import _HEADER, _SLOT, LocalTransport

    owner, user = LocalTransport(), LocalTransport()
    user.connect(owner.bind())
    mem = owner.register_memory(torch.zeros(1 << 16, dtype=torch.uint8))
    remote = mem.to_remote_buffer()
    user.connect  # noqa: B018
    owner.connect(user.bind())
    src = user.register_memory(torch.ones(16, dtype=torch.uint8))
    user.write(src.to_view(), remote.view(0, 16))  # claims this thread's row
    peer = user._remote
    assert peer is not None
    row = peer.row()
    slot = mem.state.slot
    peer.ctrl.q[row + slot] = 1  # as if a copy were running
    with pytest.raises(tt.TransferInFlightError):
        owner.unregister_memory(mem)
    assert owner._ctrl.q[_HEADER + slot * _SLOT] & 1  # still active
    peer.ctrl.q[row + slot] = 0
    owner.unregister_memory(mem)
    with pytest.raises(tt.RemoteAccessError):
        user.write(src.to_view(), remote.view(0, 16))
    user.close()
    owner.close()


@pytest.mark.timeout(30)
def test_timeout_and_lifecycle() -> None:
    a, b = FakeTransport(), FakeTransport()
    with pytest.raises(tt.TransportError, match="connect"):
        a.write(a.register_memory(torch.ones(4)).to_view(), None)  # type: ignore[arg-type]
    a.connect(b.bind())
    owned = b.register_memory(torch.zeros(64, dtype=torch.uint8))
    src = a.register_memory(torch.ones(64, dtype=torch.uint8))
    a.hold_inside = threading.Event()
    with pytest.raises(tt.TransportTimeoutError):
        a.write(src.to_view(), owned.to_remote_buffer(), timeout=timedelta(milliseconds=50))
    work = a.write(src.to_view(), owned.to_remote_buffer(), async_op=True, timeout=30)
    with pytest.raises(tt.TransportTimeoutError):
        work.wait(timedelta(milliseconds=20))
    a.hold_inside.set()
    assert work.wait()
    with a:
        pass
    with pytest.raises(tt.TransportError, match="closed"):
        a.register_memory(torch.ones(4))
    b.close()


def close_in_thread(t: tt.Transport) -> tuple[threading.Thread, threading.Event]:
    """``t.close()`` on a thread, and an event set once it waits for the work in flight (its
    state is "closing" by then)."""
    waiting = threading.Event()
    await_idle = t._await_idle

    def signalled(deadline: float) -> None:
        waiting.set()
        await_idle(deadline)

    t._await_idle = signalled  # type: ignore[method-assign]
    closer = threading.Thread(target=t.close, kwargs={"timeout": 20})
    closer.start()
    return closer, waiting


@pytest.mark.timeout(30)
def test_close_refuses_new_transfers_while_it_waits() -> None:
    """close() waits for running transfers; one started meanwhile is refused, not run into the
    backend's teardown. A close() that times out leaves the transport usable."""
    a, b = FakeTransport(), FakeTransport()
    a.connect(b.bind())
    owned = b.register_memory(torch.zeros(64, dtype=torch.uint8))
    src = a.register_memory(torch.ones(64, dtype=torch.uint8))
    remote = owned.to_remote_buffer()
    a.hold_inside = threading.Event()
    work = a.write(src.to_view(), remote, async_op=True, timeout=30)
    with pytest.raises(tt.TransportTimeoutError, match="stays open"):
        a.close(timeout=0.05)
    assert a.connected()
    closer, waiting = close_in_thread(a)
    assert waiting.wait(10)
    for started in (
        lambda: a.write(src.to_view(), remote),
        lambda: a.read(src.to_mutable_view(), [remote]),
    ):
        with pytest.raises(tt.TransportError, match="closing"):
            started()
    a.hold_inside.set()
    assert work.wait()
    closer.join(20)
    assert not closer.is_alive() and not a.connected()
    b.close()


@pytest.mark.timeout(30)
def test_a_second_close_waits_for_the_first() -> None:
    """A close() that finds another under way returns only with its outcome; a close()
    interrupted while it waits leaves the transport open, not half closed."""
    a, b = FakeTransport(), FakeTransport()
    a.connect(b.bind())
    owned = b.register_memory(torch.zeros(64, dtype=torch.uint8))
    src = a.register_memory(torch.ones(64, dtype=torch.uint8))
    a.hold_inside = threading.Event()
    work = a.write(src.to_view(), owned.to_remote_buffer(), async_op=True, timeout=30)

    def interrupted(deadline: float) -> None:
        raise KeyboardInterrupt

    a._await_idle = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        a.close()
    del a._await_idle
    assert a.connected()
    second_waits = threading.Event()

    class Observed(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            second_waits.set()  # only a close() that finds another under way waits on it
            return super().wait(timeout)

    a._cv = Observed()
    first, first_waits = close_in_thread(a)
    assert first_waits.wait(10)
    second = threading.Thread(target=a.close, kwargs={"timeout": 20})
    second.start()
    assert second_waits.wait(10)  # not returned: waiting for the first's outcome
    with pytest.raises(tt.TransportError, match="closing"):
        a.register_memory(torch.ones(4))
    a.hold_inside.set()
    assert work.wait()
    for t in (first, second):
        t.join(20)
        assert not t.is_alive()
    assert not a.connected() and not src.registered
    b.close()


@pytest.mark.timeout(30)
def test_close_waits_for_a_registration_under_way() -> None:
    """A registration that started before close() is either revoked by it or never returned:
    close() waits for it, so the backend's teardown sees it."""
    entered, release = threading.Event(), threading.Event()

    class Slow(FakeTransport):
        def _register(self, memory: tt.Memory) -> None:
            entered.set()
            release.wait(20)
            super()._register(memory)

    a = Slow()
    got: list[tt.Memory] = []
    t = threading.Thread(target=lambda: got.append(a.register_memory(torch.ones(4))))
    t.start()
    assert entered.wait(10)
    with pytest.raises(tt.TransportTimeoutError, match="registration"):
        a.close(timeout=0.05)
    release.set()
    t.join(20)
    a.close(timeout=20)
    assert got and not got[0].registered


# -- a peer killed mid-transfer ---------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["local", "tcp", BACKENDS[-1]])
def test_peer_killed_mid_transfer(backend: str, module_store: dist.TCPStore) -> None:
    peer = Peer(backend, module_store)
    t = peer.transport
    remote = peer.register(64 << 20)
    src = t.register_memory(torch.ones(64 << 20, dtype=torch.uint8))
    assert peer.proc is not None
    if backend == "tcp":
        # A stopped peer reads nothing: the write below is surely in flight when it dies.
        os.kill(peer.proc.pid, signal.SIGSTOP)
    work = t.write(src.to_view(), remote, async_op=True, timeout=20)
    os.kill(peer.proc.pid, signal.SIGKILL)
    peer.proc.wait(10)
    started = time.monotonic()
    if backend == "tcp":
        with pytest.raises(tt.PeerDiedError):
            work.wait()
    else:
        with contextlib.suppress(tt.PeerDiedError):
            work.wait()  # a memcpy may have finished before the kill
    # Afterwards every transfer fails, clearly, long before its timeout.
    with pytest.raises(tt.PeerDiedError):
        while time.monotonic() - started < 15:
            t.write(src.to_view(0, 16), remote.view(0, 16), timeout=20)
    assert time.monotonic() - started < 15
    t.close()


# -- descriptors and frames ---------------------------------------------------------------------


def _good() -> bytes:
    a, _b = FakeTransport(), FakeTransport()
    a.bind()
    return a.register_memory(torch.ones(4)).to_remote_buffer().serialize()


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d[: len(d) // 2],
        lambda d: d.replace(b'"version":1', b'"version":2'),
        lambda d: d.replace(b'"version":1', b'"version":true'),
        lambda d: d.replace(b'"backend":"fake"', b'"backend":"nope"'),
        lambda d: d.replace(b'"size":16', b'"size":true'),
        lambda d: d.replace(b'"size":16', b'"size":-1'),
        lambda d: d.replace(b'"size":16', b'"size":16,"size":16'),
        lambda d: d.replace(b'"size":16', b'"size":16,"extra":1'),
        lambda d: d.replace(b'"length":16,', b""),
        lambda d: d.replace(b'"offset":0', b'"offset":8'),
        lambda d: b"\x80\x04" + d,
        lambda d: b"[]",
        lambda d: b"x" * 100_000,
    ],
)
def test_malformed_descriptors_are_rejected(mutate: Any) -> None:
    with pytest.raises(tt.DescriptorError):
        tt.RemoteRange.deserialize(mutate(_good()))


def test_descriptor_round_trip_and_backend_check() -> None:
    data = _good()
    rb = tt.RemoteRange.deserialize(data)
    assert rb.serialize() == data and len(rb.key) == 16
    assert type(rb) is FakeRemoteBuffer and FakeRemoteBuffer.deserialize(data) == rb
    with pytest.raises(tt.DescriptorError, match="different backend"):
        TcpRemoteBuffer.deserialize(data)  # a backend's class takes its own descriptors only
    with pytest.raises(TypeError):
        tt.RemoteRange.deserialize(data.decode())  # type: ignore[arg-type]  # bytes, as torch


@pytest.mark.timeout(30)
def test_tcp_malformed_frames_close_only_that_connection() -> None:
    import socket

    from tether.transport.tcp import _HELLO, _MAGIC, _parse_url

    owner, user = tt.new_transport("tcp"), tt.new_transport("tcp")
    url = owner.bind()
    user.connect(url)
    mem = owner.register_memory(torch.zeros(64, dtype=torch.uint8))
    host, port, _, token, _ = _parse_url(url)
    for junk in (
        b"GET / HTTP/1.1\r\n\r\n" * 4,
        _HELLO.pack(_MAGIC, 1, token) + b"\xff" * 48,
        _HELLO.pack(_MAGIC, 1, bytes(16)),
    ):
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            while s.recv(4096):  # the owner closes it
                pass
    src = user.register_memory(torch.full((64,), 5, dtype=torch.uint8))
    user.write(src.to_view(), mem.to_remote_buffer())
    assert bool(mem.tensor.eq(5).all())
    user.close()
    owner.close()


def test_tcp_server_forgets_finished_connections() -> None:
    """Peers that come and go must not leave one thread record each on a long-lived owner."""
    import socket

    from tether.transport.tcp import _parse_url

    owner = tt.new_transport("tcp")
    host, port, *_ = _parse_url(owner.bind())
    for _ in range(20):
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(b"junk" * 16)
            s.shutdown(socket.SHUT_WR)
            while s.recv(4096):  # the owner closes it: its connection thread ends
                pass
    with socket.create_connection((host, port), timeout=10) as s:  # one more accept prunes
        s.sendall(b"junk" * 16)
        s.shutdown(socket.SHUT_WR)
        while s.recv(4096):
            pass
    assert len(owner._threads) < 20, [t.name for t in owner._threads]  # type: ignore[attr-defined]
    owner.close()


def test_tcp_owner_refuses_unregister_while_a_request_is_served() -> None:
    """The tcp owner's side: a write whose payload is still arriving holds its registration."""
    import socket

    from tether.transport.tcp import _HELLO, _MAGIC, _REQ, _RESP, _parse_url

    owner = tt.new_transport("tcp", config=tt.TransportConfig(timeout=10))
    url = owner.bind()
    mem = owner.register_memory(torch.zeros(1 << 20, dtype=torch.uint8))
    host, port, _, token, _ = _parse_url(url)
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(_HELLO.pack(_MAGIC, 1, token))
        assert s.recv(1) == b"\x00"
        s.sendall(_REQ.pack(1, 7, mem.id, mem.key, 0, 1 << 20) + b"\x01" * 1000)
        deadline = time.monotonic() + 10
        while not owner._regs[mem.id].flights:  # type: ignore[attr-defined]  # being served
            assert time.monotonic() < deadline, "the owner never started serving the write"
            time.sleep(0.001)
        with pytest.raises(tt.TransferInFlightError):
            owner.unregister_memory(mem)
        s.sendall(b"\x01" * ((1 << 20) - 1000))
        status, seq, _ = _RESP.unpack(s.recv(_RESP.size, socket.MSG_WAITALL))
        assert (status, seq) == (0, 7)
    owner.unregister_memory(mem)
    assert bool(mem.tensor.eq(1).all())
    owner.close()


def test_tcp_sync_transfers_are_framed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A single synchronous transfer larger than a frame is cut into frames the owner accepts."""
    from tether.transport import tcp

    monkeypatch.setattr(tcp, "_MAX_FRAME", 1 << 20)
    cfg = tt.TransportConfig(frame_bytes=256 << 10, flows=2)
    owner, user = tt.new_transport("tcp", config=cfg), tt.new_transport("tcp", config=cfg)
    user.connect(owner.bind())
    remote = owner.register_memory(torch.zeros(3 << 20, dtype=torch.uint8))
    src = pattern(3 << 20, 3)
    back = torch.zeros_like(src)
    s, b = user.register_memory(src), user.register_memory(back)
    user.write(s.to_view(), remote.to_remote_buffer())
    assert torch.equal(remote.tensor, src)
    user.read(b.to_mutable_view(), remote.to_remote_buffer())
    assert torch.equal(back, src)
    for n in (1, 16, 4099, 70000):  # the lock-step path and the framed one, both directions
        user.write(s.to_view(n, n), remote.to_remote_buffer().view(0, n))
        user.read(b.to_mutable_view(0, n), remote.to_remote_buffer().view(0, n))
        assert torch.equal(back[:n], src[n : 2 * n])
    user.close()
    owner.close()


def test_registry_and_config() -> None:
    assert {"fake", "local", "tcp"} <= set(tt.available_transports())
    with pytest.raises(tt.BackendUnavailableError):
        tt.new_transport("nope")
    with pytest.raises(tether_config_error()):
        tt.TransportConfig(host="0.0.0.0")

    class Mine(FakeTransport):
        name = "mine"

    tt.register_transport("mine", Mine)
    assert isinstance(tt.new_transport("mine"), Mine)
    assert all(hasattr(tt, name) for name in tt.__all__)


def tether_config_error() -> type[Exception]:
    from tether import ConfigError

    return ConfigError


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
@pytest.mark.skipif(TORCH_TRANSPORT, reason="tether's stream variants; 2.15's are torch's")
def test_stream_variants_need_cuda() -> None:
    a, b = FakeTransport(), FakeTransport()
    a.connect(b.bind())
    mem = b.register_memory(torch.zeros(4))
    src = a.register_memory(torch.ones(4))
    with pytest.raises(tt.BackendUnavailableError, match="CUDA"):
        a.write_stream(src.to_view(), mem.to_remote_buffer())


@pytest.mark.timeout(60)
def test_bootstrap_pair_over_a_store(module_store: dist.TCPStore) -> None:
    name = f"b{uuid.uuid4().hex}/"
    out: dict[int, tt.Transport] = {}

    def side(rank: int) -> None:
        # One store client per rank: a TCPStore client serialises its calls, as two ranks do not.
        client = dist.TCPStore("127.0.0.1", module_store.port, is_master=False)
        out[rank] = tt.new_transport_rank(
            "auto",
            store=dist.PrefixStore(name, client),
            rank=rank,
            peer_rank=1 - rank,
            bootstrap_timeout=30,
        )

    threads = [threading.Thread(target=side, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(40)
    assert out[0].name == out[1].name == "local"
    mem = out[1].register_memory(torch.zeros(8))
    src = out[0].register_memory(torch.arange(8.0))
    out[0].write(src.to_view(), mem.to_remote_buffer())
    assert torch.equal(mem.tensor, torch.arange(8.0))
    for t in out.values():
        t.close()


def test_nixl_missing_gives_an_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.transport import nixl

    monkeypatch.setattr(nixl, "_find", lambda: None)
    assert not nixl.NixlTransport.supported()
    with pytest.raises(tt.BackendUnavailableError, match=r"pip install 'tether\[nixl\]'"):
        nixl.NixlTransport()


@pytest.mark.parametrize("junk", [b"[" * 5000, b'{"backend":"fake","version":' + b"[" * 5000])
def test_deeply_nested_descriptors_are_rejected(junk: bytes) -> None:
    """json's recursion limit surfaces as RecursionError: still a DescriptorError."""
    with pytest.raises(tt.DescriptorError):
        tt.RemoteRange.deserialize(junk)
    from tether.transport import descriptor

    with pytest.raises(tt.DescriptorError):
        descriptor.decode(junk, lambda backend: {})


@pytest.mark.timeout(30)
@pytest.mark.parametrize("op", ["write", "read"])
def test_tcp_peer_stalling_mid_reply_times_out(op: str) -> None:
    """The lock-step path: a peer that sends part of a reply and stalls must not hang the caller
    past its timeout."""
    import socket

    from tether.transport.tcp import _HELLO, _REQ, _RESP

    token = os.urandom(16)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    release = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(_HELLO.size, socket.MSG_WAITALL)
            conn.sendall(b"\x00")
            req = conn.recv(_REQ.size, socket.MSG_WAITALL)
            _, seq, *_ = _REQ.unpack(req)
            if op == "write":
                conn.recv(16, socket.MSG_WAITALL)
                conn.sendall(_RESP.pack(0, seq, 0)[:8])  # half a reply header
            else:
                conn.sendall(_RESP.pack(0, seq, 16) + b"\x01" * 4)  # a quarter of the payload
            release.wait(30)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    user = tt.new_transport("tcp", config=tt.TransportConfig(timeout=10, flows=1))
    user.connect(f"tcp://127.0.0.1:{port}?flows=1&token={token.hex()}&id=feed")
    mem = user.register_memory(torch.zeros(16, dtype=torch.uint8))
    remote = TcpRemoteBuffer(peer="feed", id=1, key=bytes(16), size=16, offset=0, length=16)
    start = time.monotonic()
    with pytest.raises(tt.TransportTimeoutError):
        if op == "write":
            user.write(mem.to_view(), remote, timeout=1.0)
        else:
            user.read(mem.to_mutable_view(), remote, timeout=1.0)
    assert time.monotonic() - start < 5
    release.set()
    thread.join(10)
    listener.close()
    user.close()


@pytest.mark.timeout(30)
def test_local_refuses_a_hand_built_buffer_past_the_registration() -> None:
    """The local backend addresses the peer's memory directly: a RemoteBuffer not made by
    deserialize()/view() (offset past the registration) must be refused, not written."""
    import dataclasses

    from tether.transport.local import LocalTransport

    owner, user = LocalTransport(), LocalTransport()
    user.connect(owner.bind())
    owner.connect(user.bind())
    guard = torch.zeros(1 << 16, dtype=torch.uint8)
    mem = owner.register_memory(guard[4096:8192])
    src = user.register_memory(torch.full((64,), 7, dtype=torch.uint8))
    remote = mem.to_remote_buffer()
    for offset in (4096 - 8, -8):
        bad = dataclasses.replace(remote, offset=offset)
        with pytest.raises(tt.RemoteAccessError):
            user.write(src.to_view(0, 16), bad)
    assert not bool(guard.any())
    user.close()
    owner.close()


@pytest.mark.timeout(30)
def test_local_stale_mapping_found_by_two_threads_is_unmapped_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two transfers that both hold a mapping of a buffer unregistered meanwhile: both are
    refused, and only one of them unmaps it."""
    from tether.transport import _mem, local

    owner, user = local.LocalTransport(), local.LocalTransport()
    user.connect(owner.bind())
    owner.connect(user.bind())
    mem = owner.register_memory(torch.zeros(1 << 16, dtype=torch.uint8))
    remote = mem.to_remote_buffer()
    src = user.register_memory(torch.ones(16, dtype=torch.uint8))
    user.write(src.to_view(), remote.view(0, 16))  # maps it
    peer = user._remote
    assert peer is not None
    stale = peer.mapped[remote.id]
    owner.unregister_memory(mem)

    class Racing(dict):  # type: ignore[type-arg]
        """The second thread looked the mapping up before the first dropped it."""

        def get(self, key: Any, default: Any = None) -> Any:
            return stale if key == remote.id else super().get(key, default)

    unmapped: list[int] = []
    real_unmap = _mem.unmap
    monkeypatch.setattr(_mem, "unmap", lambda a, n: (unmapped.append(a), real_unmap(a, n)))
    peer.mapped = Racing(peer.mapped)
    for _ in range(2):
        with pytest.raises(tt.RemoteAccessError):
            user.write(src.to_view(), remote.view(0, 16))
    assert unmapped == [stale.local]
    peer.mapped = dict(peer.mapped)
    user.close()
    owner.close()


@pytest.mark.timeout(30)
def test_local_rows_of_finished_threads_are_given_back() -> None:
    """Each transferring thread holds a row of the owner's busy flags; threads that end must
    give theirs back, or short-lived threads use up the owner's max_peers."""
    import threading

    from tether.transport.local import LocalTransport

    owner = LocalTransport(config=tt.TransportConfig(max_peers=2))
    user = LocalTransport()
    user.connect(owner.bind())
    owner.connect(user.bind())
    mem = owner.register_memory(torch.zeros(1 << 16, dtype=torch.uint8))
    src = user.register_memory(torch.full((1 << 16,), 3, dtype=torch.uint8))
    errors: list[BaseException] = []

    def one_write() -> None:
        try:
            user.write(src.to_view(), mem.to_remote_buffer())
        except BaseException as exc:
            errors.append(exc)

    for _ in range(6):  # three times the owner's rows, one thread after another
        t = threading.Thread(target=one_write)
        t.start()
        t.join(20)
    assert not errors, errors
    assert bool(mem.tensor.eq(3).all())
    user.close()
    owner.close()


def test_tcp_busy_poll_backs_off_when_it_does_not_pay() -> None:
    """A reply that comes while the caller polls is taken without sleeping; a window that runs
    out makes the next 1, 2, 4 ... waits sleep at once (on an oversubscribed machine spinning
    takes the core the peer needs); a hit ends the back-off; 0 never polls."""
    from tether.transport.tcp import _Spin, _wait_readable

    calls: list[float] = []

    def poll_with(ready_after: int | None) -> Any:
        def poll(timeout: float) -> list[tuple[int, int]]:
            calls.append(timeout)
            if ready_after is not None and len(calls) > ready_after:
                return [(3, 1)]
            return [] if timeout == 0 else [(3, 1)]  # a sleeping poll gets the reply

        return poll

    far = time.monotonic() + 30
    spin = _Spin(0.0005)
    _wait_readable(poll_with(3), far, spin)  # the reply comes on the fourth poll
    assert calls[-1] == 0 and all(c == 0 for c in calls) and spin.backoff == 0
    for expected_skip in (1, 2, 4):
        calls.clear()
        _wait_readable(poll_with(None), far, spin)  # never comes while polling: a miss
        assert calls[0] == 0 and calls[-1] > 0
        assert spin.skip == expected_skip
        for _ in range(expected_skip):  # the waits that follow sleep at once
            calls.clear()
            _wait_readable(poll_with(None), far, spin)
            assert calls and all(c > 0 for c in calls)
    calls.clear()
    _wait_readable(poll_with(0), far, spin)  # polls again, and a hit resets the back-off
    assert calls == [0] and spin.backoff == 0 and spin.skip == 0
    calls.clear()
    _wait_readable(poll_with(None), far, _Spin(0.0))
    assert calls and all(c > 0 for c in calls)
    with pytest.raises(TimeoutError):
        _wait_readable(lambda timeout: [], time.monotonic() + 0.01, _Spin(0.0))


def test_tcp_server_idle_receive_polls_then_blocks() -> None:
    """The server's wait for the next request: a request already there is taken while polling;
    one that comes only later is taken by the blocking receive that follows a missed window;
    a peer that closed ends the connection."""
    import socket

    from tether.transport.tcp import _Closed, _recv_idle, _Spin

    a, b = socket.socketpair()
    buf = memoryview(bytearray(64))
    spin = _Spin(0.0005)
    b.send(b"req")
    assert _recv_idle(a.recv_into, buf, spin) == 3 and spin.backoff == 0
    blocking: list[int] = []

    def recv_into(into: memoryview, n: int = 0, flags: int = 0) -> int:
        if not flags:  # the blocking receive: only now does the request come
            blocking.append(1)
            b.send(b"late")
        return a.recv_into(into, n, flags)

    assert _recv_idle(recv_into, buf, spin) == 4
    assert blocking == [1] and spin.skip == 1
    b.close()
    with pytest.raises(_Closed):
        _recv_idle(a.recv_into, buf, spin)
    a.close()


def test_busy_poll_config_is_bounded() -> None:
    assert tt.TransportConfig(busy_poll_us=0).busy_poll_us == 0
    for bad in (-1, 100_001):
        with pytest.raises(tether_config_error(), match="busy_poll_us"):
            tt.TransportConfig(busy_poll_us=bad)


def test_config_nests_one_sub_config_per_backend() -> None:
    """Each backend reads its own frozen sub-config; the flat keywords and attributes of before
    still work, laid over a sub-config given (``max_buffers`` is both local's and nixl's)."""
    import dataclasses

    from tether.transport.config import LocalConfig, TcpConfig
    from tether.transport.local import LocalTransport

    cfg = tt.TransportConfig(flows=2, max_buffers=8, nixl_progress_us=5)
    assert cfg.tcp == TcpConfig(flows=2) and cfg.flows == 2 and cfg.nixl.progress_us == 5
    assert cfg.local.max_buffers == cfg.nixl.max_buffers == cfg.max_buffers == 8
    assert tt.TransportConfig(tcp=TcpConfig(flows=2), port=5).tcp == TcpConfig(flows=2, port=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tcp.flows = 3  # type: ignore[misc]
    cfg.flows = 3  # replaces the sub-config, checked again
    assert cfg.tcp.flows == 3
    with pytest.raises(tether_config_error(), match=r"tcp\.flows"):
        cfg.flows = 0
    assert dataclasses.replace(cfg, timeout=5) == tt.TransportConfig(
        timeout=5, tcp=cfg.tcp, local=cfg.local, nixl=cfg.nixl
    )
    with pytest.raises(TypeError):
        tt.TransportConfig(tcp=LocalConfig())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        LocalTransport(LocalConfig())  # type: ignore[arg-type]


def test_wrong_arguments_are_value_or_type_errors() -> None:
    """ConfigError names a setting to change; a wrong argument to a call is a plain ValueError
    or TypeError, and memory in the wrong state a TransportError."""
    a, b = FakeTransport(), FakeTransport()
    a.connect(b.bind())
    b.connect(a.bind())
    mem = a.register_memory(torch.zeros(8))
    remote = b.register_memory(torch.zeros(8)).to_remote_buffer()
    calls: list[tuple[type[Exception], Any]] = [
        (TypeError, lambda: a.register_memory([1.0, 2.0])),
        (ValueError, lambda: a.register_memory(torch.zeros(4, 4).t())),
        (ValueError, lambda: a.register_memory(torch.zeros(0))),
        (ValueError, lambda: mem.to_view(4, 100)),
        (TypeError, lambda: a.read(mem.to_view(), remote)),  # a read needs a mutable view
        (ValueError, lambda: a.write([mem.to_view()], [])),
        (ValueError, lambda: a.write(mem.to_view(), remote, timeout=-1)),
        (ValueError, lambda: b.unregister_memory(mem)),
    ]
    for kind, call in calls:
        with pytest.raises(kind) as info:
            call()
        assert not isinstance(info.value, tether_config_error()), info.value
    a.unregister_memory(mem)
    with pytest.raises(tt.TransportError, match="not registered"):
        a.write(mem.to_view(), remote)
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_local_refuses_a_wrong_key_on_a_mapped_buffer() -> None:
    """Once a buffer is mapped, later transfers skip the peer's table: they must still check the
    key, or a descriptor with a guessed id and any key would pass."""
    import dataclasses

    from tether.transport.local import LocalTransport

    owner, user = LocalTransport(), LocalTransport()
    user.connect(owner.bind())
    owner.connect(user.bind())
    target = torch.zeros(1 << 16, dtype=torch.uint8)
    mem = owner.register_memory(target)
    src = user.register_memory(torch.full((16,), 9, dtype=torch.uint8))
    remote = mem.to_remote_buffer()
    user.write(src.to_view(), remote.view(8192, 16))  # maps it
    forged = dataclasses.replace(remote, key=bytes(16))
    with pytest.raises(tt.RemoteAccessError, match="key"):
        user.write(src.to_view(), forged.view(0, 16))
    assert int(target[:16].sum()) == 0 and int(target[8192:8208].sum()) == 9 * 16
    user.close()
    owner.close()


@pytest.mark.timeout(30)
def test_local_keeps_a_stale_mapping_while_another_thread_copies_through_it() -> None:
    """A registration seen gone must not be unmapped under another thread's copy (a crash of
    this process): the owner's unregister merely under way (active bit cleared, same
    generation) keeps the mapping; a revoked one (owner closed) is unmapped only once no other
    thread of this process has its busy flag on it."""
    from tether.transport.local import _HEADER, _SLOT, LocalTransport

    owner, user = LocalTransport(), LocalTransport()
    user.connect(owner.bind())
    owner.connect(user.bind())
    mem = owner.register_memory(torch.zeros(1 << 16, dtype=torch.uint8))
    remote = mem.to_remote_buffer().view(8192, 16)
    src = user.register_memory(torch.ones(16, dtype=torch.uint8))
    user.write(src.to_view(), remote)  # maps it
    peer = user._remote
    assert peer is not None
    m = peer.mapped[remote.id]
    state = _HEADER + mem.state.slot * _SLOT
    word = owner._ctrl.q[state]
    owner._ctrl.q[state] = word & ~1  # an unregister under way
    with pytest.raises(tt.RemoteAccessError):
        user.write(src.to_view(), remote)
    assert peer.mapped.get(remote.id) is m and not peer.stale
    owner._ctrl.q[state] = word  # ... and refused: transfers go on through the same mapping
    user.write(src.to_view(), remote)

    claimed, done = threading.Event(), threading.Event()
    rows: list[int] = []

    def other_thread() -> None:  # claims a row of its own and keeps it
        rows.append(peer.row())
        claimed.set()
        done.wait(20)

    t = threading.Thread(target=other_thread)
    t.start()
    assert claimed.wait(10)
    busy = rows[0] + m.slot
    peer.ctrl.q[busy] = 1  # as if that thread were copying through the mapping
    owner.close()  # revokes without looking at busy flags: a new generation
    with pytest.raises(tt.RemoteAccessError):
        user.write(src.to_view(), remote)
    at = 8192 + m.addr - m.map_start
    assert peer.stale == [m] and bytes(m.mv[at : at + 16]) == b"\x01" * 16  # still mapped
    peer.ctrl.q[busy] = 0  # that copy ended
    with pytest.raises(tt.RemoteAccessError):
        user.write(src.to_view(), remote)
    assert not peer.stale
    with pytest.raises(ValueError, match="released"):
        m.mv[0]
    done.set()
    t.join(10)
    user.close()


@pytest.mark.timeout(30)
@pytest.mark.skipif(TORCH_TRANSPORT, reason="a tether-only extension: torch 2.15 takes seconds")
def test_async_variants_take_a_timedelta_too() -> None:
    a, b = FakeTransport(), FakeTransport()
    a.connect(b.bind())
    owned = b.register_memory(torch.zeros(8))
    src = a.register_memory(torch.arange(8.0))
    asyncio.run(
        a.write_async(src.to_view(), owned.to_remote_buffer(), timeout=timedelta(seconds=5))
    )
    assert torch.equal(owned.tensor, torch.arange(8.0))
    a.close()
    b.close()


def test_an_installed_entry_point_takes_a_short_name_never_a_tether_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.15 installs its own ``nixl`` entry point: tether's registry then gives torch's
    backend for ``nixl``, as torch's registry does, and tether's stays ``tether-nixl``."""
    from importlib import metadata

    from tether.transport import registry

    group = registry.ENTRY_POINT_GROUP
    installed = [
        metadata.EntryPoint("nixl", "tether.transport.fake:FakeTransport", group),  # "torch's"
        metadata.EntryPoint("tether-nixl", "tests.not_a_module:Nothing", group),
        metadata.EntryPoint("tether-tcp", "tether.transport.tcp:TcpTransport", group),  # ours
    ]
    monkeypatch.setattr(
        registry.metadata,
        "entry_points",
        lambda group: installed if group == registry.ENTRY_POINT_GROUP else [],
    )
    monkeypatch.setattr(registry, "_registered_transports", {})
    names = [ep.name for ep in registry._iter_entry_points()]
    assert sorted(names) == sorted(
        ["fake", "local", "tcp", "tether-local", "tether-tcp", "tether-nixl", "nixl", "tether-nixl"]
    )
    assert type(tt.new_transport("nixl")) is FakeTransport  # the installed one
    with pytest.raises(
        RuntimeError, match="multiple entry points registered transport 'tether-nixl'"
    ):
        tt.new_transport("tether-nixl")  # a plugin claiming a tether- name is not hidden
    assert type(tt.new_transport("tether-tcp")).__name__ == "TcpTransport"
