"""Group formation over a real TCPStore: missing ranks are named, and clock offsets are exact on
rank 0's host and honestly bounded elsewhere. Ranks are threads: only the store is shared."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from tether._exceptions import GroupFormationError
from tether.recorder.formation import Formation, form_group

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


def test_a_rank_that_never_arrives_is_named(store: Any) -> None:
    with pytest.raises(GroupFormationError) as info:
        form_group(
            store,
            key="missing",
            name="7",
            desc="sub",
            group_rank=0,
            ranks=[0, 5],
            timeout=timedelta(seconds=1),
            host="node-a",
        )
    assert info.value.missing_ranks == [5]
    assert "[5] never arrived" in str(info.value)
