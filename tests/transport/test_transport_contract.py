"""torch 2.15's ``torch.distributed._transport`` contract, run against ``tether.transport`` and,
where the installed torch has it (2.15+), against torch's own module: the same program, the same
outcomes. Written from torch 2.15's release source: signatures, registry, descriptors, works and
their timeouts, asyncio cancellation, bootstrap keys.

Each implementation is reached through a small table (``Impl``): its public module, its registry
module (whose ``_registered_transports`` and ``_iter_entry_points`` the registry tests replace, so
that neither tether's built-ins nor installed entry points take part), the module where its
``Transport`` looks up ``wait_all``, and its descriptor framing class.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import inspect
import json
import math
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import ModuleType, SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from tests._jobs import new_store

pytestmark = pytest.mark.every_torch


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    api: ModuleType
    registry: ModuleType
    wire: type
    """The base class that frames a backend's descriptor (torch's ``_WireDescriptor``)."""

    @property
    def transport_home(self) -> str:
        """The module whose ``wait_all`` Transport's asyncio methods call."""
        return self.api.Transport.__module__


def _tether() -> Impl:
    import tether.transport as api
    from tether.transport import descriptor, registry

    return Impl("tether", api, registry, descriptor.WireDescriptor)


def _torch() -> Impl:
    try:
        api = importlib.import_module("torch.distributed._transport")
    except ImportError:
        pytest.skip(f"torch {torch.__version__} has no torch.distributed._transport (2.15+)")
    registry = importlib.import_module("torch.distributed._transport._registry")
    wire = importlib.import_module("torch.distributed._transport._serialization")._WireDescriptor
    return Impl("torch", api, registry, wire)


@pytest.fixture(params=["tether", "torch"])
def impl(request: pytest.FixtureRequest) -> Impl:
    return _tether() if request.param == "tether" else _torch()


class _EntryPoint:
    """What the registry reads of an installed entry point."""

    def __init__(self, name: str, value: Any) -> None:
        self.name, self.value = name, value

    def load(self) -> Any:
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


@pytest.fixture
def registry(impl: Impl) -> Iterator[Callable[..., Any]]:
    """An empty registry (no registrations, no entry points); the fixture's value installs a
    given list of entry points for the rest of the test."""
    points: list[_EntryPoint] = []
    with (
        mock.patch.dict(impl.registry._registered_transports, clear=True),
        mock.patch.object(impl.registry, "_iter_entry_points", side_effect=lambda: iter(points)),
    ):

        def install(*entry_points: _EntryPoint) -> None:
            points[:] = entry_points

        yield install


def _transport_class(api: ModuleType) -> type:
    """A minimal backend of ``api``'s Transport: what a third party writes for torch 2.15."""

    class Minimal(api.Transport):  # type: ignore[misc, name-defined]
        is_supported = True
        instances: list[Any] = []

        def __init__(self, device: Any = None, *, value: Any = None) -> None:
            super().__init__(device)
            self.value = value
            self.closed = False
            self.urls: list[bytes] = []
            Minimal.instances.append(self)

        @staticmethod
        def supported() -> bool:
            return Minimal.is_supported

        def bind(self, *, timeout: float | None = None) -> bytes:
            return f"minimal://{id(self)}".encode()

        def connect(self, peer_url: bytes, *, timeout: float | None = None) -> int:
            self.urls.append(peer_url)
            return 0

        def connected(self) -> bool:
            return bool(self.urls)

        def register_memory(self, tensor: torch.Tensor, *, timeout: float | None = None) -> Any:
            return tensor

        def write(self, local_buffer: Any, remote_buffer: Any, **kw: Any) -> Any:
            return _done_work() if kw.get("async_op") else 0

        def read(self, local_buffer: Any, remote_buffer: Any, **kw: Any) -> Any:
            return _done_work() if kw.get("async_op") else 0

        def close(self, *, timeout: float | None = None) -> None:
            self.closed = True

    return Minimal


