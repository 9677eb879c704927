"""The job's store on an etcd cluster: state that outlives any one node of the job.

``tether run --store etcd://host1:2379,host2:2379,host3:2379`` keeps everything tether puts in the
job's store in etcd instead of the TCPStore that node 0's launcher hosts. Two pieces:

- :class:`EtcdKV`, torch-free: etcd's v3 API (its JSON gateway, through the ``etcd3gw`` client)
  with the operations a job needs (put, get, atomic add and compare-and-set as transactions,
  waits as watches, leases) under one prefix per job. A request goes to one member; a member that
  does not answer, or answers without a leader, sends it to the next, until the call's deadline.
  A node cut off from the majority therefore fails its calls with
  :class:`~tether.StoreUnreachableError` within that deadline: etcd commits only with a quorum,
  so the two sides of a partition never both decide.
- :func:`etcd_store`: the same as a ``torch.distributed.Store`` (TCPStore's semantics: ``get``
  and ``wait`` block until the key exists, ``compare_set`` with an empty expected value creates),
  so that process groups rendezvous through it and tether's own protocol runs on it unchanged.

etcd3gw is imported only here, only when an ``etcd://`` store is asked for: without it (``pip
install 'tether[etcd]'``) nothing else changes.
"""

from __future__ import annotations

import base64
import functools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from tether._exceptions import ConfigError, StoreUnreachableError
from tether._log import get_logger
from tether.job.alarm import first_line

__all__ = ["SCHEME", "EtcdKV", "etcd_store", "is_etcd", "parse_endpoints"]

logger = get_logger(__name__)

SCHEME = "etcd://"
DEFAULT_PORT = 2379
REQUEST_TIMEOUT_S = 1.0
"""One HTTP request to one member. A healthy member answers in milliseconds and a new leader is
elected within etcd's election timeout (1 s by default); past this the next member is asked."""
_RETRY_PAUSE_S = (0.02, 0.5)
"""The pause after a round of every member failed, doubling from the first to the second."""
_WATCH_SLICE_S = 1.0
"""A wait watches at most this long before it looks again (a member may have gone meanwhile)."""

T = TypeVar("T")


def is_etcd(address: str) -> bool:
    return address.startswith(SCHEME)


def parse_endpoints(url: str) -> list[tuple[str, int]]:
    """``etcd://h1:2379,h2,h3:2380`` -> ``[("h1", 2379), ("h2", 2379), ("h3", 2380)]``."""
    if not is_etcd(url):
        raise ConfigError(f"an etcd store is named {SCHEME}host:port[,host:port...], not {url!r}")
    endpoints = []
    for part in url[len(SCHEME) :].rstrip("/").split(","):
        host, _, port = part.strip().rpartition(":") if ":" in part else (part.strip(), "", "")
        if not host or (port and not port.isdigit()):
            raise ConfigError(f"{url!r}: {part!r} is not host[:port]")
        endpoints.append((host, int(port) if port else DEFAULT_PORT))
    return endpoints


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


