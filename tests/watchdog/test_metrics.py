"""Prometheus metrics: one rank's exposition read back with prometheus-client's parser (counters
end in ``_total`` and grow, every sample names its rank), rank 0's job-wide exposition, the
file-based service-discovery file, and the files a clean exit removes. No processes needed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tether.config import Config
from tether.job.alarm import Alarm, AlarmBoard
from tether.job.jobfile import job_file, job_files, targets_file
from tether.recorder.ops import OPS
from tether.recorder.recorder import Recorder
from tether.recorder.writer import build_dump
from tether.server.discovery import TargetsWriter, targets
from tether.server.jobmetrics import job_exposition, parse_exposition
from tether.watchdog.link import JobLink
from tether.watchdog.report import RankReport

pytestmark = pytest.mark.timeout(30)


class Work:
    """A finished work; ``failed`` makes its future raise, as gloo's does for a broken peer."""

    def __init__(self, failed: bool = False) -> None:
        self.failed = failed

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> Any:
        future: torch.futures.Future[None] = torch.futures.Future()
        if self.failed:
            future.set_exception(RuntimeError("Connection closed by peer"))
        else:
            future.set_result(None)
        return future


def rank(tmp_path: Path, ring_size: int = 64) -> tuple[JobLink, RankReport]:
    """Rank 3 of 4: its link to the job and its report, wired as the runtime wires them."""
    recorder = Recorder(Config(dump_dir=tmp_path, ring_size=ring_size))
    recorder.global_rank, recorder.world_size = 3, 4
    link = JobLink(recorder)
    report = RankReport.of(link)
    return link, report


def rank_report(tmp_path: Path, ring_size: int = 64) -> RankReport:
    return rank(tmp_path, ring_size)[1]


def group(m: RankReport, name: str, desc: str) -> Any:
    return m.recorder.add_group(
        name=name, desc=desc, ranks=[0, 1, 2, 3], group_rank=3, backends={"cpu": "gloo"},
        timeout_ms=1000,
    )  # fmt: skip


def issue(pg: Any, method: str = "allreduce", n: int = 1, failed: bool = False) -> None:
    for _ in range(n):
        entry = pg.begin(OPS[method], ([torch.ones(2)],))
        pg.issued(entry, Work(failed))
    pg.recorder.reap()


def scrape(m: RankReport) -> dict[str, list[Sample]]:
    """Every sample of ``m``'s /metrics, by family name as the parser gives it."""
    text = m.metrics()
    families = list(text_string_to_metric_families(text))
    for family in families:
        if family.type == "counter":
            assert f"# TYPE {family.name}_total counter" in text
            assert all(s.name == f"{family.name}_total" for s in family.samples), family
        assert f"# HELP {family.name}" in text
    return {f.name: f.samples for f in families}


def value(samples: list[Sample], **labels: str) -> float:
    (match,) = [s.value for s in samples if labels.items() <= s.labels.items()]
    return match


def test_counters_end_in_total_count_by_op_and_group_and_only_grow(tmp_path: Path) -> None:
    m = rank_report(tmp_path)
    world, tp = group(m, "0", "default_pg"), group(m, "1", "tp")
    issue(world, n=3)
    issue(tp, "broadcast")
    first = scrape(m)
    for samples in first.values():
        assert all(s.labels["rank"] == "3" for s in samples), "every sample names its rank"
    recorded = first["tether_operations_recorded"]
    assert value(recorded, group="0", group_desc="default_pg", op="gloo:all_reduce") == 3
    assert value(recorded, group="1", group_desc="tp", op="gloo:broadcast") == 1
    assert value(first["tether_collectives_enqueued"], group="0") == 3
    assert value(first["tether_operations_unseen"]) == 0

    issue(world, n=2)
    second = scrape(m)
    assert value(second["tether_operations_recorded"], group="0", op="gloo:all_reduce") == 5
    assert value(second["tether_operations_recorded"], group="1", op="gloo:broadcast") == 1
    assert value(second["tether_collectives_enqueued"], group="0") == 5
    for name in ("tether_oldest_in_flight_seconds", "tether_watchdog_heartbeat_age_seconds"):
        assert name in second, "durations are in seconds"
    assert value(second["tether_healthy"]) == 1