def _done_work(error: Exception | None = None) -> dist.Work:
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result([])
    if error is not None:
        # A failed callback: an error c10d's future-backed work keeps (one set with
        # set_exception() before wrapping is lost by _create_work_from_future).
        def fail(_: Any) -> None:
            raise error

        future = future.then(fail)
    return torch._C._distributed_c10d._create_work_from_future(future)


def _pending_work() -> tuple[dist.Work, torch.futures.Future[Any]]:
    future: torch.futures.Future[Any] = torch.futures.Future()
    return torch._C._distributed_c10d._create_work_from_future(future), future


# -- names and signatures ---------------------------------------------------------------------

EXPORTS = {
    "Memory",
    "MemoryView",
    "MutableMemoryView",
    "RemoteBuffer",
    "Transport",
    "Work",
    "available_transports",
    "new_transport",
    "new_transport_rank",
    "register_transport",
    "wait_all",
}

SIGNATURES = {
    "new_transport": "(backend, device=None, **kwargs)",
    "new_transport_rank": (
        "(backend, device=None, *, store=None, peer_rank, rank=None, bootstrap_timeout=30.0, "
        "**kwargs)"
    ),
    "register_transport": "(name, factory, *, replace=False)",
    "available_transports": "()",
    "wait_all": "(works, *, timeout=None)",
}

METHODS = {
    "bind": "(self, *, timeout=None)",
    "connect": "(self, peer_url, *, timeout=None)",
    "register_memory": "(self, tensor, *, timeout=None)",
    "unregister_memory": "(self, memory, *, timeout=None)",
    "write": "(self, local_buffer, remote_buffer, *, async_op=False, timeout=None)",
    "read": "(self, local_buffer, remote_buffer, *, async_op=False, timeout=None)",
    "write_stream": "(self, local_buffer, remote_buffer, *, stream=None, timeout=None)",
    "read_stream": "(self, local_buffer, remote_buffer, *, stream=None, timeout=None)",
    "write_async": "(self, local_buffer, remote_buffer, *, timeout=None)",
    "read_async": "(self, local_buffer, remote_buffer, *, timeout=None)",
    "close": "(self, *, timeout=None)",
    "close_async": "(self, *, timeout=None)",
}


def _shape(fn: Any) -> str:
    """A signature without annotations: names, kinds and defaults."""
    sig = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def test_exports_and_signatures(impl: Impl) -> None:
    assert set(impl.api.__all__) >= EXPORTS
    assert impl.api.Work is dist.Work
    for name, shape in SIGNATURES.items():
        assert _shape(getattr(impl.api, name)) == shape, name
    assert inspect.iscoroutinefunction(impl.api.wait_all)
    for name, shape in METHODS.items():
        assert _shape(getattr(impl.api.Transport, name)) == shape, name
    abstract = impl.api.Transport.__abstractmethods__
    assert abstract == {
        "supported",
        "bind",
        "connect",
        "connected",
        "register_memory",
        "write",
        "read",
        "close",
    }


def test_tethers_backends_have_2_15_signatures() -> None:
    """tether's backends keep the base's signatures (their extras are keyword-only)."""
    import tether.transport as tt
    from tether.transport.fake import FakeTransport

    t = tt.new_transport("fake")
    for name, shape in METHODS.items():
        assert _shape(getattr(FakeTransport, name)) == shape, name
    memory = t.register_memory(torch.zeros(4))
    assert _shape(memory.to_view) == "(offset=None, length=None)"
    assert _shape(memory.to_mutable_view) == "(offset=None, length=None)"
    assert _shape(memory.to_remote_buffer) == "(*, timeout=None)"
    assert isinstance(memory, tt.Memory) and isinstance(memory.to_remote_buffer(), tt.RemoteBuffer)
    assert isinstance(memory.to_view(), tt.MemoryView)
    assert not isinstance(memory.to_view(), tt.MutableMemoryView)
    assert isinstance(memory.to_mutable_view(), tt.MutableMemoryView)
    assert memory.to_view(1).size() == 15 and memory.to_mutable_view(0, 4).writable is True
    t.close()


