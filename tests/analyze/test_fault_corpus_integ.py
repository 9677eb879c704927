"""The fault corpus: each job a real ``tether run`` job, diagnosed by the analyzer.

The jobs are tests/workers/faultjobs.py's table: backend aborts, dead ranks, stuck C code, busy
side groups and a late arrival, what real training code showed (a preempted FSDP2 run, a
frozen rank, a rank waiting on a child process, framework-shaped jobs, an FSDP2 backward), and an
exception in one rank's own code (DDP or plain collectives, with and without its dump). They
run once per module, three at once, those the selected tests need (the fast tier: one job of
each class; ``make test-all``: every job); each test checks one job: what ``tether run`` did (exit
code, its last line, the stacks files, what outlived it) and what ``tether analyze`` says
(verdict, culprit ranks, operation, the culprit's line).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

import tether
from tests._jobs import leftovers
from tests.workers.faultjobs import (
    CLASSES,
    JOBS,
    SCRIPT,
    FaultJob,
    Outcome,
    line_of,
    reasons,
    run_jobs,
)
from tether.analyze import Diagnosis, analyze
from tether.analyze.model import _reduce, canonical_op, read_rank
from tether.events.columns import columns_file
from tether.events.layout import rank_file
from tether.events.load import find_dump_files, load_trace
from tether.events.stacks import parse_header, stacks_file

pytestmark = pytest.mark.python_recorder

JOB_DEADLINE_S = 75.0
"""A job still running this long is killed (and its test fails): the slowest ends in ~35 s."""
CORPUS_TIMEOUT_S = 420
"""The first test starts the corpus (the whole of it: about 3 minutes on 2 cores); the others
reuse it."""
OLD_ABORT_GRACE_S = 30.0
"""How long the launcher used to wait for a frozen rank's dump before ending the job."""


FAST = ("abort-allreduce-size", "dead-sigkill", "stuck-gil-sleep", "busy-side-4")
FAST += ("frozen-sigstop", "raise-ddp-3", "leave-plain-3", "absent-new-group-3")
"""One job of each class, in the fast tier; the others are marked slow."""
NEEDS = {
    "test_frozen_rank_is_read_without_being_resumed": "frozen-sigstop",
    "test_fsdp_backward_collective_keeps_the_users_line": "fsdp-backward",
}
"""The job each of the other corpus tests reads."""


def _jobs_selected(request: pytest.FixtureRequest) -> dict[str, FaultJob]:
    names = set()
    for item in request.session.items:
        if not isinstance(item, pytest.Function) or item.path != request.path:
            continue
        if item.originalname == "test_fault_job_is_diagnosed":
            names.add(item.callspec.params["name"])
        elif item.originalname in NEEDS:
            names.add(NEEDS[item.originalname])
    return {name: job for name, job in JOBS.items() if name in names}


@pytest.fixture(scope="module")
def corpus(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Outcome]:
    jobs = _jobs_selected(request)
    return run_jobs(jobs, tmp_path_factory.mktemp("faults"), deadline_s=JOB_DEADLINE_S)


@pytest.fixture(scope="module")
def diagnoses(corpus: dict[str, Outcome]) -> dict[str, Diagnosis]:
    return {
        name: analyze(event)
        for name, outcome in corpus.items()
        if (event := outcome.event()) is not None
    }


def test_every_class_has_several_varied_jobs() -> None:
    assert set(CLASSES) == {
        "backend-abort",
        "dead-rank",
        "stuck-c",
        "busy-groups",
        "real-code",
        "exception",
        "left",
        "absent",
    }
    for cls in CLASSES:
        jobs = [job for job in JOBS.values() if job.cls == cls]
        assert len(jobs) >= 3, cls
        assert len({job.culprits for job in jobs}) >= 2, f"{cls}: one culprit rank only"
        # A backend abort needs 4 ranks: on 3, the two survivors' dumps tie over the odd sizes.
        assert len({job.world_size for job in jobs}) >= 2 or cls == "backend-abort", cls
    for job in JOBS.values():
        for marker in markers(job):
            line_of(marker)  # exactly one line holds it


