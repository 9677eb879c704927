"""The analyzer against real faults, and torch's analyzer on the same events.

The corpus is tests/workers/scenarios.py: each scenario a real gloo job recorded by tether, run
once per module (every forked job at once, the ``tether run`` crash job beside them). Each
diagnosis is checked for its verdict, culprit, group and operation; torch's ``fr_trace`` reads
the same events and what it says is checked against docs/analyze-vs-fr_trace.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._jobs import WORKERS, new_store, worker_env
from tests.workers.scenarios import SCENARIOS
from tether.analyze import Diagnosis, analyze
from tether.job.alarm import HANG_EXIT_CODE

pytestmark = pytest.mark.python_recorder

SCRIPT = WORKERS / "scenarios.py"
CORPUS_TIMEOUT_S = 75.0


def line_of(marker: str) -> int:
    lines = SCRIPT.read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if marker in text)


@dataclasses.dataclass(frozen=True)
class Expected:
    reason: str
    """The event's dump reason: "hang" (the watchdog's alarm), "end" (the job survived and every
    rank dumped), "crash" (tether run's dumps before teardown)."""
    verdict: str
    culprits: list[int]
    group: str | None = None
    """The process group's desc, where the diagnosis should name one."""
    op: str | None = None
    seq: int | None = None
    stuck_at: str | None = None
    """The marker of the line in scenarios.py where the culprit's stack shows it."""


EXPECTED: dict[str, Expected] = {
    "hang-before": Expected("hang", "hang", [1], "default_pg", "all_reduce", 4, "STUCK:hold"),
    "hang-inside": Expected("hang", "hang", [1], "default_pg", "all_reduce", 4, "STUCK:recv"),
    "desync-op": Expected("hang", "desync", [2], "default_pg", "all_reduce", 4, "DESYNC:op"),
    "desync-size": Expected("end", "desync", [2], "default_pg", "broadcast", 4),
    "desync-dtype": Expected("end", "desync", [1], "default_pg", "all_reduce", 4),
    "crash": Expected("crash", "crash", [1]),
    "straggler": Expected("end", "straggler", [2]),
    "subgroup-cascade": Expected("hang", "hang", [3], "pair23", "all_reduce", 2, "STUCK:hold"),
    "p2p-unmatched": Expected("hang", "hang", [0], "default_pg", stuck_at="STUCK:send"),
    "healthy": Expected("end", "healthy", []),
}


@dataclasses.dataclass
class Corpus:
    dumps: Path
    """DUMPS/<scenario>/<event id>/rank_N"""
    exit_codes: dict[str, list[int]]
    """Forked scenarios: each rank's exit code; ``tether run`` scenarios: the launcher's."""
    logs: dict[str, str]

    def event(self, name: str) -> Path:
        events = [p for p in (self.dumps / name).iterdir() if not p.name.startswith(".")]
        assert len(events) == 1, f"{name}: events {events}\n{self.logs[name]}"
        return events[0]


def _launch_under_tether_run(name: str, dumps: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [
                sys.executable, "-m", "tether.cli.main", "run", "--standalone",
                f"--nproc-per-node={SCENARIOS[name].world_size}", f"--dump-dir={dumps / name}",
                "--hang-timeout=30", "--debug-port=off", str(SCRIPT), "--scenario", name,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=worker_env(),
        )  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    root = tmp_path_factory.mktemp("corpus")
    dumps, logs = root / "dumps", root / "logs"
    logs.mkdir()
    forked = [name for name, s in SCENARIOS.items() if s.launcher == "fork"]
    launched = {
        name: _launch_under_tether_run(name, dumps, logs / f"{name}.log")
        for name, s in SCENARIOS.items()
        if s.launcher == "tether run"
    }
    stores = {name: new_store() for name in forked}  # alive until every job has ended
    gate = root / "launched-jobs-ended"
    procs: list[subprocess.Popen[Any]] = list(launched.values())
    try:
        runner = subprocess.Popen(
            [
                sys.executable, str(SCRIPT), f"--dump-dir={dumps}", f"--log-dir={logs}",
                f"--deadline={CORPUS_TIMEOUT_S - 15}", f"--gate={gate}",
                *(f"{name}={store.port}" for name, store in stores.items()),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=worker_env(),
        )  # fmt: skip
        procs.append(runner)
        exit_codes = {name: [proc.wait(CORPUS_TIMEOUT_S)] for name, proc in launched.items()}
        gate.touch()  # the runner's timing scenarios now have the machine to themselves
        out, err = runner.communicate(timeout=CORPUS_TIMEOUT_S)
        assert runner.returncode == 0, out + err
        exit_codes.update(json.loads(out.splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    texts = {name: (logs / f"{name}.log").read_text(errors="replace") for name in launched}
    for name in forked:
        texts[name] = "\n".join(
            f"--- rank {r}\n{(logs / name / f'rank_{r}.log').read_text(errors='replace')}"
            for r in range(SCENARIOS[name].world_size)
        )
    return Corpus(dumps, exit_codes, texts)


@pytest.fixture(scope="module")
def diagnoses(corpus: Corpus) -> dict[str, Diagnosis]:
    return {name: analyze(corpus.dumps / name) for name in SCENARIOS}


def test_every_scenario_has_an_expectation() -> None:
    assert sorted(EXPECTED) == sorted(SCENARIOS)
    for name, scenario in SCENARIOS.items():
        assert EXPECTED[name].culprits == ([scenario.culprit] if scenario.culprit >= 0 else [])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_analyzer_names_the_culprit(
    name: str, corpus: Corpus, diagnoses: dict[str, Diagnosis]
) -> None:
    expected, scenario = EXPECTED[name], SCENARIOS[name]
    event = corpus.event(name)
    # The job did what the scenario says.
    assert event.name.endswith(f"-{expected.reason}"), corpus.logs[name]
    codes = corpus.exit_codes[name]
    if scenario.launcher == "tether run":
        assert codes[0] != 0, corpus.logs[name]
    else:
        wanted = HANG_EXIT_CODE if expected.reason == "hang" else 0
        assert codes == [wanted] * scenario.world_size, corpus.logs[name]

    d = diagnoses[name]
    report = json.dumps(d.to_json(), indent=1)
    assert d.event == event.name
    assert (d.verdict, d.culprit_ranks) == (expected.verdict, expected.culprits), report
    if expected.group is not None:
        assert d.process_group is not None and d.process_group.desc == expected.group, report
    if expected.op is not None:
        assert (d.op, d.collective_seq_id) == (expected.op, expected.seq), report
    if expected.stuck_at is not None:
        (culprit,) = expected.culprits
        where = f"{SCRIPT.name}:{line_of(expected.stuck_at)} "
        assert where in d.culprit_stacks[culprit], report
    if expected.verdict == "healthy":
        assert not d.stragglers and not d.missing_dumps, report


def test_subgroup_hang_names_the_root_cause_not_the_waiting_ranks(
    diagnoses: dict[str, Diagnosis],
) -> None:
    d = diagnoses["subgroup-cascade"]
    # 0 and 1 wait in the world group for 2 and 3; 2 waits in [2, 3] for 3: only 3 is the cause.
    assert d.culprit_ranks == [3]
    assert d.process_group is not None and d.process_group.ranks == [2, 3]


def test_crash_names_the_dead_rank_and_recovers_its_record(diagnoses: dict[str, Diagnosis]) -> None:
    d = diagnoses["crash"]
    assert (d.missing_dumps, d.recovered_ranks) == ([], [1])  # its ring file, read by the launcher
    assert "SIGKILL" in d.dead_ranks[1]


def test_straggler_lag_is_measured_per_rank(diagnoses: dict[str, Diagnosis]) -> None:
    d = diagnoses["straggler"]
    lags = {s.rank: s.mean_lag_ms for s in d.stragglers}
    assert 2 in lags and lags[2] == max(lags.values())


def test_unmatched_p2p_names_the_pair(diagnoses: dict[str, Diagnosis]) -> None:
    d = diagnoses["p2p-unmatched"]
    pairs = {(u.src, u.dst) for u in d.unmatched_p2p}
    assert (0, 1) in pairs


def test_cli_json_is_the_same_diagnosis(corpus: Corpus, diagnoses: dict[str, Diagnosis]) -> None:
    name = "subgroup-cascade"
    proc = subprocess.run(
        [sys.executable, "-m", "tether.cli.main", "analyze", str(corpus.dumps / name), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=worker_env(),
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    issue_keys = {
        "event", "verdict", "culprit_ranks", "process_group", "collective_seq_id", "op",
        "evidence", "stragglers", "missing_dumps",
    }  # fmt: skip
    assert issue_keys <= set(out)
    assert {k: out[k] for k in issue_keys} == {
        k: v for k, v in diagnoses[name].to_json().items() if k in issue_keys
    }
    assert out["verdict"] == "hang" and out["culprit_ranks"] == [3]
    assert (out["process_group"]["desc"], out["process_group"]["ranks"]) == ("pair23", [2, 3])


# -- torch's analyzer on the same events (docs/analyze-vs-fr_trace.md) -------------------------

FR_TRACE = ["-m", "torch.distributed.flight_recorder.fr_trace"]

# fr_trace's own main(), run once per event in one process (importing torch costs seconds);
# its findings go to the "Flight Recorder" logger, whose handler is pointed at a buffer per run.
FR_TRACE_DRIVER = r"""
import contextlib, io, json, logging, sys, traceback
from torch.distributed.flight_recorder import fr_trace
handlers = logging.getLogger("Flight Recorder").handlers
runs = {}
for key, argv in json.loads(sys.argv[1]).items():
    buf = io.StringIO()
    for handler in handlers:
        handler.setStream(buf)
    error = None
    try:
        with contextlib.redirect_stdout(buf):
            fr_trace.main(argv)
    except BaseException as exc:
        error = "".join(traceback.format_exception_only(exc)).strip()
    runs[key] = {"output": buf.getvalue(), "error": error}
print(json.dumps(runs))
"""


@dataclasses.dataclass(frozen=True)
class FrFinding:
    kind: str
    """"missing" (Not all ranks joining collective) or "errors" (sequence number has errors)."""
    seq: int
    group: str
    """fr_trace's "group info": ``<name>:<desc>``."""
    op: str
    """fr_trace's "collective": the profiling name, ``gloo:all_reduce``, ``gloo:send 0->1``."""
    missing: frozenset[int]
    culprits: frozenset[int]
    """The "Culprit rank r" of every error."""
    error_types: frozenset[str]


@dataclasses.dataclass(frozen=True)
class FrRun:
    findings: list[FrFinding]
    undecided: int
    """Lines "No errors found for this collective entry, There could be some other reasons why
    we see collective timeout": entries fr_trace no longer pairs after a group's first mismatch."""
    cannot_decide: int
    """Lines "We cannot decide what's wrong with this collective entry because we missed FR
    dumps from ranks ..." (with --allow-incomplete-ranks)."""
    error: str | None
    """How fr_trace failed, if it raised."""

    def culprits(self) -> set[int]:
        return {r for f in self.findings for r in f.culprits}


_HEADS = (
    ("missing", re.compile(r"^Not all ranks joining collective, sequence number: (\d+)$")),
    ("errors", re.compile(r"^Collective sequence number: (\d+) has errors$")),
)


def _ranks(text: str) -> frozenset[int]:
    return frozenset(int(r) for r in re.findall(r"\d+", text))


def parse_fr_trace(output: str, error: str | None) -> FrRun:
    findings: list[FrFinding] = []
    block: dict[str, Any] | None = None

    def close() -> None:
        if block is not None:
            findings.append(FrFinding(**block))

    for line in output.splitlines():
        for kind, head in _HEADS:
            if m := head.match(line):
                close()
                block = dict(kind=kind, seq=int(m[1]), group="", op="", missing=frozenset(),
                             culprits=frozenset(), error_types=frozenset())  # fmt: skip
        if block is None:
            continue
        if line.startswith("group info: "):
            block["group"] = line.removeprefix("group info: ")
        elif line.startswith("collective: "):
            block["op"] = line.removeprefix("collective: ")
        elif line.startswith("missing ranks: "):
            block["missing"] = _ranks(line.removeprefix("missing ranks: "))
        elif line.startswith("error msg: "):
            errors = re.findall(r"Culprit rank (\d+); Error type: (\w+)", line)
            block["culprits"] = frozenset(int(r) for r, _ in errors)
            block["error_types"] = frozenset(kind for _, kind in errors)
    close()
    return FrRun(
        findings=findings,
        undecided=output.count("No errors found for this collective entry"),
        cannot_decide=output.count("We cannot decide what's wrong with this collective entry"),
        error=error,
    )


def reading_order(event: Path) -> list[int]:
    """The ranks in the order fr_trace reads their files (``os.walk``'s): it compares every rank
    with the first one read."""
    return [
        int(f.removeprefix("rank_"))
        for _, _, files in os.walk(event)
        for f in files
        if f.startswith("rank_")
    ]


def read_first(event: Path, first: int, into: Path) -> Path:
    """A copy of ``event`` whose file of rank ``first`` fr_trace reads first: os.walk lists a
    directory's files before its subdirectories' files."""
    into.mkdir(parents=True)
    (into / "others").mkdir()
    for f in event.glob("rank_*"):
        rank = int(f.name.removeprefix("rank_"))
        shutil.copy(f, into / f.name if rank == first else into / "others" / f.name)
    assert reading_order(into)[0] == first
    return into


@dataclasses.dataclass
class FrRuns:
    runs: dict[str, FrRun]
    """fr_trace on every scenario's event (key: the scenario), and on each desync's event copied so
    that it reads the culprit's file first, then a healthy rank's (``NAME@culprit-first``,
    ``NAME@healthy-first``)."""
    printed: dict[str, str]
    """What the driver printed per key (``output``), to compare with the real command's."""
    command: subprocess.CompletedProcess[str]
    """``python -m torch.distributed.flight_recorder.fr_trace`` on hang-before's event."""

    def __getitem__(self, key: str) -> FrRun:
        return self.runs[key]


@pytest.fixture(scope="module")
def fr_runs(corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> FrRuns:
    layouts = tmp_path_factory.mktemp("fr-layouts")
    argv: dict[str, list[str]] = {}
    for name in SCENARIOS:
        argv[name] = [str(corpus.event(name)), "-p", "rank_"]
    for name in ("desync-op", "desync-size", "desync-dtype"):
        culprit, event = SCENARIOS[name].culprit, corpus.event(name)
        healthy = 0 if culprit != 0 else 1
        for label, first in (("culprit-first", culprit), ("healthy-first", healthy)):
            copy = read_first(event, first, layouts / f"{name}@{label}")
            argv[f"{name}@{label}"] = [str(copy), "-p", "rank_"]
    # The command itself once, beside the driver: both import torch, which takes seconds.
    command = subprocess.Popen(
        [sys.executable, *FR_TRACE, *argv["hang-before"]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(),
    )  # fmt: skip
    try:
        driver = subprocess.run(
            [sys.executable, "-c", FR_TRACE_DRIVER, json.dumps(argv)],
            capture_output=True, text=True, timeout=90, env=worker_env(),
        )  # fmt: skip
        out, err = command.communicate(timeout=90)
    finally:
        if command.poll() is None:
            command.kill()
            command.communicate()
    assert driver.returncode == 0, driver.stderr
    raw = json.loads(driver.stdout)
    return FrRuns(
        runs={key: parse_fr_trace(run["output"], run["error"]) for key, run in raw.items()},
        printed={key: run["output"] for key, run in raw.items()},
        command=subprocess.CompletedProcess(command.args, command.returncode, out, err),
    )


def _one(run: FrRun, **match: Any) -> FrFinding:
    found = [f for f in run.findings if all(getattr(f, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, run)
    return found[0]


def test_fr_trace_driver_prints_what_the_command_prints(fr_runs: FrRuns) -> None:
    command = fr_runs.command
    assert command.returncode == 0, command.stderr
    printed = [line for line in command.stderr.splitlines() if "tabulate" not in line]
    assert printed == fr_runs.printed["hang-before"].splitlines()


def test_fr_trace_agrees_on_a_rank_that_never_joins(
    fr_runs: FrRuns, diagnoses: dict[str, Diagnosis]
) -> None:
    run, d = fr_runs["hang-before"], diagnoses["hang-before"]
    assert run.error is None
    (finding,) = run.findings
    assert finding.kind == "missing" and finding.group == "0:default_pg"
    assert (finding.op, finding.seq) == (f"gloo:{d.op}", d.collective_seq_id)
    assert sorted(finding.missing) == d.culprit_ranks == [1]


def test_fr_trace_agrees_on_healthy(fr_runs: FrRuns) -> None:
    run = fr_runs["healthy"]
    assert run.error is None and run.findings == [] and run.undecided == 0


def test_fr_trace_has_no_straggler_view(fr_runs: FrRuns, diagnoses: dict[str, Diagnosis]) -> None:
    run = fr_runs["straggler"]
    assert run.error is None and run.findings == [] and run.undecided == 0
    assert diagnoses["straggler"].verdict == "straggler"


def test_fr_trace_reads_an_event_with_a_dead_ranks_recovered_record(
    fr_runs: FrRuns, diagnoses: dict[str, Diagnosis]
) -> None:
    # torch's analyzer refused this event while the dead rank's file was missing; with its
    # record recovered, it reads it and points at the dead rank too.
    run = fr_runs["crash"]
    assert run.error is None
    assert any(1 in f.culprits | f.missing for f in run.findings), run.findings
    assert diagnoses["crash"].culprit_ranks == [1]


@pytest.mark.parametrize("name", ["desync-op", "desync-size", "desync-dtype"])
def test_fr_trace_desync_culprit_is_relative_to_the_first_file_read(
    name: str, corpus: Corpus, fr_runs: FrRuns, diagnoses: dict[str, Diagnosis]
) -> None:
    scenario = SCENARIOS[name]
    everyone = set(range(scenario.world_size))
    culprit, others = {scenario.culprit}, everyone - {scenario.culprit}
    assert diagnoses[name].culprit_ranks == [scenario.culprit]
    # Read the odd rank first and fr_trace blames the whole majority; read a healthy rank first
    # and it blames the odd rank, like tether.
    assert fr_runs[f"{name}@culprit-first"].culprits() == others
    assert fr_runs[f"{name}@healthy-first"].culprits() == culprit
    # On the event as written, which one it says depends on the directory's listing order.
    first = reading_order(corpus.event(name))[0]
    assert fr_runs[name].culprits() == (others if first == scenario.culprit else culprit)
    (finding,) = fr_runs[name].findings
    assert finding.kind == "errors" and finding.seq == diagnoses[name].collective_seq_id


def test_fr_trace_stops_pairing_a_group_after_its_first_mismatch(
    fr_runs: FrRuns,
) -> None:
    # Both jobs ran one more, perfectly matched, world all_reduce after the desync: fr_trace no
    # longer pairs it and reports it as a possible timeout instead.
    for name in ("desync-size", "desync-dtype"):
        assert fr_runs[name].undecided == 1, fr_runs[name]


def test_fr_trace_checks_p2p_in_a_larger_group_like_a_collective(
    fr_runs: FrRuns, diagnoses: dict[str, Diagnosis]
) -> None:
    # hang-inside: it agrees that rank 1 never joined the all_reduce, and also reports rank 1's
    # receive as a collective that the healthy ranks 0 and 2 "did not join".
    run = fr_runs["hang-inside"]
    assert _one(run, op="gloo:all_reduce", seq=4).missing == {1}
    assert _one(run, op="gloo:recv 1<-2").missing == {0, 2}
    assert diagnoses["hang-inside"].culprit_ranks == [1]
    # p2p-unmatched: the same agreement on the all_reduce; the sends are reported with the
    # bystander rank 2 missing, not as a send without its receive.
    run = fr_runs["p2p-unmatched"]
    assert _one(run, op="gloo:all_reduce", seq=4).missing == {0}
    p2p = [f for f in run.findings if f.op != "gloo:all_reduce"]
    assert p2p and all(2 in f.missing for f in p2p), run
    assert diagnoses["p2p-unmatched"].culprit_ranks == [0]


def test_fr_trace_reports_the_cascade_without_its_root_cause(
    fr_runs: FrRuns, diagnoses: dict[str, Diagnosis]
) -> None:
    run = fr_runs["subgroup-cascade"]
    assert run.error is None
    assert {(f.group.split(":")[1], f.seq, f.missing) for f in run.findings} == {
        ("pair23", 2, frozenset({3})),
        ("default_pg", 4, frozenset({2, 3})),
    }
    assert diagnoses["subgroup-cascade"].culprit_ranks == [3]