def test_view_protocols_are_structural(impl: Impl) -> None:
    readonly = SimpleNamespace(size=lambda: 8)
    mutable = SimpleNamespace(size=lambda: 8, writable=True)
    assert isinstance(readonly, impl.api.MemoryView)
    assert not isinstance(readonly, impl.api.MutableMemoryView)
    assert isinstance(mutable, impl.api.MutableMemoryView)
    assert not isinstance(SimpleNamespace(), impl.api.MemoryView)


# -- the registry -----------------------------------------------------------------------------


def test_register_and_create(impl: Impl, registry: Callable[..., None]) -> None:
    cls = _transport_class(impl.api)
    impl.api.register_transport("Mine", cls)
    t = impl.api.new_transport("MINE", "cpu", value=3)  # names are lower-cased
    assert type(t) is cls and t.value == 3 and t.device == torch.device("cpu")
    assert impl.api.new_transport("mine").device is None
    assert impl.api.available_transports() == ("mine",)
    with pytest.raises(ValueError, match="transport 'mine' is already registered"):
        impl.api.register_transport("mine", cls)
    impl.api.register_transport("mine", lambda **kw: cls(value="replaced"), replace=True)
    assert impl.api.new_transport("mine").value == "replaced"


def test_a_factory_without_device_gets_none(impl: Impl, registry: Callable[..., None]) -> None:
    cls = _transport_class(impl.api)
    impl.api.register_transport("mine", lambda *, value: cls(value=value))
    t = impl.api.new_transport("mine", value=3)  # no device given: none passed
    assert t.device is None and t.value == 3


@pytest.mark.parametrize(
    ("name", "factory", "error", "text"),
    [
        ("", "class", ValueError, ""),
        ("x", None, TypeError, "transport factory must be callable"),
        ("x", 3, TypeError, "transport factory must be callable"),
    ],
)
def test_registration_errors(
    impl: Impl, registry: Callable[..., None], name: str, factory: Any, error: type, text: str
) -> None:
    cls = _transport_class(impl.api)
    with pytest.raises(error, match=text):
        impl.api.register_transport(name, cls if factory == "class" else factory)


def test_entry_points(impl: Impl, registry: Callable[..., None]) -> None:
    cls = _transport_class(impl.api)
    registry(
        _EntryPoint("External", cls),
        _EntryPoint("twice", cls),
        _EntryPoint("TWICE", cls),
        _EntryPoint("broken", ImportError("no such module")),
        _EntryPoint("notcallable", 42),
        _EntryPoint("wrongtype", lambda **kw: object()),
    )
    assert type(impl.api.new_transport("external", "cpu")) is cls
    assert impl.api.available_transports() == (
        "broken",
        "external",
        "notcallable",
        "twice",
        "wrongtype",
    )
    with pytest.raises(RuntimeError, match="multiple entry points registered transport 'twice'"):
        impl.api.new_transport("twice")
    with pytest.raises(RuntimeError, match="'broken'"):
        impl.api.new_transport("broken")
    with pytest.raises(TypeError, match="'notcallable'"):
        impl.api.new_transport("notcallable")
    with pytest.raises(TypeError, match="expected a Transport"):
        impl.api.new_transport("wrongtype")
    with pytest.raises(ValueError, match="transport 'external' is already registered"):
        impl.api.register_transport("external", cls)
    impl.api.register_transport("external", cls, replace=True)


def test_unknown_and_unsupported(impl: Impl, registry: Callable[..., None]) -> None:
    with pytest.raises(ValueError, match=r"unknown transport 'missing'; available: none"):
        impl.api.new_transport("missing")
    cls = _transport_class(impl.api)
    impl.api.register_transport("mine", cls)
    cls.is_supported = False
    with pytest.raises(RuntimeError, match="transport 'mine' is not supported"):
        impl.api.new_transport("mine")  # a class says so before it is made
    assert cls.instances == []

    made = cls()
    impl.api.register_transport("late", lambda **kw: made)
    with pytest.raises(RuntimeError, match="transport 'late' is not supported"):
        impl.api.new_transport("late")  # a factory's transport is asked, then closed
    assert made.closed

    def failing(**kw: Any) -> Any:
        raise OSError("no device")

    impl.api.register_transport("failing", failing)
    with pytest.raises(RuntimeError, match="failed to create transport 'failing'"):
        impl.api.new_transport("failing")


