"""`tether run --store etcd://...`: what tether keeps in the job's store (alarms and answers,
heartbeats, membership decisions, regroups) lives in a real etcd, and the job behaves as it does
on torchrun's store: a hang makes every rank dump into one event with the right verdict, and an
elastic job survives a SIGKILL, heals a replacement and commits every step once."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._elastic import check_training, run
from tests._jobs import WORKERS, worker_env
from tether.analyze import analyze
from tether.events.layout import rank_file
from tether.job.alarm import HANG_EXIT_CODE
from tether.job.etcd import EtcdKV, parse_endpoints
from tether.testing.etcd import EtcdCluster, etcd_on_loopback

pytestmark = pytest.mark.timeout(200)


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdCluster]:
    with etcd_on_loopback(1) as cluster:
        yield cluster


def _keys(etcd: EtcdCluster) -> list[str]:
    """Every key tether wrote in etcd, under its jobs' prefixes."""
    return EtcdKV(parse_endpoints(etcd.url), prefix="/tether/").names()


@pytest.mark.slow
def test_a_hang_is_dumped_by_every_rank_through_etcd(etcd: EtcdCluster, tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    cmd = [
        sys.executable, "-m", "tether.cli.main", "run", "--standalone", "--nproc-per-node=3",
        f"--dump-dir={dumps}", "--hang-timeout=3", f"--store={etcd.url}",
        str(WORKERS / "cluster_job.py"), "--fault=hang", "--culprit=1", "--fault-step=2",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, env=worker_env(), capture_output=True, text=True, timeout=150, check=False
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == HANG_EXIT_CODE, log
    [event] = [d for d in dumps.iterdir() if d.is_dir() and not d.name.startswith(".")]
    assert all(rank_file(event, r).exists() for r in range(3)), log
    d = analyze(event)
    assert (d.verdict, d.culprit_ranks) == ("hang", [1]), d.evidence
    alarms = [k for k in _keys(etcd) if k.endswith("tether/alarm/1")]
    assert alarms, f"the hang's alarm is not in etcd: {_keys(etcd)}"


def test_an_elastic_job_survives_a_death_through_etcd(etcd: EtcdCluster, tmp_path: Path) -> None:
    result = run(
        tmp_path,
        "--steps=8",
        "--until-world=4",
        "--fault=2:3:SIGKILL",
        flags=(f"--store={etcd.url}",),
    )
    check_training(result, members={0, 1, 2, 3})
    assert "rank 2 (signal SIGKILL) declared dead; epoch 1: 3 rank(s) [0, 1, 3]" in result.log
    decided = [k for k in _keys(etcd) if k.endswith("tether/elastic/decision/1")]
    assert len(decided) == 1, f"epoch 1's decision is not in etcd once: {_keys(etcd)}"
