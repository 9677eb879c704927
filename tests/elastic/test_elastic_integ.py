"""`tether run --elastic`: real 4-rank DDP jobs under torchrun, with workers killed, stopped, dying
while the others regroup or while they heal a replacement.

The worker (tests/workers/elastic_train.py) trains on a global batch fixed by the step number and
re-sharded over the ranks alive, so every loss it commits must equal a single-process run over
the whole batch, and every replica's parameters must be identical at the end: a step half
applied, lost or applied twice shows up as a different loss or digest.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests._elastic import WORLD, check_training, command, run, took_healed
from tests._jobs import worker_env
from tether.analyze import analyze
from tether.elastic.world import STUCK_S

pytestmark = [pytest.mark.timeout(200), pytest.mark.every_torch, pytest.mark.python_recorder]


def test_sigkill_shrinks_then_a_replacement_is_healed_and_joins(tmp_path: Path) -> None:
    result = run(tmp_path, "--steps=8", "--until-world=4", "--fault=2:3:SIGKILL")
    check_training(result, members={0, 1, 2, 3})
    assert "rank 2 (signal SIGKILL) declared dead; epoch 1: 3 rank(s) [0, 1, 3]" in result.log
    assert (2, 1) in result.by_rank(), "the replacement did not finish"
    replacement = result.by_rank()[(2, 1)]
    assert replacement["history"][0]["heal_bytes"] > 0
    assert min(map(int, replacement["losses"])) > 3, "the replacement redid steps it never ran"
    epochs = result.timeline()["epochs"]
    assert epochs[0]["decision"]["dead"] == {"2": "signal SIGKILL"}
    assert epochs[0]["regrouped"]["step"] == 3, "the failed step is the one redone"
    assert epochs[-1]["decision"]["joined"] == [2]
    diagnosis = analyze(result.event())
    assert (diagnosis.verdict, diagnosis.culprit_ranks) == ("crash", [2])
    died, joined = diagnosis.regroups
    assert died.startswith("rank 2 (signal SIGKILL) died at step 3; survivors regrouped to 3 ")
    assert joined.startswith(f"replacement for rank 2 joined on {socket.gethostname()} at step ")
    assert "healed from a survivor (" in joined and " over local)" in joined, joined


def test_a_member_a_death_left_a_step_behind_is_healed_from_one_that_applied_it(
    tmp_path: Path,
) -> None:
    # Rank 1 misses step 3, which the others apply (its last result lost, as when a death shuts
    # its connections first); rank 3 dies in step 4. At the regroup rank 1 is one step behind:
    # it must take a survivor's state, not redo step 3 while the others run step 4.
    result = run(
        tmp_path,
        "--steps=8",
        "--miss-step=1:3",
        "--fault=3:4:SIGKILL",
        flags=("--max-replacements=0",),
    )
    assert "rank 1 misses step 3" in result.log, result.log
    check_training(result, members={0, 1, 2})
    rank1 = result.by_rank()[(1, 0)]
    assert "3" not in rank1["losses"], "rank 1 applied the step it missed"
    assert took_healed(rank1) == {3}, rank1["history"]
    (regroup,) = rank1["history"]
    assert regroup["step"] == 4 and regroup["heal_bytes"] > 0, regroup
    reported = result.timeline()["epochs"][0]["regrouped"]
    assert reported["heal_bytes"] == regroup["heal_bytes"], "the healer did not report it"


@pytest.mark.slow
def test_sigstop_is_declared_dead_by_its_heartbeat_and_killed(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        "--steps=8",
        "--until-world=4",
        "--fault=1:2:SIGSTOP",
        flags=("--heartbeat-timeout=1.5",),
    )
    check_training(result, members={0, 1, 2, 3})
    assert "rank 1 (no heartbeat for 1.5s (process stopped)) declared dead" in result.log


@pytest.mark.slow
def test_a_worker_slow_to_exit_after_its_last_beat_is_not_declared_dead(tmp_path: Path) -> None:
    # On 2 loaded cores closing tether and the interpreter took over 1.5 s after the last beat;
    # a beat of a training rank came over 1 s late on a machine busy with two suites at once.
    result = run(tmp_path, "--steps=4", "--linger-at-exit=4", flags=("--heartbeat-timeout=2.0",))
    check_training(result, members={0, 1, 2, 3})
    assert "declared dead" not in result.log and "replacement" not in result.log


@pytest.mark.slow
def test_two_deaths_at_once_then_two_replacements(tmp_path: Path) -> None:
    result = run(
        tmp_path, "--steps=8", "--until-world=4", "--fault=1:3:SIGKILL", "--fault=3:3:SIGKILL"
    )
    check_training(result, members={0, 1, 2, 3})
    assert {(1, 1), (3, 1)} <= set(result.by_rank())


@pytest.mark.slow
def test_a_death_during_the_regroup(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        "--steps=8",
        "--fault=3:3:SIGKILL",
        "--die-in-regroup=1",
        flags=("--max-replacements=0",),
    )
    check_training(result, members={0, 2})
    assert "rank 1 dies as it regroups" in result.log


@pytest.mark.slow
def test_a_rank_stuck_where_the_shut_connections_do_not_reach_leaves_the_job(
    tmp_path: Path,
) -> None:
    # Rank 1 waits in an all_reduce on a group of its own with rank 2, which never joins it; rank
    # 3 dies meanwhile. The decision shuts the world group's connections, which do not end that
    # wait: rank 1 gives up on it instead of holding the survivors' regroup until gloo's timeout,
    # is declared dead in turn, and ranks 0 and 2 train on.
    result = run(
        tmp_path,
        "--steps=8",
        "--stuck=1:3",
        "--fault=3:3:SIGKILL",
        flags=("--max-replacements=0",),
    )
    check_training(result, members={0, 2})
    assert "rank 1 waits on rank 2, which never comes" in result.log, result.log
    gave_up = re.search(
        r"\[rank 1 on .*\] gloo:all_reduce #1 on group 1 \(undefined\) still waits "
        r"([0-9.]+)s after decision 1 shut its connections",
        result.log,
    )
    assert gave_up is not None and float(gave_up[1]) >= STUCK_S, result.log
    assert "This rank leaves the job; its threads:" in result.log, result.log
    assert "rank 1 (exit code 75) declared dead" in result.log, result.log


@pytest.mark.slow
def test_the_healer_dies_and_another_survivor_heals(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        "--steps=8",
        "--until-epoch=3",  # 1: rank 3 died, 2: its replacement joined, 3: the healer died
        "--fault=3:2:SIGKILL",
        "--die-healing=0",
        flags=("--max-replacements=1",),
    )
    assert "rank 0 dies while healing" in result.log, result.log
    check_training(result, members={1, 2, 3})
    assert result.by_rank()[(3, 1)]["history"][-1]["heal_bytes"] > 0


@pytest.mark.slow
def test_a_replacement_that_never_arrives(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        "--steps=12",
        "--fault=2:3:SIGKILL",
        "--replacement-fails",
        f"--until-file={tmp_path / 'replacement-failed'}",
        flags=("--max-replacements=1",),
    )
    check_training(result, members={0, 1, 3})
    assert "the replacement for rank 2 died (exit code 3)" in result.log


@pytest.mark.slow
def test_below_the_minimum_world_the_job_stops(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        "--steps=8",
        "--fault=2:3:SIGKILL",
        "--save-on-stop=2",
        flags=("--min-world-size=4", "--max-replacements=0"),
    )
    assert result.returncode == 1, result.log
    assert "the job stops: 3 rank(s) left, fewer than --min-world-size 4" in result.log
    assert "WorldTooSmallError" in result.log
    # The survivors end on their own, after what they do on the error (not cut short by torch).
    assert sorted(p.name for p in (tmp_path / "out").glob("saved.*")) == [
        "saved.0",
        "saved.1",
        "saved.3",
    ]
    assert result.outputs == []
    # One death, one event: the survivors' exits that follow are not a second incident.
    (event,) = [p for p in result.dumps.iterdir() if p.name.endswith("-crash")]
    assert sorted(p.name for p in event.glob("rank_*")) == [f"rank_{r}" for r in range(4)]
    assert result.log.rstrip().splitlines()[-1].endswith(f"next: tether analyze {event}")


@pytest.mark.slow
def test_rank_0_dies_and_the_job_goes_on(tmp_path: Path) -> None:
    # The store lives in the launcher (torchrun's agent), not in rank 0.
    result = run(tmp_path, "--steps=8", "--until-world=4", "--fault=0:3:SIGKILL")
    check_training(result, members={0, 1, 2, 3})
    assert (0, 1) in result.by_rank()


@pytest.mark.slow
def test_the_launcher_hosting_the_store_dies_and_every_worker_stops_clearly(
    tmp_path: Path,
) -> None:
    ready = tmp_path / "ready"
    ready.mkdir()
    log = tmp_path / "log"
    cmd = command(
        tmp_path, "--steps=100000", f"--until-file={tmp_path / 'never'}", f"--ready-dir={ready}"
    )
    with log.open("wb") as sink:
        launcher = subprocess.Popen(cmd, env=worker_env(), stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while len(list(ready.iterdir())) < WORLD:
        assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    pids = [int(p.read_text()) for p in ready.iterdir()]
    launcher.kill()  # the store's host: torchrun's agent, in the launcher
    launcher.wait()
    killed = time.monotonic()
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() - killed < 30, f"workers outlived the store:\n{log.read_text()}"
        time.sleep(0.05)
    text = log.read_text(errors="replace")
    # Each worker hears it from its agent's relay (closed) or from the store (gone), whichever
    # first (both were the launcher's), and raises; or, its training thread blocked in a
    # collective the shut connections did not end, leaves saying so.
    said = (
        "this node's tether run is gone",
        ", hosted by the launcher of node 0) does not answer any more",
        "the job's store's loss shut its connections",
    )
    for rank in range(WORLD):
        lines = [
            line
            for line in text.splitlines()
            if line.startswith((f"[rank{rank}]:", f"[rank {rank} on "))
        ]
        assert any(s in line for line in lines for s in said), (rank, text[-5000:])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
