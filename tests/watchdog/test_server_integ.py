"""The debug server in a real 3-rank gloo job that hangs (tests/workers/served.py): rank 1 stops
joining collectives and ranks 0 and 2 wait for it. Each rank's endpoints, rank 0's cluster view,
and the page itself in headless Chromium, which must show rank 1 holding the job back."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pytest
import torch.distributed as dist
from prometheus_client.parser import text_string_to_metric_families

from tests._browser import chromium
from tests._jobs import new_store, start

pytestmark = pytest.mark.every_torch

WORLD = 3
T = TypeVar("T")


@dataclasses.dataclass
class HungJob:
    url: str
    """Rank 0's debug server."""
    store: dist.TCPStore
    tmp: Path
    procs: list[subprocess.Popen[bytes]]

    def log(self, rank: int) -> str:
        return (self.tmp / "logs" / f"rank_{rank}.log").read_text()

    def until(self, what: str, probe: Callable[[], T | None], timeout: float = 90.0) -> T:
        """Poll ``probe`` until it returns a value; fail with every rank's log past ``timeout``
        or as soon as a rank dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead:
                pytest.fail(f"rank {dead[0]} exited while waiting for {what}:\n{self.logs()}")
            got = probe()
            if got is not None:
                return got
            time.sleep(0.1)
        pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- rank {r}\n{self.log(r)}" for r in range(len(self.procs)))


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        body = response.read()
        is_json = response.headers.get_content_type() == "application/json"
        return json.loads(body) if is_json else body


def post(url: str) -> tuple[int, Any]:
    request = urllib.request.Request(url, method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, json.loads(response.read())


def debug_url(store: dist.TCPStore, rank: int) -> str | None:
    key = f"tether/proc/{rank}"
    if not store.check([key]):
        return None
    url = json.loads(store.get(key)).get("debug_url")
    return str(url) if url else None


def hung(view: dict[str, Any]) -> dict[str, Any] | None:
    """``view`` once the hang is complete: rank 1 named and every rank's hang dump written."""
    events = view["events"]
    if not (
        [h["rank"] for h in view["holding_back"]] == [1]
        and all(row["answered"] for row in view["ranks"])
        # each waiter's own watchdog has seen the hang, not only the first one's
        and [row["healthy"] for row in view["ranks"]] == [r == 1 for r in range(WORLD)]
        and events
        and len(events[-1]["done"]) == WORLD
    ):
        return None
    return view


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HungJob]:
    store = new_store()
    tmp = tmp_path_factory.mktemp("served")
    procs = start(
        "served.py",
        WORLD,
        "--hang-timeout",
        "3",
        port=store.port,
        dump_dir=tmp / "dumps",
        log_dir=tmp / "logs",
        # Set up for torch's recorder: each dump also lands as torch's single-rank file here.
        env={"TORCH_FR_DUMP_TEMP_FILE": str(tmp / "torch-fr" / "trace_")},
    )
    try:
        job = HungJob("", store, tmp, procs)
        job.url = job.until("rank 0's debug server", lambda: debug_url(store, 0))
        yield job
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(10)


@pytest.fixture(scope="module")
def view(job: HungJob) -> dict[str, Any]:
    """The cluster view once the hang is complete."""
    return job.until("the hang on /api/cluster", lambda: hung(get(f"{job.url}/api/cluster")))


@pytest.mark.timeout(240)
def test_rank_0_prints_its_cluster_page(job: HungJob, view: dict[str, Any]) -> None:
    assert job.log(0).count(f"tether: cluster page {job.url}/\n") == 1
    assert "cluster page" not in job.log(1) + job.log(2)


