"""``tether.transport.fanout`` on one host: a publisher and a chain of subscribers, each its own
process (tests/workers/fanout_peer.py) over the tcp backend and a real TCPStore, with a
subscriber killed mid-read and the publisher killed mid-version. Across simulated nodes:
tests/cluster/test_fanout_nodes.py."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests._jobs import worker_env
from tether._exceptions import ConfigError, TransportTimeoutError
from tether.transport.fanout import Publisher, Subscriber

pytestmark = [pytest.mark.timeout(120), pytest.mark.every_torch]

WORKER = Path(__file__).resolve().parents[1] / "workers" / "fanout_peer.py"
LINE = re.compile(r"^(publisher|subscriber) (\d+) version (\d+) sha256 (\w+)$", re.M)


def sync(
    store_port: int,
    subscribers: int,
    *extra: str,
    per_side: dict[int, Sequence[str]] | None = None,
    host: str = "127.0.0.1",
    start: object = subprocess.Popen,
) -> dict[str, str]:
    """Runs a publisher and ``subscribers`` subscribers to the end; (role index) -> its output."""
    common = [f"--store={host}:{store_port}", f"--subscribers={subscribers}", *extra]
    argvs = {"publisher 0": [*common, "--role=publisher"]}
    for k in range(subscribers):
        argvs[f"subscriber {k}"] = [
            *common,
            "--role=subscriber",
            f"--index={k}",
            *(per_side or {}).get(k, ()),
        ]
    procs = {
        who: start(  # type: ignore[operator]
            [sys.executable, str(WORKER), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=worker_env(),
        )
        for who, argv in argvs.items()
    }
    out = {}
    try:
        for who, proc in procs.items():
            text, _ = proc.communicate(timeout=90)
            out[who] = f"{text.decode(errors='replace')}\nexit {proc.returncode}"
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(timeout=10)
    return out


def versions(out: dict[str, str]) -> dict[tuple[str, int], dict[int, str]]:
    got: dict[tuple[str, int], dict[int, str]] = {}
    for text in out.values():
        for role, index, version, digest in LINE.findall(text):
            got.setdefault((role, int(index)), {})[int(version)] = digest
    return got


@pytest.fixture
def store() -> dist.TCPStore:  # type: ignore[name-defined]
    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )


def test_every_subscriber_gets_every_version_whole(store: dist.TCPStore) -> None:  # type: ignore[name-defined]
    out = sync(store.port, 3, "--mb=8", "--versions=3")
    got = versions(out)
    published = got[("publisher", 0)]
    assert sorted(published) == [1, 2, 3], out
    assert len(set(published.values())) == 3
    for k in range(3):
        assert got[("subscriber", k)] == published, out[f"subscriber {k}"]
        assert out[f"subscriber {k}"].endswith("exit 0")


def test_a_subscriber_killed_mid_read_costs_the_others_nothing(
    store: dist.TCPStore,  # type: ignore[name-defined]
) -> None:
    out = sync(store.port, 4, "--mb=16", per_side={1: ["--die-at-chunk=4"]})
    died = re.search(r"subscriber 1 dies holding (\d+) of (\d+)", out["subscriber 1"])
    assert died and int(died[1]) < int(died[2]), out["subscriber 1"]
    got = versions(out)
    published = got[("publisher", 0)]
    assert sorted(published) == [1, 2]
    for k in (0, 2, 3):  # subscriber 2 went round it, to subscriber 0
        assert got[("subscriber", k)] == published, out[f"subscriber {k}"]
        assert out[f"subscriber {k}"].endswith("exit 0")
    assert got[("subscriber", 1)] == {1: published[1]}


def test_the_publisher_killed_mid_version_every_subscriber_keeps_the_last_whole_one(
    store: dist.TCPStore,  # type: ignore[name-defined]
) -> None:
    out = sync(store.port, 3, "--mb=16", per_side={0: ["--kill-publisher-at=4"]})
    assert "publisher killed at" in out["subscriber 0"], out
    got = versions(out)
    first = got[("publisher", 0)][1]
    for k in range(3):
        text = out[f"subscriber {k}"]
        assert got[("subscriber", k)] == {1: first}, text  # version 2 never returned
        assert re.search(rf"subscriber {k} failed: (PeerDiedError|TransportTimeoutError): ", text)
        assert f"subscriber {k} holds sha256 {first}" in text, text  # not a torn version 2
        assert text.endswith("exit 3")


def test_tensors_that_differ_from_the_publishers_are_refused(
    store: dist.TCPStore,  # type: ignore[name-defined]
) -> None:
    with Publisher({"w": torch.zeros(4)}, store=store, name="mismatch"):
        with pytest.raises(ConfigError, match="differ from the publisher's"):
            Subscriber({"w": torch.zeros(5)}, store=store, index=0, name="mismatch")
        with pytest.raises(ConfigError, match="not contiguous"):
            Subscriber({"w": torch.zeros(4, 2).t()}, store=store, index=0, name="mismatch")


def test_a_subscriber_with_no_publisher_says_so_in_its_timeout(
    store: dist.TCPStore,  # type: ignore[name-defined]
) -> None:
    with pytest.raises(TransportTimeoutError, match=re.escape("no publisher of 'nobody' in 0.2 s")):
        Subscriber({"w": torch.zeros(4)}, store=store, index=0, name="nobody", timeout=0.2)
