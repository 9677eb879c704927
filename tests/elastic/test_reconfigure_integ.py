"""torch's reconfigure on recorded groups, torch 2.14's own or tether's for torch 2.13: a 3-rank
gloo job reconfigures through the cases of torch's own tests (``tests/workers/reconfigure.py``:
all, identity, shrink the middle rank, grow by a set, shrink the last rank, a reused uuid, split
and merge with a late joiner, single to all, after an abort) and must see what plain torch 2.14
shows, while the recorder follows each new membership."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._jobs import launch, new_store
from tether import load_dump

pytestmark = [pytest.mark.every_torch, pytest.mark.python_recorder, pytest.mark.regroup]

WORLD = 3
NOT_READY = (
    "ProcessGroupGloo has not been initialized. Call reconfigure() before issuing collectives "
    "when enable_reconfigure=True."
)


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each rank printed, by rank."""
    root = tmp_path_factory.mktemp("reconfigure")
    store = new_store()
    job = launch("reconfigure.py", WORLD, port=store.port, dump_dir=root / "dumps", timeout=120)
    return job.results()


def _handle(handle: str) -> tuple[int, int, int, str]:
    kind, rank, uuid, stable, *address = handle.split(":")
    assert kind == "gloo", handle
    return int(rank), int(uuid), int(stable), ":".join(address)


@pytest.mark.timeout(180)
def test_a_group_waits_for_its_first_reconfigure(seen: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(seen):
        assert out["before"] == NOT_READY
        (first,) = out["handle"]
        assert _handle(first)[:3] == (rank, -1, rank)


@pytest.mark.timeout(180)
def test_each_reconfigure_makes_the_members_a_new_group(seen: list[dict[str, Any]]) -> None:
    # uuid: members by stable rank -> the new rank of each
    expected = {
        1: {0: 0, 1: 1, 2: 2},
        2: {0: 0, 1: 1, 2: 2},
        3: {0: 0, 2: 1},  # the middle rank left out: rank 2 becomes 1
        4: {0: 0, 1: 1, 2: 2},  # a set: gloo sorts the handles
        5: {0: 0, 1: 1},
        6: {0: 0, 1: 1},  # split in two...
        7: {2: 0},
        8: {0: 0, 1: 1, 2: 2},  # ...and merged
        9: {0: 0},  # single to all
        10: {1: 0},
        11: {2: 0},
        12: {0: 0, 1: 1, 2: 2},
        13: {0: 0, 1: 1, 2: 2},  # after an abort
    }
    for uuid, members in expected.items():
        for stable, out in enumerate(seen):
            if stable not in members:
                assert str(uuid) not in out
                continue
            got, size = out[str(uuid)], len(members)
            assert (got["rank"], got["size"], got["sum"]) == (members[stable], size, size)
            # A handle is stale after each reconfigure: it names the new rank and uuid.
            assert _handle(got["handle"])[:3] == (members[stable], uuid, stable)
    assert seen[2]["received"] == [0.0, 1.0, 2.0]  # send/recv between the new ranks 0 and 1


@pytest.mark.timeout(180)
def test_a_subgroup_reconfigures_alone(seen: list[dict[str, Any]]) -> None:
    # Its own rank and size follow (torch's dist.get_rank(group) reads a table of global ranks
    # kept from the group's creation, in torch 2.14 too); the world group stays as it was.
    assert seen[0]["sub"] == [0, 2, 2.0, 0, 3]
    assert seen[2]["sub"] == [1, 2, 2.0, 2, 3]
    assert "sub" not in seen[1]


@pytest.mark.timeout(180)
def test_a_reused_uuid_is_refused_and_the_group_is_kept(seen: list[dict[str, Any]]) -> None:
    assert seen[0]["reused"] == (
        "Gloo reconfigure uuid 5 was already used; each reconfigure() requires a unique uuid"
    )
    assert seen[0]["after_refusal"] == [0, 2, 2.0]
    assert seen[1]["after_refusal"] == [1, 2, 2.0]


def _dump(out: dict[str, Any]) -> dict[str, Any]:
    return load_dump(Path(out["dump"]))


@pytest.mark.timeout(180)
def test_the_recorder_follows_each_membership(seen: list[dict[str, Any]]) -> None:
    for stable, out in enumerate(seen):
        dump = _dump(out)
        made = dump["tether"]["reconfigures"]["0"]
        uuids = [m["uuid"] for m in made]
        assert uuids == [u for u in range(1, 14) if str(u) in out]
        for m in made:
            got = out[str(m["uuid"])]
            assert m["rank"] == got["rank"] and len(m["ranks"]) == got["size"]
            assert m["ranks"][m["rank"]] == stable  # the members' stable ranks, by new rank
        last = made[-1]
        assert dump["pg_config"]["0"]["ranks"] == str(last["ranks"])
        assert dump["tether"]["global_rank"] == stable


@pytest.mark.timeout(180)
def test_sequence_numbers_restart_with_each_communicator(seen: list[dict[str, Any]]) -> None:
    for out in seen:
        dump = _dump(out)
        made = dump["tether"]["reconfigures"]["0"]
        reduces = [e for e in dump["entries"] if e["profiling_name"] == "gloo:all_reduce"]
        for m, following in zip(made, [*made[1:], None], strict=True):
            # The entries of each communicator: created after its reconfigure, before the next.
            ran = [
                e
                for e in reduces
                if e["time_created_ns"] >= m["time_ns"]
                and (following is None or e["time_created_ns"] < following["time_ns"])
            ]
            assert ran and ran[0]["collective_seq_id"] == 1, (m, ran)
            assert all(e["state"] == "completed" for e in ran), ran


@pytest.mark.timeout(180)
def test_an_operation_refused_before_the_first_reconfigure_is_no_hang(
    seen: list[dict[str, Any]],
) -> None:
    """The all_reduce each rank tried before configuring its group never ran: its record keeps
    the error and is retired, so the analyzer sees nothing in flight."""
    for out in seen:
        dump = _dump(out)
        first = dump["entries"][0]
        assert (first["profiling_name"], first["state"]) == ("gloo:all_reduce", "scheduled")
        assert first["retired"] is True
        assert NOT_READY in dump["tether"]["failed"][str(first["record_id"])]
    event = Path(seen[0]["dump"]).parent
    proc = subprocess.run(
        [sys.executable, "-m", "tether.cli.main", "analyze", str(event), "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "healthy", proc.stdout