def test_base_defaults(impl: Impl) -> None:
    cls = _transport_class(impl.api)
    with cls() as t:
        with pytest.raises(NotImplementedError, match="unregistration"):
            t.unregister_memory(None)
        with pytest.raises(NotImplementedError, match="async close"):
            asyncio.run(t.close_async())
        for op in (t.write_stream, t.read_stream):
            with pytest.raises(ValueError, match="stream transfers require a positive timeout"):
                op(None, None, timeout=0)
            with pytest.raises(ValueError, match="timeout must be finite and nonnegative"):
                op(None, None, timeout=math.nan)
    assert t.closed  # the context manager closed it


# -- works, timeouts, asyncio ------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [-1, -0.001, math.nan, math.inf])
@pytest.mark.parametrize("op", ["read", "write"])
def test_an_invalid_timeout_submits_nothing(impl: Impl, op: str, timeout: float) -> None:
    t = _transport_class(impl.api)()
    with mock.patch.object(t, op) as submit:
        with pytest.raises(ValueError, match="timeout must be finite and nonnegative"):
            asyncio.run(getattr(t, f"{op}_async")(None, None, timeout=timeout))
        submit.assert_not_called()
    with pytest.raises(ValueError, match="timeout must be finite and nonnegative"):
        asyncio.run(impl.api.wait_all([], timeout=timeout))


@pytest.mark.parametrize("op", ["read", "write"])
def test_async_variants_pass_the_timeout_and_spend_it(impl: Impl, op: str) -> None:
    t = _transport_class(impl.api)()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        with (
            mock.patch.object(t, op, return_value=_done_work()) as submit,
            mock.patch(f"{impl.transport_home}.wait_all") as wait,
            mock.patch.object(loop, "time", side_effect=[100.0, 100.3]),
        ):
            assert await getattr(t, f"{op}_async")("local", "remote", timeout=0.5) is None
        submit.assert_called_once_with("local", "remote", async_op=True, timeout=0.5)
        assert wait.call_args.kwargs["timeout"] == pytest.approx(0.2)  # 0.3 s went to submit

    asyncio.run(run())


def test_wait_all_reads_only_the_future(impl: Impl) -> None:
    future: torch.futures.Future[Any] = torch.futures.Future()

    class FutureOnly(dist.Work):
        def get_future(self) -> torch.futures.Future[Any]:
            return future

        def is_completed(self) -> bool:
            raise AssertionError("polled")

        def wait(self, *args: Any) -> bool:
            raise AssertionError("blocked in wait()")

    async def run() -> None:
        task = asyncio.create_task(impl.api.wait_all([FutureOnly()]))
        await asyncio.sleep(0)
        assert not task.done()
        thread = threading.Thread(target=future.set_result, args=([],))
        thread.start()
        await asyncio.wait_for(task, 10)
        thread.join(10)

    asyncio.run(run())


def test_wait_all_results_errors_and_timeouts(impl: Impl) -> None:
    asyncio.run(impl.api.wait_all([]))
    asyncio.run(impl.api.wait_all([_done_work(), _done_work()], timeout=0))  # done: no wait
    with pytest.raises(RuntimeError, match="peer went away"):
        asyncio.run(impl.api.wait_all([_done_work(RuntimeError("peer went away"))], timeout=0))
    work, future = _pending_work()
    with pytest.raises(TimeoutError, match="transport wait timed out; operations remain pending"):
        asyncio.run(impl.api.wait_all([_done_work(), work], timeout=0.01))
    future.set_result([])  # completes after its waiter's loop closed: nothing breaks
    asyncio.run(impl.api.wait_all([work], timeout=0))

    async def later() -> None:
        work, future = _pending_work()
        asyncio.get_running_loop().call_later(0.01, future.set_result, [])
        await impl.api.wait_all([work], timeout=10)

    asyncio.run(later())