@pytest.mark.timeout(240)
def test_cluster_view_names_rank_1_and_lists_the_hang_dump(view: dict[str, Any]) -> None:
    (culprit,) = view["holding_back"]
    assert culprit["reason"].startswith("has not joined gloo:all_reduce #4 on group default_pg")
    rows = {row["rank"]: row for row in view["ranks"]}
    assert [rows[r]["healthy"] for r in range(WORLD)] == [False, True, False]
    assert rows[1]["holding_back"] and rows[1]["oldest_in_flight"] is None
    for waiter in (0, 2):
        op = rows[waiter]["oldest_in_flight"]
        assert (op["op"], op["collective_seq_id"]) == ("gloo:all_reduce", 4)
        assert op["group_label"] == "default_pg"
    pair = {g["group_label"]: g["seq"] for g in rows[0]["last_completed"]}
    assert pair == {"default_pg": 3, "pair": 3}
    event = view["events"][-1]
    assert event["reason"] == "hang" and set(event["done"]) == {"0", "1", "2"}
    dumped = sorted(p.name for p in Path(event["dir"]).iterdir() if p.name.startswith("rank_"))
    assert dumped == ["rank_0", "rank_1", "rank_2"]


@pytest.mark.timeout(240)
def test_every_rank_serves_its_own_state(job: HungJob, view: dict[str, Any]) -> None:
    for rank in range(WORLD):
        url = debug_url(job.store, rank)
        assert url is not None and url == view["ranks"][rank]["url"]
        assert get(f"{url}/health")["rank"] == rank
        trace = get(f"{url}/trace")
        assert trace["version"] == "2.10" and trace["tether"]["global_rank"] == rank
        assert ["0", "default_pg"] in [e["process_group"] for e in trace["entries"]]
        metrics = get(f"{url}/metrics").decode()
        assert f'tether_healthy{{rank="{rank}"}} {int(rank == 1)}.0' in metrics
    # The culprit's main thread is asleep in the worker, where its stack says.
    stacks = get(f"{view['ranks'][1]['url']}/stacks?format=text").decode()
    assert "'MainThread'" in stacks and "served.py" in stacks


@pytest.mark.timeout(240)
def test_post_dump_on_any_rank_makes_every_rank_dump(job: HungJob, view: dict[str, Any]) -> None:
    status, answer = post(f"{view['ranks'][2]['url']}/dump")
    assert status == 202 and answer["event_id"].endswith("-manual") and answer["origin"] == "rank 2"
    event_dir = Path(answer["dir"])

    def written() -> list[str] | None:
        files = event_dir.glob("rank_*") if event_dir.is_dir() else []
        names = sorted(p.name for p in files)  # complete files only: they appear in one step
        return names if len(names) == WORLD else None

    assert job.until("the manual dump on every rank", written) == ["rank_0", "rank_1", "rank_2"]
    listed = get(f"{job.url}/api/events?id={answer['event_id']}")
    assert listed["reason"] == "manual" and listed["origin"] == "rank 2"


@pytest.mark.timeout(240)
def test_rank_0_serves_the_whole_jobs_metrics(job: HungJob, view: dict[str, Any]) -> None:
    text = get(f"{job.url}/metrics/job").decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    up = {s.labels["rank"]: s.value for s in families["tether_rank_up"].samples}
    assert up == {"0": 1, "1": 1, "2": 1}
    # Three steps of all_reduce on the world; the waiters issued the fourth, the culprit did not.
    world = {
        s.labels["rank"]: s.value
        for s in families["tether_operations_recorded"].samples
        if (s.labels["group_desc"], s.labels["op"]) == ("default_pg", "gloo:all_reduce")
    }
    assert world == {"0": 4, "1": 3, "2": 4}
    enqueued = {
        (s.labels["rank"], s.labels["group_desc"]): s.value
        for s in families["tether_collectives_enqueued"].samples
    }
    assert {r: enqueued[r, "default_pg"] for r in "012"} == {"0": 4, "1": 3, "2": 4}
    assert (enqueued["0", "pair"], enqueued["1", "pair"]) == (3, 3)
    healthy = {s.labels["rank"]: s.value for s in families["tether_healthy"].samples}
    assert healthy == {"0": 0, "1": 1, "2": 0}
    hang_dumps = {
        s.labels["rank"]: s.value
        for s in families["tether_dumps_written"].samples
        if s.labels["reason"] == "hang"
    }
    assert hang_dumps == {"0": 1, "1": 1, "2": 1}
    for family in families.values():
        assert all("rank" in s.labels for s in family.samples), family.name
        if family.type == "counter":
            assert f"# TYPE {family.name}_total counter" in text


