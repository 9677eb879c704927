"""Group formation over a real TCPStore: missing ranks are named, and clock offsets are exact on
rank 0's host and honestly bounded elsewhere. Ranks are threads: only the store is shared."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from tether._exceptions import GroupFormationError
from tether.recorder.formation import LOOK_UP_MAX, Formation, form_group

pytestmark = pytest.mark.timeout(60)


def _form_all(store: Any, hosts: list[str], key: str) -> list[Formation | BaseException]:
    results: list[Formation | BaseException] = [RuntimeError("not run")] * len(hosts)

    def rank(r: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        try:
            results[r] = form_group(
                client,
                key=key,
                name="0",
                desc="default_pg",
                group_rank=r,
                ranks=list(range(len(hosts))),
                timeout=timedelta(seconds=20),
                host=hosts[r],
                clock=True,
            )
        except BaseException as exc:
            results[r] = exc

    threads = [
        threading.Thread(target=rank, args=(r,), name=f"rank-{r}") for r in range(len(hosts))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert not any(t.is_alive() for t in threads), "formation did not end"
    return results


def test_same_host_ranks_share_rank_0s_clock_exactly(store: Any) -> None:
    results = _form_all(store, ["node-a"] * 3, "same-host")
    assert results == [Formation(0, 0)] * 3


def test_other_hosts_get_an_offset_within_its_error_bound(store: Any) -> None:
    # Every "host" here is this machine, so the true offset is 0: each estimate must lie within
    # its own error bound, whatever the scheduling delays.
    results = _form_all(store, ["node-a", "node-b", "node-a", "node-c"], "cross-host")
    assert all(isinstance(r, Formation) for r in results), results
    assert results[0] == Formation(0, 0) and results[2] == Formation(0, 0)
    for r in (1, 3):
        f = results[r]
        assert isinstance(f, Formation)
        assert f.clock_error_ns > 0
        assert abs(f.clock_offset_ns) <= f.clock_error_ns, f


def _form(
    store: Any,
    key: str,
    ranks: list[int],
    *,
    group_rank: int = 0,
    timeout_s: float = 20,
    **late: Any,
) -> Formation:
    """``form_group`` as group rank ``group_rank`` of ``ranks`` (``late``: its late watch)."""
    return form_group(
        store,
        key=key,
        name="3",
        desc="dp",
        group_rank=group_rank,
        ranks=ranks,
        timeout=timedelta(seconds=timeout_s),
        host="node-a",
        **late,
    )


def test_a_rank_that_never_arrives_is_named(store: Any) -> None:
    with pytest.raises(GroupFormationError) as info:
        _form(store, "missing", [0, 5], timeout_s=1)
    assert info.value.missing_ranks == [5]
    assert "[5] never arrived" in str(info.value)


def _late_member(store: Any, key: str, group_rank: int, ranks: list[int]) -> list[Any]:
    """Form as ``group_rank`` of ``ranks``, late after 0.3 s; the calls to ``on_late`` (from the
    watch's thread). The other members arrive once it has been told (or never, for the last of
    ``ranks``)."""
    told: list[Any] = []
    arrived = threading.Event()
    others = dist.TCPStore("127.0.0.1", store.port, is_master=False)

    def on_late(missing: list[int] | None, waited: float) -> None:
        told.append((missing, waited))
        for r in range(len(ranks) - 1):  # all but the last member come now
            if r != group_rank:
                others.set(f"{key}/arrive/{r}", "node-a")
        arrived.set()

    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    with pytest.raises(GroupFormationError) as info:
        _form(
            client, key, ranks, group_rank=group_rank, timeout_s=2, late_after=0.3, on_late=on_late
        )
    assert arrived.is_set() and info.value.missing_ranks == [ranks[-1]]
    return told


def test_a_late_creation_is_told_once_with_who_is_missing(store: Any) -> None:
    ((missing, waited),) = _late_member(store, "late-small", 1, [10, 11, 12, 13])
    assert missing == [10, 12, 13] and 0.3 <= waited < 2.0


@pytest.mark.slow
def test_in_a_large_group_only_its_rank_0_looks_up_who_is_missing(store: Any) -> None:
    ranks = list(range(LOOK_UP_MAX + 1))
    assert _late_member(store, "late-large-1", 1, ranks)[0][0] is None
    assert _late_member(store, "late-large-0", 0, ranks)[0][0] == ranks[1:]


def test_a_creation_within_the_hang_timeout_is_not_late(store: Any) -> None:
    store.set("on-time/arrive/1", "node-b")
    told: list[Any] = []
    _form(store, "on-time", [0, 1], late_after=0.3, on_late=lambda *args: told.append(args))
    assert told == []


def test_a_late_creation_that_completes_prints_nothing_of_torchs(
    store: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    # The late member comes once told; no store wait timed out (torch warns of each one).
    others = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    told: list[Any] = []

    def on_late(missing: list[int] | None, waited: float) -> None:
        told.append(missing)
        others.set("completes/arrive/1", "node-b")

    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    _form(client, "completes", [0, 1], late_after=0.3, on_late=on_late)
    assert told == [[1]]
    assert "timed out" not in capfd.readouterr().err