def test_a_cancelled_waiter_leaves_the_work_alone(impl: Impl) -> None:
    work, future = _pending_work()

    async def run() -> None:
        first = asyncio.create_task(impl.api.wait_all([work]))
        second = asyncio.create_task(impl.api.wait_all([work]))
        await asyncio.sleep(0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert not future.done() and not second.done()
        future.set_result([])
        await asyncio.wait_for(second, 10)

    asyncio.run(run())


# -- descriptors ------------------------------------------------------------------------------


def _descriptor_class(impl: Impl) -> type:
    @dataclasses.dataclass(frozen=True)
    class Descriptor(impl.wire):  # type: ignore[misc, name-defined]
        _backend = "contract"
        _fields = {"address": int, "name": str, "metadata": bytes}

        address: int
        name: str
        metadata: bytes

    return Descriptor


def test_descriptor_round_trip(impl: Impl) -> None:
    cls = _descriptor_class(impl)
    d = cls(2**64 - 1, "peer\u2603", b"\x00\xffdata")
    wire = d.serialize()
    assert type(wire) is bytes and cls.deserialize(wire) == d
    envelope = json.loads(wire)
    assert envelope["version"] == 1 and envelope["backend"] == "contract"
    assert set(envelope["fields"]) == {"address", "name", "metadata"}


def _bad_descriptors(valid: dict[str, Any]) -> Iterator[bytes]:
    yield from (b"", b"not json", b"\xff", b"[]", b"null", b"{}")
    yield b'{"version":1,"version":1,"backend":"contract","fields":{}}'
    for key, value in [
        ("version", 2),
        ("version", True),
        ("version", "1"),
        ("backend", "nixl"),
        ("fields", []),
        ("unexpected", 0),
    ]:
        yield json.dumps({**valid, key: value}).encode()
    for key, value in [
        ("address", -1),
        ("address", True),
        ("address", 1.5),
        ("address", "1"),
        ("name", 1),
        ("metadata", "%%%"),
        ("metadata", []),
        ("extra", 0),
    ]:
        yield json.dumps({**valid, "fields": {**valid["fields"], key: value}}).encode()
    fields = dict(valid["fields"])
    fields.pop("name")
    yield json.dumps({**valid, "fields": fields}).encode()


def test_descriptor_rejections(impl: Impl) -> None:
    cls = _descriptor_class(impl)
    valid = json.loads(cls(1, "peer", b"data").serialize())
    for data in _bad_descriptors(valid):
        with pytest.raises(ValueError):
            cls.deserialize(data)
    with pytest.raises(TypeError):
        cls.deserialize(json.dumps(valid))  # str, not bytes
    with pytest.raises(ValueError):
        cls(-1, "peer", b"").serialize()


# -- bootstrap through a store ----------------------------------------------------------------


def test_new_transport_rank_validation(impl: Impl, registry: Callable[..., None]) -> None:
    impl.api.register_transport("mine", _transport_class(impl.api))
    store = dist.HashStore()
    for kwargs, text in [
        ({"rank": -1, "peer_rank": 1}, "rank must be a nonnegative integer"),
        ({"rank": 0, "peer_rank": -1}, "peer_rank must be a nonnegative integer"),
        ({"rank": 0, "peer_rank": 1.0}, "peer_rank must be a nonnegative integer"),
        ({"rank": 1, "peer_rank": 1}, "peer_rank must differ from the local rank"),
        ({"rank": 0, "peer_rank": 1, "bootstrap_timeout": -1}, "finite and nonnegative"),
    ]:
        with pytest.raises(ValueError, match=text):
            impl.api.new_transport_rank("mine", store=store, **kwargs)


def _client(server: dist.TCPStore, prefix: str) -> dist.Store:
    # A client per rank: one TCPStore client serialises its calls, as two ranks' do not.
    return dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", server.port, is_master=False))


def _bootstrap_both(impl: Impl, backend: str, server: dist.TCPStore, prefix: str) -> dict[int, Any]:
    out: dict[int, Any] = {}
    errors: list[BaseException] = []

    def side(rank: int) -> None:
        try:
            out[rank] = impl.api.new_transport_rank(
                backend,
                store=_client(server, prefix),
                rank=rank,
                peer_rank=1 - rank,
                bootstrap_timeout=30,
            )
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=side, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(40)
    assert not errors, errors
    assert not any(th.is_alive() for th in threads) and sorted(out) == [0, 1]
    return out


def test_bootstrap_meets_under_torch_2_15_keys(impl: Impl, registry: Callable[..., None]) -> None:
    """transport/<backend>/<lo>/<hi>/attempts/<rank> counts attempts; each attempt's URLs live
    under transport/<backend>/<lo>/<hi>/<attempt>/<rank>: a torch 2.15 peer finds ours there."""
    cls = _transport_class(impl.api)
    impl.api.register_transport("keys", cls)
    server, prefix = new_store(), f"t{uuid.uuid4().hex}"
    store = dist.PrefixStore(prefix, server)
    for attempt in (1, 2):
        pair = _bootstrap_both(impl, "KEYS", server, prefix)  # the name is lower-cased
        for rank in (0, 1):
            assert store.get(f"transport/keys/0/1/attempts/{rank}") == str(attempt).encode()
            url = store.get(f"transport/keys/0/1/{attempt}/{rank}")
            assert url == pair[rank].bind()
            assert pair[1 - rank].urls == [url]
            pair[rank].close()


def test_bootstrap_gives_up_and_closes(impl: Impl, registry: Callable[..., None]) -> None:
    cls = _transport_class(impl.api)
    impl.api.register_transport("lonely", cls)
    with pytest.raises((TimeoutError, RuntimeError)):
        impl.api.new_transport_rank(
            "lonely", store=new_store(), rank=0, peer_rank=1, bootstrap_timeout=0.2
        )
    assert [t.closed for t in cls.instances] == [True]


@pytest.mark.timeout(60)
def test_tethers_backends_through_either_registry(impl: Impl) -> None:
    """A tether backend by the name both registries know (tether's entry point), bootstrapped and
    used by the same code whichever module runs it."""
    import tether.transport as tt

    pair = _bootstrap_both(impl, "tether-tcp", new_store(), f"t{uuid.uuid4().hex}")
    inbox = pair[1].register_memory(torch.zeros(256))
    src = pair[0].register_memory(torch.arange(256.0))
    remote = type(inbox.to_remote_buffer()).deserialize(inbox.to_remote_buffer().serialize())
    assert isinstance(remote, impl.api.RemoteBuffer) and isinstance(pair[0], tt.Backend)
    assert pair[0].write(src.to_view(), remote) == 0
    assert torch.equal(inbox.tensor, torch.arange(256.0))
    back = pair[0].register_memory(torch.zeros(256))
    work = pair[0].read(
        back.to_mutable_view(), remote, async_op=True, timeout=timedelta(seconds=30)
    )
    asyncio.run(impl.api.wait_all([work], timeout=30))
    assert torch.equal(back.tensor, torch.arange(256.0))
    for t in pair.values():
        t.close()


def test_tether_registers_under_torchs_entry_point_group() -> None:
    """torch 2.15's registry loads ``torch.distributed.transports`` entry points: tether's are
    there, under names that leave torch's ``nixl`` alone (``local`` and ``tcp`` too: 2.15 ships
    neither), each a Transport of this torch."""
    from importlib import metadata

    import tether.transport as tt

    points = {ep.name: ep for ep in metadata.entry_points(group="torch.distributed.transports")}
    ours = {name for name, ep in points.items() if ep.value.startswith("tether.")}
    assert ours == {"tether-local", "tether-tcp", "tether-nixl", "local", "tcp"}
    for name in ours:
        cls = points[name].load()
        assert issubclass(cls, tt.Transport) and issubclass(cls, tt.Backend)
    assert set(tt.available_transports()) >= {"fake", "local", "tcp", "nixl", *ours}