def markers(job: FaultJob) -> tuple[str, ...]:
    if job.marker is None:
        return ()
    return job.marker if isinstance(job.marker, tuple) else (job.marker,)


def stacks_of(event: Path, rank: int) -> tuple[dict[str, object], str]:
    path = stacks_file(event, rank)
    assert path.is_file(), f"no {path.name} in {sorted(p.name for p in event.iterdir())}"
    text = path.read_text()
    header = parse_header(text.splitlines()[0])
    assert header is not None, text[:300]
    return dict(header), text


def last_line(log: str) -> str:
    return next((line for line in reversed(log.splitlines()) if line.strip()), "")


@pytest.mark.timeout(CORPUS_TIMEOUT_S)
@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in JOBS]
)
def test_fault_job_is_diagnosed(
    name: str, corpus: dict[str, Outcome], diagnoses: dict[str, Diagnosis]
) -> None:
    job, outcome = JOBS[name], corpus[name]
    log = outcome.log[-6000:]
    assert outcome.exit_code is not None, f"tether run did not end within {JOB_DEADLINE_S}s:\n{log}"
    event = outcome.event()
    endings = tuple(f"-{r}" for r in reasons(job))
    assert event is not None and event.name.endswith(endings), (outcome.events(), log)

    # What tether run did.
    if job.exit_code is not None:
        assert outcome.exit_code == job.exit_code, log
    elif "crash" in reasons(job):
        assert outcome.exit_code != 0, log
    if set(reasons(job)) & {"hang", "crash"}:
        # The last line names the event and the next command.
        line = last_line(outcome.log)
        assert str(event) in line and "tether analyze" in line, line
    if job.child:
        assert list(outcome.sync.glob("child_*")), "the culprit never started its child"
        assert outcome.children_left == [], f"children outlived the job: {outcome.children_left}"
    if job.ends_fast:
        assert outcome.end_after_event_s is not None
        assert outcome.end_after_event_s < OLD_ABORT_GRACE_S, log

    # Nothing of the job stays beside its events however it ended: no ring file, no job or
    # targets file, no empty stacks file.
    assert leftovers(outcome.dumps) == [], leftovers(outcome.dumps)

    # What the analyzer says.
    d = diagnoses[name]
    report = json.dumps(d.to_json(), indent=1)
    assert d.event == event.name
    assert (d.verdict, d.culprit_ranks) == (job.verdict, list(job.culprits)), report
    if job.op is not None:
        assert d.op is not None and canonical_op(d.op) == job.op, report
    if job.group is not None:
        assert d.process_group is not None and d.process_group.desc == job.group, report
    if job.sides is not None:  # each side's sizes or dtypes are shown
        issued = [e for e in d.evidence if "issued" in e]
        for side in job.sides:
            assert any(side in e for e in issued), (side, report)
    if job.marker is not None:
        (culprit,) = job.culprits
        wheres = [f"{SCRIPT.name}:{line_of(m)} " for m in markers(job)]
        # The line shown, or the line of the job's code that called the helper of the same
        # file it was in (a late rank caught building its collective's tensor, step_tensor()).
        tb = d.culprit_tracebacks.get(culprit, [])
        own = list(itertools.takewhile(lambda line: SCRIPT.name in line, tb))
        shown = [d.culprit_stacks.get(culprit, ""), *own]
        assert any(where in line for where in wheres for line in shown), (wheres, report)
    if job.verdict == "healthy":
        assert not d.stragglers and not d.dead_ranks, report

    # An exception: its type and message, and the culprit's line is where it raised. The rank
    # wrote its own dump, unless told to exit at once: then its ring file and torchrun's error
    # file speak for it.
    if job.exception is not None:
        (culprit,) = job.culprits
        assert d.exceptions == {culprit: job.exception}, report
        lingers = dict(job.env).get("TETHER_EXIT_LINGER") != "0"
        assert (culprit in d.recovered_ranks) is not lingers, report
        assert any(job.exception in e for e in d.evidence), report
        assert f"rank {culprit} failed (exit code 1): {job.exception}" in last_line(outcome.log)

    # A rank that left early: named so, with its record (kept when it left) and its last op.
    if job.cls == "left":
        (culprit,) = job.culprits
        assert d.dead_ranks.get(culprit) == "left the job (exit code 0)", report
        assert culprit in d.recovered_ranks and culprit in d.per_rank, report
        assert any(f"rank {culprit} left the job" in e for e in d.evidence), report

    # A rank the backend aborted: a consequence, not a culprit, with its stacks at death.
    for victim in job.victims:
        assert victim in d.dead_ranks and "SIGABRT" in d.dead_ranks[victim], report
        header, _ = stacks_of(event, victim)
        assert (header.get("method"), header.get("when")) == ("fatal-signal", "death"), header
    if job.cls == "dead-rank" and job.stacks is None:  # SIGKILL: no handler could run
        assert not stacks_file(event, job.culprits[0]).exists()
        assert any("SIGKILL" in e and "stacks" in e for e in d.evidence), report
    # A rank that died keeps its record: its ring file, recovered by the launcher into the event.
    if job.cls == "dead-rank":
        assert d.recovered_ranks == list(job.culprits), report
        for culprit in job.culprits:
            assert tether.load_dump(rank_file(event, culprit))["tether"]["recovered"]["after_death"]
    # The culprit's stacks, where it could not write its own dump.
    if job.stacks is not None:
        (culprit,) = job.culprits
        header, text = stacks_of(event, culprit)
        assert header.get("method") == job.stacks, header
        assert header.get("when") == ("death" if job.stacks == "fatal-signal" else "unresponsive")
        (marker,) = markers(job)
        assert f'{SCRIPT}", line {line_of(marker)} in ' in text, text[:2000]