@pytest.mark.timeout(240)
def test_rank_0_lists_every_rank_for_prometheus(job: HungJob, view: dict[str, Any]) -> None:
    (path,) = (job.tmp / "dumps" / ".jobs").glob("*.targets.json")  # a file_sd_configs file
    (group,) = json.loads(path.read_text())
    assert group["targets"] == [urlsplit(row["url"]).netloc for row in view["ranks"]]
    assert path.name == f"{group['labels']['tether_job_id']}.targets.json"


class _Rows(HTMLParser):
    """The cluster table's rows: their attributes and text."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, tuple[dict[str, str | None], str]] = {}
        self.summary = ""
        self._rank: int | None = None
        self._attrs: dict[str, str | None] = {}
        self._in_summary = False
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "tr" and found.get("data-rank") is not None:
            self._rank, self._attrs, self._text = int(str(found["data-rank"])), found, []
        elif found.get("id") == "summary":
            self._in_summary = True

    def handle_data(self, data: str) -> None:
        if self._rank is not None:
            self._text.append(data)
        elif self._in_summary:
            self.summary += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr" and self._rank is not None:
            self.rows[self._rank] = (self._attrs, " ".join(self._text))
            self._rank = None
        elif tag == "div":
            self._in_summary = False


@pytest.mark.timeout(240)
def test_the_page_in_a_browser_shows_rank_1_holding_the_job_back(
    job: HungJob, view: dict[str, Any]
) -> None:
    profile = job.tmp / "chromium"
    dom = chromium(profile, "--dump-dom", f"{job.url}/").stdout
    page = _Rows()
    page.feed(dom)
    assert sorted(page.rows) == [0, 1, 2], dom[-3000:]
    attrs, text = page.rows[1]
    assert attrs["data-holding-back"] == "true" and attrs.get("class") == "holding-back"
    assert "holding back" in text and "healthy" not in text, "a culprit is not shown healthy"
    for waiter in (0, 2):
        attrs, text = page.rows[waiter]
        assert attrs["data-holding-back"] == "false"
        assert "hung" in text and "gloo:all_reduce #4" in text
    assert "Rank 1 holding the job back" in page.summary
    assert "has not joined gloo:all_reduce #4" in page.summary

    # For people to look at: the page as a browser draws it.
    shot = job.tmp / "cluster.png"
    chromium(profile, "--window-size=1400,800", f"--screenshot={shot}", f"{job.url}/")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshot: {shot}")


# -- torch's own debug frontend (torch.distributed.debug) driving tether's ranks ----------------


def handler(url: str, name: str, args: str = "") -> tuple[int, str]:
    """POST a torch worker route, as torch's frontend does."""
    request = urllib.request.Request(f"{url}/handler/{name}?{args}", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.timeout(240)
def test_every_rank_is_where_torchs_frontend_looks(job: HungJob, view: dict[str, Any]) -> None:
    registered = dist.PrefixStore("debug_server", job.store)  # torch's debug/_store.py
    for rank in range(WORLD):
        assert registered.get(f"rank{rank}").decode() == view["ranks"][rank]["url"]
        assert handler(view["ranks"][rank]["url"], "ping") == (200, "pong")


@pytest.mark.timeout(240)
def test_c10d_health_check_marks_gloo_unhealthy_where_the_hang_was_seen(
    job: HungJob, view: dict[str, Any]
) -> None:
    for rank in range(WORLD):
        status, text = handler(view["ranks"][rank]["url"], "c10d_health_check")
        assert status == 200
        expected = (
            {"healthy": True, "unhealthy_backends": []}
            if rank == 1  # the culprit waits in no collective: its watchdog saw nothing
            else {"healthy": False, "unhealthy_backends": ["gloo"]}
        )
        assert json.loads(text) == expected


@pytest.mark.timeout(240)
def test_each_dump_also_lands_where_torchs_recorder_writes_it(
    job: HungJob, view: dict[str, Any]
) -> None:
    from tether.events.load import load_dump

    for rank in range(WORLD):
        dump = load_dump(job.tmp / "torch-fr" / f"trace_{rank}")
        assert dump["version"] == "2.10" and dump["entries"]
        assert any(e["frames"] for e in dump["entries"]), (
            "stacks are in (TORCH_INCLUDE_STACK_TRACE)"
        )


@pytest.mark.timeout(240)
def test_health_check_driven_dump_as_torch_2_15s_frontend_does_it(
    job: HungJob, view: dict[str, Any]
) -> None:
    """2.15's C10dHealthCheckHandler: fetch c10d_health_check from every rank; for each backend
    a rank that answered 200 names unhealthy, POST fr_dump_file?backend=<b> to every rank."""
    urls = [view["ranks"][rank]["url"] for rank in range(WORLD)]
    files = [job.tmp / "torch-fr" / f"trace_{rank}" for rank in range(WORLD)]
    before = [f.stat().st_mtime_ns for f in files]
    unhealthy = set()
    for url in urls:
        status, text = handler(url, "c10d_health_check")
        if status == 200:
            unhealthy.update(json.loads(text)["unhealthy_backends"])
    assert unhealthy == {"gloo"}
    for rank, url in enumerate(urls):
        status, text = handler(url, "fr_dump_file", "backend=gloo")
        assert status == 200
        assert text in {
            f"Flight Recorder dump initiated for rank {rank}",
            f"Flight Recorder dump already in progress for rank {rank}",
        }

    from tether.events.load import load_dump

    def rewritten() -> list[dict[str, Any]] | None:
        if any(f.stat().st_mtime_ns == b for f, b in zip(files, before, strict=True)):
            return None
        return [load_dump(f) for f in files]

    for rank, dump in enumerate(job.until("every rank's fr_dump_file", rewritten)):
        assert dump["entries"] and all(e["frames"] == [] for e in dump["entries"]), "no stacks"
        assert {e["process_group"][0] for e in dump["entries"]} <= {"0", "1"}, rank
    # A backend this job does not use has nothing recorded, as torch's recorder for it would.
    status, text = handler(urls[0], "fr_trace_json", "backend=nccl")
    assert status == 200 and json.loads(text)["entries"] == []


@pytest.mark.timeout(240)
def test_torchs_frontend_shows_tether_ranks(
    job: HungJob, view: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's own frontend server (the one start_debug_server runs on rank 0), in this
    process, pointed at the job's store as it would be on rank 0."""
    pytest.importorskip("requests")
    pytest.importorskip("tabulate")
    from torch.distributed.debug._debug_handlers import FlightRecorderHandler, StacksHandler
    from torch.distributed.debug._frontend import FrontendServer

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(job.store.port))
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    handlers = [StacksHandler(), FlightRecorderHandler()]
    for h in handlers:
        h.fetch_timeout = 20.0
    frontend = FrontendServer(port=0, handlers=handlers)
    base = f"http://127.0.0.1:{frontend._server.server_port}"
    try:
        stacks = get(f"{base}/stacks").decode()
        # the culprit's main thread, asleep where the worker put it
        assert stacks.count("served.py") >= WORLD and "time.sleep(3600)" not in stacks
        fr = get(f"{base}/fr_trace").decode()
        # torch's analyzer built its tables from every rank's fr_trace_json: the hung
        # all_reduce the waiters are in is listed (only active entries are fetched)
        assert "Failed" not in fr and "all_reduce" in fr
    finally:
        frontend._server.shutdown()
        frontend._server.server_close()