def test_operations_that_left_the_ring_unseen_are_counted_apart(tmp_path: Path) -> None:
    m = rank_report(tmp_path, ring_size=4)
    world = group(m, "0", "default_pg")
    issue(world, n=2)
    scrape(m)
    issue(world, n=10)  # 10 since the last scrape; the ring keeps 4
    samples = scrape(m)
    assert value(samples["tether_operations_recorded"], op="gloo:all_reduce") == 2 + 4
    assert value(samples["tether_operations_unseen"]) == 6
    assert value(samples["tether_collectives_enqueued"], group="0") == 12, "exact, from seq"


def test_a_failed_operation_is_counted_once(tmp_path: Path) -> None:
    m = rank_report(tmp_path)
    world = group(m, "0", "default_pg")
    issue(world, n=2)
    assert scrape(m)["tether_operations_failed"] == []
    issue(world, failed=True)
    for _ in range(2):
        failed = scrape(m)["tether_operations_failed"]
        assert value(failed, group="0", op="gloo:all_reduce") == 1


class PendingWork(Work):
    """A work polled complete whose future the backend settles later (NCCL's, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.future: torch.futures.Future[None] = torch.futures.Future()

    def get_future(self) -> Any:
        return self.future


def test_a_scrape_leaves_a_failure_for_the_next_dump_to_find(tmp_path: Path) -> None:
    m = rank_report(tmp_path)
    world = group(m, "0", "default_pg")
    work = PendingWork()
    entry = world.begin(OPS["allreduce"], ([torch.ones(2)],))
    world.issued(entry, work)
    m.recorder.reap()
    assert scrape(m)["tether_operations_failed"] == [], "not settled yet"
    work.future.set_exception(RuntimeError("Connection closed by peer"))
    assert value(scrape(m)["tether_operations_failed"], op="gloo:all_reduce") == 1
    assert (entry.state, entry.error) == ("completed", None), "the scrape changed nothing"
    failed = build_dump(m.recorder, reason="manual", event_id="E")["tether"]["failed"]
    assert failed == {str(entry.record_id): "RuntimeError: Connection closed by peer"}, (
        "the dump still finds the failure"
    )
    assert value(scrape(m)["tether_operations_failed"], op="gloo:all_reduce") == 1, "once"


def test_a_trace_before_the_backend_settles_leaves_the_failure_for_the_dump(
    tmp_path: Path,
) -> None:
    m = rank_report(tmp_path)
    world = group(m, "0", "default_pg")
    work = PendingWork()
    world.issued(world.begin(OPS["allreduce"], ([torch.ones(2)],)), work)
    assert m.trace()["tether"]["failed"] == {}, "GET /trace: not settled yet"
    work.future.set_exception(RuntimeError("Connection closed by peer"))
    failed = build_dump(m.recorder, reason="manual", event_id="E")["tether"]["failed"]
    assert list(failed.values()) == ["RuntimeError: Connection closed by peer"]


def test_a_default_group_formed_again_adds_to_its_counters(tmp_path: Path) -> None:
    m = rank_report(tmp_path)
    issue(group(m, "0", "default_pg"), n=3)
    first = scrape(m)
    issue(group(m, "0", "default_pg"), n=1)  # destroy_process_group, init_process_group
    second = scrape(m)
    for name, before, after in (
        ("tether_collectives_enqueued", 3, 4),
        ("tether_collectives_completed", 3, 4),
        ("tether_operations_recorded", 3, 4),
    ):
        assert (value(first[name], group="0"), value(second[name], group="0")) == (before, after)


def test_alarms_answered_and_dumps_written_are_counted_by_reason(tmp_path: Path) -> None:
    link, m = rank(tmp_path)
    outcomes = iter([tmp_path / "rank_3", OSError("disk full"), tmp_path / "rank_3"])

    def dump_for(alarm: Alarm) -> Path:
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    link._dump_for = dump_for  # type: ignore[method-assign]
    link._counted_dump(Alarm(1, "E1-manual", "manual", origin="rank 0"))
    with pytest.raises(OSError, match="disk full"):  # the responder still learns of it
        link._counted_dump(Alarm(2, "E2-manual", "manual", origin="rank 0"))
    link._counted_dump(Alarm(3, "E3-hang", "hang", origin="rank 0"))
    samples = scrape(m)
    assert value(samples["tether_alarms_answered"], reason="manual") == 2
    assert value(samples["tether_alarms_answered"], reason="hang") == 1
    assert value(samples["tether_dumps_written"], reason="manual") == 1
    assert value(samples["tether_dump_failures"], reason="manual") == 1


# -- rank 0's job-wide exposition ---------------------------------------------------------------
def exposition(texts: dict[int, str | None]) -> str:
    """Rank 0's ``/metrics/job`` by rank of what each rank's ``/metrics`` said (None: no
    answer); a text that cannot be parsed counts as no answer."""
    parsed = {r: parse_exposition(t)[0] if t is not None else None for r, t in texts.items()}
    return job_exposition(parsed).decode()


def test_the_job_exposition_labels_every_sample_with_its_rank(tmp_path: Path) -> None:
    ranks = [rank_report(tmp_path) for _ in range(3)]
    for rank, m in enumerate(ranks):
        m.recorder.global_rank = 0  # a rank's own label is overridden by where it came from
        issue(group(m, "0", "default_pg"), n=rank + 1)
    texts: dict[int, str | None] = {r: m.metrics() for r, m in enumerate(ranks)}
    texts[3] = None  # timed out
    texts[4] = "garbage{"
    text = exposition(texts)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert text.count("# TYPE tether_operations_recorded_total counter") == 1, "one block each"
    up = {s.labels["rank"]: s.value for s in families["tether_rank_up"].samples}
    assert up == {"0": 1, "1": 1, "2": 1, "3": 0, "4": 0}
    recorded = families["tether_operations_recorded"].samples
    assert {s.labels["rank"]: s.value for s in recorded} == {"0": 1, "1": 2, "2": 3}
    assert sum(s.value for s in recorded) == 6, "Prometheus can sum the job"
    for family in families.values():
        assert all("rank" in s.labels for s in family.samples)


def test_the_job_exposition_has_one_family_per_name_whatever_the_ranks_send() -> None:
    text = exposition(
        {
            0: "# TYPE x_total counter\nx_total 1\n",
            1: "# TYPE x_total gauge\nx_total 2\n# TYPE tether_rank_up gauge\ntether_rank_up 0\n",
        }
    )
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert sorted(types) == ["tether_rank_up", "x_total"], text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    up = {s.labels["rank"]: s.value for s in families["tether_rank_up"].samples}
    assert up == {"0": 1, "1": 1}, "a rank cannot say who answered"
    assert [s.value for s in families["x"].samples] == [1], "the first rank's family is kept"


# -- file-based service discovery ---------------------------------------------------------------
@pytest.fixture
def board() -> Iterator[AlarmBoard]:
    yield AlarmBoard(dist.HashStore())


def test_the_targets_file_is_written_once_every_rank_is_known(
    board: AlarmBoard, tmp_path: Path
) -> None:
    path = targets_file(tmp_path, "job-7")
    writer = TargetsWriter(board, path, job_id="job-7", world_size=2, attempt=0, poll_s=0.01)
    board.publish_proc(0, {"debug_url": "http://node-a:8000", "attempt": 0})
    board.publish_proc(1, {"debug_url": "http://node-b:41234", "attempt": 1})  # a later attempt
    writer.start()
    try:
        assert not writer.written.wait(0.2) and not path.exists(), "rank 1 of attempt 0 unknown"
        board.publish_proc(1, {"debug_url": "http://[::1]:41235", "attempt": 0})
        assert writer.written.wait(10)
    finally:
        writer.close()
    assert json.loads(path.read_text()) == [
        {"targets": ["node-a:8000", "[::1]:41235"], "labels": {"tether_job_id": "job-7"}}
    ]
    assert job_files(tmp_path) == [], "a targets file is not a job file"
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temporary file left"


def test_ranks_that_never_publish_leave_the_others_listed(
    board: AlarmBoard, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = targets_file(tmp_path, "job-7")
    board.publish_proc(1, {"debug_url": "http://node-b:1"})
    writer = TargetsWriter(board, path, job_id="j", world_size=3, attempt=0, wait_s=0, poll_s=0)
    writer.start()
    assert writer.written.wait(10)
    writer.close()
    assert json.loads(path.read_text())[0]["targets"] == ["node-b:1"]
    assert "ranks 0, 2 published no debug server" in caplog.text


def test_targets_are_host_and_port() -> None:
    assert targets({1: "http://b:2", 0: "http://a:1"}, "j") == [
        {"targets": ["a:1", "b:2"], "labels": {"tether_job_id": "j"}}
    ]


# -- a clean exit leaves nothing behind ---------------------------------------------------------
def connected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stacks_text: str = "") -> JobLink:
    """Rank 0 of a job of one, connected to a real store; its stacks file holds ``stacks_text``
    (not this test process's real handler); faulthandler is left as it is."""
    stacks = tmp_path / ".stacks" / "node-a-1.txt"

    def arm(directory: Path, host: str) -> Path:
        stacks.parent.mkdir(parents=True, exist_ok=True)
        stacks.write_text(stacks_text)
        return stacks

    monkeypatch.setattr("tether.watchdog.link.arm_stack_signal", arm)
    monkeypatch.setattr("tether.watchdog.link._fatal_to_stderr", lambda: True)
    recorder = Recorder(Config(dump_dir=tmp_path, job_id="job-7", debug_port=None))
    recorder.global_rank, recorder.world_size = 0, 1
    m = JobLink(recorder)
    m.connect(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
    return m


def files(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.rglob("*") if p.is_file())


@pytest.mark.parametrize("clean", [True, False])
def test_a_clean_exit_removes_the_job_targets_and_stacks_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean: bool
) -> None:
    m = connected(tmp_path, monkeypatch)
    targets = targets_file(tmp_path, "job-7")
    targets.write_text("[]")
    m.wrote(targets)  # as the server's writer tells it
    assert job_file(tmp_path, "job-7").is_file()
    m.close(clean=clean)
    kept = ["job-7.json", "job-7.targets.json", "node-a-1.txt"]
    assert files(tmp_path) == ([] if clean else kept)


def test_a_clean_exit_keeps_a_stacks_file_with_anything_in_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = connected(tmp_path, monkeypatch, stacks_text="Fatal Python error: Segmentation fault\n")
    m.close(clean=True)
    assert files(tmp_path) == ["node-a-1.txt"]


def test_an_empty_stacks_file_stays_where_faulthandler_cannot_write_to_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = connected(tmp_path, monkeypatch)
    # A crash later in the shutdown would write into a removed file: the file stays instead.
    monkeypatch.setattr("tether.watchdog.link._fatal_to_stderr", lambda: False)
    m.close(clean=True)
    assert files(tmp_path) == ["node-a-1.txt"]


def test_a_clean_exit_removes_only_the_files_this_process_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    targets = targets_file(tmp_path, "job-7")
    targets.parent.mkdir(parents=True)
    targets.write_text("[]")  # another process's: this rank's server is off and wrote none
    m = connected(tmp_path, monkeypatch)
    m.close(clean=True)
    assert files(tmp_path) == ["job-7.targets.json"]