class EtcdKV:
    """One job's keys in an etcd cluster (``prefix`` + key), reached through any of
    ``endpoints``. Safe to share between threads (each thread has its own HTTP sessions)."""

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        *,
        prefix: str,
        timeout: float = 30.0,
        request_timeout: float = REQUEST_TIMEOUT_S,
    ) -> None:
        try:
            import etcd3gw  # noqa: F401
        except ImportError as exc:
            raise ConfigError(
                "an etcd:// store needs the etcd3gw client: pip install 'tether[etcd]'"
            ) from exc
        if not endpoints:
            raise ConfigError("an etcd store needs at least one endpoint")
        self.endpoints = list(endpoints)
        self.prefix = prefix.encode()
        self.timeout = timeout
        """How long a call keeps trying the members before it gives up (and a wait's default)."""
        self.request_timeout = request_timeout
        self._local = threading.local()
        self._term = 0
        """The newest raft term a reply has carried (:meth:`_current`)."""
        self._lock = threading.Lock()
        self._first = 0
        """The member that answered last (or the one after the last that failed): the next
        call starts there."""
        self._closed = threading.Event()

    def __repr__(self) -> str:
        return f"EtcdKV({self.url!r}, prefix={self.prefix.decode()!r})"

    @property
    def url(self) -> str:
        return SCHEME + ",".join(f"{h}:{p}" for h, p in self.endpoints)

    # -- the requests -------------------------------------------------------------------------
    def _client(self, index: int) -> Any:
        clients: dict[int, Any] | None = getattr(self._local, "clients", None)
        if clients is None:
            clients = self._local.clients = {}
        if index not in clients:
            from etcd3gw.client import Etcd3Client

            host, port = self.endpoints[index]
            clients[index] = Etcd3Client(
                host=host, port=port, timeout=self.request_timeout, api_path="/v3/"
            )
        return clients[index]

    def _call(self, what: str, request: Callable[[Any], T], *, timeout: float | None = None) -> T:
        """``request(client)`` on the first member that answers it, trying each in turn until
        ``timeout`` (the store's) has passed."""
        import requests
        from etcd3gw import exceptions as etcd_errors

        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        pause, last = _RETRY_PAUSE_S[0], ""
        while True:
            for step in range(len(self.endpoints)):
                index = (self._first + step) % len(self.endpoints)
                try:
                    result = self._current(request(self._client(index)))
                except (etcd_errors.Etcd3Exception, requests.RequestException, ValueError) as e:
                    # Down, unreachable, without a leader ("no leader", "request timed out") or
                    # restarting ("not capable"), or killed as it answered (a cut body, which
                    # etcd3gw does not wrap): another member may have a quorum.
                    last = f"{self._name(index)}: {first_line(e)[:200]}"
                    if self._first == index:
                        # The next call starts at the next member: a member that holds a request
                        # without answering (frozen, or its link down) costs a whole request
                        # timeout, and a call bounded by less (a lease's renewal, 1 s) would
                        # never get past it to one that answers.
                        self._first = (index + 1) % len(self.endpoints)
                else:
                    self._first = index
                    return result
                if time.monotonic() >= deadline:
                    break
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreUnreachableError(
                    f"the job's etcd store ({self.url}) did not {what} within "
                    f"{self.timeout if timeout is None else timeout:g}s: no member reachable from "
                    f"this host has a quorum ({last})"
                )
            time.sleep(min(pause, left))
            pause = min(pause * 2, _RETRY_PAUSE_S[1])

    def _current(self, reply: T) -> T:
        """``reply``, unless it comes from a member that has not heard of the leader elected
        since (:class:`ValueError`). A member stopped while it led (its node frozen), running
        again, answers as the leader until it hears of the new one: a lease renewed there is
        renewed nowhere else, and expires in the job's store."""
        body = reply.get("result", reply) if isinstance(reply, dict) else None
        header = body.get("header") if isinstance(body, dict) else None
        if not isinstance(header, dict) or "raft_term" not in header:
            return reply
        term = int(header["raft_term"])
        with self._lock:
            if term < self._term:
                raise ValueError(f"a reply of raft term {term}, older than {self._term}")
            self._term = term
        return reply

    def _name(self, index: int) -> str:
        host, port = self.endpoints[index]
        return f"{host}:{port}"

    def _post(self, path: str, body: dict[str, Any]) -> Callable[[Any], Any]:
        return lambda client: client.post(client.get_url(path), json=body)

    # -- keys ---------------------------------------------------------------------------------
    def key(self, name: str) -> bytes:
        return self.prefix + name.encode()

    def put(self, name: str, value: bytes, *, lease: int | None = None) -> None:
        body: dict[str, Any] = {"key": _b64(self.key(name)), "value": _b64(value)}
        if lease is not None:
            body["lease"] = lease
        self._call("store a key", self._post("/kv/put", body))

    def read(self, name: str) -> tuple[bytes | None, int]:
        """The key's value (None: absent) and the store's revision it was read at."""
        reply = self._call("read a key", self._post("/kv/range", {"key": _b64(self.key(name))}))
        kvs = reply.get("kvs") or ()
        value = _unb64(kvs[0].get("value", "")) if kvs else None
        return value, int(reply["header"]["revision"])

    def get(self, name: str) -> bytes | None:
        return self.read(name)[0]

    def delete(self, name: str) -> bool:
        reply = self._call(
            "delete a key", self._post("/kv/deleterange", {"key": _b64(self.key(name))})
        )
        return int(reply.get("deleted", 0)) > 0

    def _range(self, under: str = "", **options: Any) -> dict[str, Any]:
        start = self.key(under)
        end = start[:-1] + bytes([start[-1] + 1])  # every key that starts with ``start``
        body = {"key": _b64(start), "range_end": _b64(end), **options}
        return dict(self._call("list keys", self._post("/kv/range", body)))

    def count(self) -> int:
        """How many keys the job has."""
        return int(self._range(count_only=True).get("count", 0))

    def names(self) -> list[str]:
        """The job's keys, without the prefix."""
        kvs = self._range(keys_only=True).get("kvs") or ()
        return [_unb64(kv["key"])[len(self.prefix) :].decode() for kv in kvs]

    def items(self, under: str) -> dict[str, bytes]:
        """Every key that starts with ``under`` (without the job's prefix), and its value: one
        read, at one revision."""
        kvs = self._range(under).get("kvs") or ()
        return {
            _unb64(kv["key"])[len(self.prefix) :].decode(): _unb64(kv.get("value", ""))
            for kv in kvs
        }

    def compare_set(self, name: str, expected: bytes, desired: bytes) -> bytes:
        """TCPStore's ``compare_set``: ``desired`` is stored if the key holds ``expected`` (or is
        absent and ``expected`` is empty); the key's value afterwards is returned (``expected``
        if it is absent and stays so)."""
        key = _b64(self.key(name))
        reply = self._call(
            "compare and set a key",
            self._post(
                "/kv/txn",
                {
                    "compare": [_holds(key, expected or None)],
                    "success": [{"request_put": {"key": key, "value": _b64(desired)}}],
                    "failure": [{"request_range": {"key": key}}],
                },
            ),
        )
        if reply.get("succeeded"):
            return desired
        kvs = reply["responses"][0]["response_range"].get("kvs") or ()
        return _unb64(kvs[0].get("value", "")) if kvs else expected

    def add(self, name: str, amount: int) -> int:
        """Add ``amount`` to the integer the key holds (0 if absent); the sum. A transaction on
        the key's revision, retried when another writer came first."""
        key = _b64(self.key(name))
        while True:
            value, _ = self.read(name)
            total = amount + (int(value) if value is not None else 0)
            reply = self._call(
                "add to a key",
                self._post(
                    "/kv/txn",
                    {
                        "compare": [_holds(key, value)],
                        "success": [{"request_put": {"key": key, "value": _b64(b"%d" % total)}}],
                    },
                ),
            )
            if reply.get("succeeded"):
                return total

    def wait(self, names: Iterable[str], timeout: float | None = None) -> bool:
        """Block until every key exists (True) or ``timeout`` passes (False). Watches from the
        revision each missing key was read at, so a key created in between is never missed."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for name in names:
            while True:
                value, revision = self.read(name)
                if value is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set():
                    return False
                self._watch_once(name, revision + 1, min(left, _WATCH_SLICE_S))
        return True

    def close(self) -> None:
        """End every wait in progress, and any later one, as timed out (within a watch slice,
        1 s): a thread left waiting for a key that never comes ends instead of outliving the
        process's exit inside torch's C++ (which aborts it there)."""
        self._closed.set()

    def _watch_once(self, name: str, start_revision: int, timeout: float) -> None:
        """Return at the key's next event after ``start_revision`` or after ``timeout``."""
        from etcd3gw import exceptions as etcd_errors

        try:
            self._client(self._first).watch_once(
                self.key(name), timeout=timeout, start_revision=start_revision
            )
        except etcd_errors.Etcd3Exception:  # timed out (WatchTimedOut), or the member went
            pass  # the caller reads again (and fails over there, if the member is gone)
        except Exception:  # the stream broke (a member going down): read again
            logger.debug("watch of %s ended early", name, exc_info=True)

    # -- leases -------------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> int:
        """A lease of ``ttl_s`` seconds (etcd's minimum is one): keys put under it vanish when it
        is no longer kept alive."""
        reply = self._call("grant a lease", self._post("/lease/grant", {"TTL": ttl_s}))
        return int(reply["ID"])

    def keep_alive(self, lease: int, *, timeout: float | None = None) -> bool:
        """Renew ``lease``; False once it has expired."""
        reply = self._call(
            "renew a lease", self._post("/lease/keepalive", {"ID": lease}), timeout=timeout
        )
        return int(reply.get("result", {}).get("TTL", 0)) > 0

    def revoke(self, lease: int) -> None:
        """End ``lease`` now: its keys go at once. A lease that has expired already is ended."""
        from etcd3gw import exceptions as etcd_errors

        post = self._post("/kv/lease/revoke", {"ID": lease})

        def revoke(client: Any) -> Any:
            try:
                return post(client)
            except etcd_errors.Etcd3Exception as exc:
                # etcd's answer, not a member down: asking again would only wait out the timeout.
                if "lease not found" in str(exc.detail_text):
                    return None
                raise

        self._call("revoke a lease", revoke)


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _holds(key: str, value: bytes | None) -> dict[str, Any]:
    """A transaction's condition: ``key`` (base64) holds ``value``, or is absent (None)."""
    if value is None:
        return {"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}
    return {"key": key, "result": "EQUAL", "target": "VALUE", "value": _b64(value)}


@functools.cache
def _store_class() -> type:
    # Built on first use: torch is imported only where a store is made (the job protocol loads
    # without torch).
    import torch.distributed as dist
    from torch._C._distributed_c10d import Store  # torch.distributed's stubs omit it

    class EtcdStore(Store):
        """A ``torch.distributed.Store`` kept in etcd (:class:`EtcdKV`), with TCPStore's
        semantics; a timeout raises torch's ``DistStoreError``, as TCPStore's does."""

        def __init__(self, kv: EtcdKV) -> None:
            super().__init__()
            self.kv = kv

        def __repr__(self) -> str:
            return f"EtcdStore({self.kv.url!r})"

        @property
        def timeout(self) -> timedelta:
            return timedelta(seconds=self.kv.timeout)

        def clone(self) -> EtcdStore:
            # The client is safe to share between threads (its HTTP sessions are per thread).
            return EtcdStore(self.kv)

        def set_timeout(self, timeout: timedelta) -> None:
            self.kv.timeout = timeout.total_seconds()

        def close(self) -> None:
            """:meth:`EtcdKV.close` (for every clone: they share the client)."""
            self.kv.close()

        def set(self, key: str, value: bytes | str) -> None:
            self.kv.put(key, _bytes(value))

        def get(self, key: str) -> bytes:
            value = self.kv.get(key)
            if value is not None:
                return value
            self.wait([key])
            value = self.kv.get(key)
            if value is None:  # deleted between the wait and the read
                raise dist.DistStoreError(f"key {key!r} was deleted while it was read")
            return value

        def add(self, key: str, value: int) -> int:
            return self.kv.add(key, int(value))

        def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
            return self.kv.compare_set(key, _bytes(expected), _bytes(desired))

        def check(self, keys: list[str]) -> bool:
            return all(self.kv.get(k) is not None for k in keys)

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            seconds = self.kv.timeout if timeout is None else timeout.total_seconds()
            if not self.kv.wait(keys, seconds):
                raise dist.DistStoreError(
                    f"wait timeout after {seconds * 1000:.0f}ms, keys: {keys} (etcd {self.kv.url})"
                )

        def delete_key(self, key: str) -> bool:
            return self.kv.delete(key)

        def num_keys(self) -> int:
            return self.kv.count()

        def list_keys(self) -> list[str]:
            return self.kv.names()

        def multi_get(self, keys: list[str]) -> list[bytes]:
            return [self.get(k) for k in keys]

        def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
            for k, v in zip(keys, values, strict=True):
                self.set(k, v)

    return EtcdStore


def etcd_store(url: str, *, prefix: str, timeout: float = 30.0) -> Any:
    """A ``torch.distributed.Store`` for the job ``prefix`` names, kept in the etcd cluster at
    ``url`` (``etcd://host:port,...``)."""
    return _store_class()(EtcdKV(parse_endpoints(url), prefix=prefix, timeout=timeout))