@pytest.mark.timeout(CORPUS_TIMEOUT_S)
def test_frozen_rank_is_read_without_being_resumed(corpus: dict[str, Outcome]) -> None:
    outcome = corpus["frozen-sigstop"]
    event = outcome.event()
    assert event is not None, outcome.log[-3000:]
    (culprit,) = JOBS["frozen-sigstop"].culprits
    header, _ = stacks_of(event, culprit)
    assert header.get("state") == "stopped", header
    # The launcher counts who dumped instead of claiming every rank did.
    assert "every rank's dump is in" not in outcome.log, outcome.log[-3000:]


@pytest.mark.timeout(CORPUS_TIMEOUT_S)
@pytest.mark.slow
def test_fsdp_backward_collective_keeps_the_users_line(corpus: dict[str, Outcome]) -> None:
    """At the default depth (16), the frames of a collective issued inside FSDP2's backward are
    torch's autograd and FSDP frames; the job's ``loss.backward()`` line must still be there."""
    (name,) = [n for n, job in JOBS.items() if job.backward_frame]
    job, outcome = JOBS[name], corpus[name]
    event = outcome.event()
    assert event is not None, outcome.log[-3000:]
    line = line_of("fsdp-backward")
    waiting = [r for r in range(job.world_size) if r not in job.culprits]
    for rank in waiting:
        entries = tether.load_dump(event / f"rank_{rank}")["entries"]
        in_flight = [e for e in entries if e["state"] != "completed"]
        assert in_flight, f"rank {rank}: nothing in flight"
        frames = in_flight[-1]["frames"]
        assert any(f["filename"] == str(SCRIPT) and f["line"] == line for f in frames), json.dumps(
            frames, indent=1
        )


@pytest.mark.timeout(CORPUS_TIMEOUT_S)
def test_every_dump_of_a_real_job_has_columns_that_read_as_it(corpus: dict[str, Outcome]) -> None:
    """Every rank's dump in every event the jobs wrote (by the rank itself, or recovered from its
    ring file by the launcher) has its column file, and the analyzer reads the same from both."""
    read = 0
    for name, outcome in corpus.items():
        for event in outcome.events():
            for rank, dump in find_dump_files(event).items():
                cols = columns_file(event, rank)
                assert cols.is_file(), (name, dump)
                from_cols = read_rank(rank, dump)
                assert not from_cols.notes, (name, from_cols.notes)
                assert from_cols == _reduce(rank, dump, load_trace(dump)), (name, dump)
                read += 1
    assert read >= 2 * len(corpus)
