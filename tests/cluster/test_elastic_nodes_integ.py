"""`tether run --elastic --store etcd://...` across simulated nodes, one etcd member on each: the
job's membership decisions, heartbeats and regroups go through etcd, and the training must still
commit every step once, equal to a single-process run of the same global batch, with every
replica identical at the end (tests/workers/elastic_train.py; the checks are the one-host
elastic tests').

These tests need root (network namespaces) and Debian's etcd (``make etcd``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Collection
from pathlib import Path

import pytest

from tests._cluster import MASTER_PORT
from tests._elastic import Run, check_training
from tests._jobs import WORKERS, until, worker_env
from tether.analyze.regroups import regroup_sentences
from tether.launcher.stackread import stacks_or_why
from tether.testing.etcd import EtcdCluster
from tether.testing.nodes import Node

pytestmark = [pytest.mark.timeout(240), pytest.mark.root]

PER_NODE = 2
JOB_TIMEOUT_S = 180.0


def run_on_nodes(
    etcd: EtcdCluster,
    tmp_path: Path,
    *worker_args: str,
    fault: Callable[[], None] | None = None,
    gone: Collection[int] = (),
    cut_off: Collection[int] = (),
    rejoin: int | None = None,
    flags: tuple[str, ...] = (),
) -> Run:
    """The elastic training job on every node (PER_NODE ranks each), to its end. ``fault``:
    called once every rank has taken a step; ``gone``: the nodes it kills whole (not waited
    for); ``cut_off``: those it cuts off, whose launcher must fail (the job's outcome is the
    others'); ``rejoin``: a node gone whose launcher starts again, on an empty disk, once the
    others have dropped it (a replacement node); ``flags``: more of ``tether run``'s."""
    nodes = etcd.nodes
    assert nodes is not None
    out, ready = tmp_path / "out", tmp_path / "ready"
    out.mkdir()
    ready.mkdir()
    head = nodes.nodes[0]
    procs: dict[int, subprocess.Popen[bytes]] = {}
    logs: list[tuple[str, Path]] = []

    def launch(node: Node, name: str) -> None:
        path = tmp_path / f"launcher-{name}.log"
        argv = [
            sys.executable, "-m", "tether.cli.main", "run", "--elastic",
            f"--nnodes={len(nodes.nodes)}", f"--node-rank={node.index}",
            f"--master-addr={head.address}", f"--master-port={MASTER_PORT}",
            f"--nproc-per-node={PER_NODE}", "--monitor-interval=0.1",
            f"--dump-dir={node.dump_dir}", f"--store={etcd.url}", *flags,
            str(WORKERS / "elastic_train.py"), f"--out={out}", f"--ready-dir={ready}",
            "--step-sleep=0.01", *worker_args,
        ]  # fmt: skip
        with open(path, "wb") as sink:
            procs[node.index] = nodes.start(
                node, argv, env=worker_env(), stdout=sink, stderr=subprocess.STDOUT
            )
        logs.append((name, path))

    def log() -> str:
        return "\n".join(f"--- {name}\n{path.read_text(errors='replace')}" for name, path in logs)

    for node in nodes.nodes:
        launch(node, node.hostname)
    if fault is not None:

        def stepped() -> bool:
            assert all(p.poll() is None for p in procs.values()), (
                f"a launcher exited before every rank took a step:\n{log()}"
            )
            return len(list(ready.iterdir())) >= PER_NODE * len(nodes.nodes)

        until(stepped, lambda: f"not every rank took a step:\n{log()}")
        fault()
    if rejoin is not None:
        until(
            lambda: "declared dead; epoch 1" in log(),
            lambda: f"node{rejoin} was never dropped:\n{log()}",
        )
        node = nodes.nodes[rejoin]
        shutil.rmtree(node.dump_dir, ignore_errors=True)  # a fresh host: nothing of the old
        node.dump_dir.mkdir(parents=True)
        launch(node, f"{node.hostname}-replacement")
    waited = [k for k in procs if k not in gone or k == rejoin]
    try:
        codes = {k: procs[k].wait(timeout=JOB_TIMEOUT_S) for k in waited}
    except subprocess.TimeoutExpired:
        stacks = "\n".join(
            f"--- pid {pid}\n{stacks_or_why(pid, native=True)}"
            for k in waited
            for pid in nodes.pids(nodes.nodes[k])
        )
        pytest.fail(f"the job did not end in {JOB_TIMEOUT_S:.0f} s:\n{log()}\n{stacks}")
    outputs = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    for k in cut_off:
        assert codes.pop(k) != 0, f"node{k} was cut off and did not fail:\n{log()}"
    return Run(max(codes.values(), key=abs), log(), outputs, head.dump_dir)


@pytest.mark.slow
def test_a_rank_dying_on_one_node_is_survived_across_nodes(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    world = PER_NODE * 3
    result = run_on_nodes(
        etcd, tmp_path, "--steps=8", f"--until-world={world}", "--fault=3:3:SIGKILL"
    )
    check_training(result, members=set(range(world)))
    assert "rank 3 (signal SIGKILL) declared dead; epoch 1: 5 rank(s) [0, 1, 2, 4, 5]" in result.log
    assert (3, 1) in result.by_rank(), "the replacement on node1 did not finish"


def test_node0_lost_is_dropped_whole_and_the_others_go_on(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    # Node 0 hosts torchrun's store and etcd's leader (handed to it: the worst case, etcd must
    # elect another before the lost node can be evicted): the job must not need either.
    # (Another node lost: the replacement node's test, which kills node 2 first.)
    nodes = etcd.nodes
    assert nodes is not None
    etcd.lead(etcd.members[0])
    result = run_on_nodes(
        etcd, tmp_path, "--steps=8", "--until-epoch=1",
        fault=lambda: nodes.kill(nodes.nodes[0]), gone={0},
    )  # fmt: skip
    # Its launcher gone, its host up: the node before it in the ring finds nothing listening
    # and revokes its lease, without waiting for it to expire.
    check_dropped(result, 0, "its launcher is gone (node2 found nothing listening")


@pytest.mark.slow
@pytest.mark.parametrize("hsdp", [False, True], ids=["ddp", "hsdp"])
def test_a_replacement_node_joins_and_is_healed_over_tcp(
    etcd: EtcdCluster, tmp_path: Path, hsdp: bool
) -> None:
    # node2 killed whole (its launcher, its workers, its etcd member), then started again on an
    # empty disk: its workers start as replacements of the ranks the job dropped, are admitted
    # at a step boundary and healed from a survivor on another node, over tcp. With HSDP (FSDP2
    # sharded over each node's two ranks, replicated over the nodes: tether.elastic.hsdp_mesh)
    # node2 is one replica, and its ranks are healed shard by shard, each from a rank of another
    # node holding the same shard.
    nodes = etcd.nodes
    assert nodes is not None
    world = PER_NODE * 3
    result = run_on_nodes(
        etcd, tmp_path, *(["--hsdp"] if hsdp else []), "--steps=8", f"--until-world={world}",
        fault=lambda: nodes.kill(nodes.nodes[2]), gone={2}, rejoin=2,
    )  # fmt: skip
    check_training(result, members=set(range(world)))
    declared = "rank 4 (node2 lost), rank 5 (node2 lost) declared dead; epoch 1: 4 rank(s)"
    assert f"{declared} [0, 1, 2, 3]" in result.log, result.log
    parts = {o["part"] for o in result.outputs}
    assert parts == (set(range(PER_NODE)) if hsdp else {0}), result.log
    assert "node2 (ranks 4-5) lost: its launcher is gone (node1 found nothing" in result.log, (
        result.log
    )
    assert "the job dropped node2's ranks 4-5 in epoch 1" in result.log, result.log
    assert "rank(s) [4, 5] joined; epoch 2: 6 rank(s)" in result.log, result.log
    moved = 0
    for rank in (4, 5):
        healed = result.by_rank()[(rank, 1)]["history"][0]
        assert healed["epoch"] == 2 and healed["heal_bytes"] > 0, healed
        assert healed["heal_over"] == "tcp", healed
        if hsdp:  # from a replica of its own shard
            assert healed["healer"] % PER_NODE == rank % PER_NODE, healed
        moved += healed["heal_bytes"]
    # tether analyze says it in one sentence, with every healer's bytes.
    source = "2 survivors, shard by shard" if hsdp else "a survivor"
    said = "\n".join(regroup_sentences(result.event()))
    assert f"healed from {source} ({moved} bytes in" in said, said


def check_dropped(result: Run, lost: int, why: str = "its lease expired") -> list[int]:
    """Node ``lost`` was dropped whole in epoch 1 (``why``) and the others trained on, exactly;
    the survivors' ranks."""
    ranks = {lost * PER_NODE + i for i in range(PER_NODE)}
    survivors = sorted(set(range(PER_NODE * 3)) - ranks)
    check_training(result, members=set(survivors))
    host = f"node{lost}"
    assert f"{host} (ranks {min(ranks)}-{max(ranks)}) lost: {why}" in result.log, result.log
    declared = ", ".join(f"rank {r} ({host} lost)" for r in sorted(ranks))
    assert f"{declared} declared dead; epoch 1: 4 rank(s) {survivors}" in result.log, result.log
    return survivors


@pytest.mark.slow
def test_a_partition_2_1_goes_on_on_the_majority_and_stops_the_node_cut_off(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    # node2's link goes down: its etcd member loses the quorum, node1 (which watches it) finds
    # it unreachable and the majority revokes its lease (node2's own attempt to revoke node0's
    # fails: no quorum), and node2's launcher, answered by no store, ends its workers into an
    # event of its own. No step is committed on both sides: the survivors' losses are the
    # reference's at every step, and node2's workers wrote none. The link comes back once node2
    # has stopped: its part of the event joins node0's (neither waits out the 30 s it would give
    # a link that stays down).
    nodes = etcd.nodes
    assert nodes is not None
    cut = nodes.nodes[2]
    said = tmp_path / f"launcher-{cut.hostname}.log"

    def cut_until_stopped() -> None:
        nodes.link_down(cut)
        try:
            until(
                lambda: "cut off from the job's store" in said.read_text(errors="replace"),
                "node2 never took itself for cut off",
            )
        finally:
            nodes.link_up(cut)

    result = run_on_nodes(
        etcd, tmp_path, "--steps=8", "--until-epoch=1", fault=cut_until_stopped, cut_off={2}
    )
    survivors = check_dropped(result, 2, "unreachable: its host down or its link cut (node1 had")
    assert "tether run: node2 (ranks 4-5) cut off from the job's store" in result.log, result.log
    assert "cannot reach: node0 (unreachable), node1 (unreachable)" in result.log, result.log
    assert sorted({o["rank"] for o in result.outputs}) == survivors, result.log


@pytest.mark.slow
def test_a_frozen_node_is_dropped_and_on_thawing_stops_without_committing(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    # node2's launcher and workers stopped: node1, which pings it, finds its host taking the
    # connections but neither its launcher nor its workers answering, revokes its lease, and the
    # others drop it and go on. Thawed once they have, its launcher learns its lease is gone, and
    # its workers, which resume inside a step of the old world, commit nothing. Its etcd member
    # is spared, as on a cluster whose etcd runs on hosts of its own: etcd 3.4.23 (Debian's) has
    # a member that led, stopped and resumed revoke every lease that ran out in its own view
    # meanwhile (its lease table still takes itself for the leader's), the other nodes' with them.
    nodes = etcd.nodes
    assert nodes is not None
    frozen = nodes.nodes[2]
    member = etcd.members[2].proc
    assert member is not None
    seen = [tmp_path / f"launcher-{n.hostname}.log" for n in nodes.nodes[:2]]

    def freeze_until_dropped() -> None:
        nodes.freeze(frozen, spare=[member.pid])
        try:
            dropped = "declared dead; epoch 1"
            until(
                lambda: any(dropped in p.read_text(errors="replace") for p in seen),
                "node2 frozen was never declared dead",
            )
        finally:
            nodes.thaw(frozen)

    result = run_on_nodes(
        etcd, tmp_path, "--steps=8", "--until-epoch=1",
        fault=freeze_until_dropped, cut_off={2},
    )  # fmt: skip
    survivors = check_dropped(result, 2, "frozen: its host takes connections, but neither")
    assert "this node's lease expired: the job declared it lost" in result.log, result.log
    assert sorted({o["rank"] for o in result.outputs}) == survivors, result.log


@pytest.mark.slow
def test_a_rank_stuck_past_a_node_s_loss_leaves_and_the_others_end_cleanly(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    # Rank 2 (node1) waits in an all_reduce on a group of its own with rank 3, which never joins
    # it, when node2 is lost: the others' connect for that decision waits for rank 2, which gives
    # up on its wait and is dropped in turn. The connect they left for it is ended with its etcd
    # client: a thread left inside it aborted the exit of two workers after the job's last step.
    nodes = etcd.nodes
    assert nodes is not None
    out = tmp_path / "out"

    def lose_node2_once_rank_2_is_stuck() -> None:
        until((out / "stuck").exists, "rank 2 never got stuck")
        nodes.kill(nodes.nodes[2])

    result = run_on_nodes(
        etcd, tmp_path, "--steps=8", "--stuck=2:3",
        fault=lose_node2_once_rank_2_is_stuck, gone={2}, flags=("--max-replacements=0",),
    )  # fmt: skip
    check_training(result, members={0, 1, 3})
    assert "gloo:all_reduce #1 on group 1 (undefined) still waits" in result.log, result.log
    assert "rank 2 (exit code 75) declared dead" in result.log, result.log
    assert "SIGABRT" not in result.log and "terminate called" not in result.log, result.log


@pytest.mark.slow
def test_an_etcd_member_that_restarts_rejoins_and_the_job_never_notices(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    done = tmp_path / "done"
    member = etcd.members[1]

    def restart() -> None:
        etcd.kill(member)
        etcd.restart(member)  # back from its data directory, healthy again
        done.write_text("restarted")

    result = run_on_nodes(etcd, tmp_path, "--steps=8", f"--until-file={done}", fault=restart)
    check_training(result, members=set(range(PER_NODE * 3)))
    assert "declared dead" not in result.log, result.log
    assert all(o["history"] == [] for o in result.outputs), result.log


@pytest.mark.slow
def test_the_node_demo_loses_a_node_and_takes_its_replacement_back(tmp_path: Path) -> None:
    # `tether demo --fault node --elastic` builds its own three nodes and etcd: it passes only
    # when the losses are the fault-free run's and every replica is identical.
    proc = subprocess.run(
        [sys.executable, "-m", "tether.cli.main", "demo", "--fault=node", "--elastic",
         f"--dump-dir={tmp_path / 'dumps'}"],
        env=worker_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    logs = "\n".join(
        f"--- {path}\n{path.read_text(errors='replace')}"
        for path in sorted(tmp_path.glob("dumps/node*/launcher.log"))
    )
    assert proc.returncode == 0, f"{out}\n{logs}"
    assert "[node0] tether run: node1 (ranks 2-3) lost: its launcher is gone (node0 found" in out
    assert "[node1] tether run: rank(s) [2, 3] joined; epoch 2: 6 rank(s)" in out, out
    assert "NODE LOST: node1 (rank(s) 2-3)" in out, out
    assert "replacement for ranks 2-3 joined on node1 at step " in out, out
    assert "over tcp)" in out, out
    assert "tether demo: ok: node1 (ranks 2-3) was lost, 4 ranks went on" in out, out
