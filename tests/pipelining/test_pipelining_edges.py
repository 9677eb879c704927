"""Per-edge P2P groups (``TORCH_DISTRIBUTED_PIPELINE_PER_EDGE_P2P=1``) in a real 4-process gloo
job recorded by tether (``tests/workers/pipeline_edges.py``), against the same job without them:
every activation and gradient moves over its edge's group, the recorder records them there,
and ``tether analyze`` reads the event with each edge as a group of its own. On torch 2.15 the
groups are torch's own (split from the pipeline's group, one per directed edge and split round),
recorded as tether records any split group."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests._jobs import launch, new_store, tether_cli, worker_env

pytestmark = [pytest.mark.every_torch, pytest.mark.slow]

VAR = "TORCH_DISTRIBUTED_PIPELINE_PER_EDGE_P2P"


def _job(tmp: Path, per_edge: bool) -> tuple[list[dict[str, Any]], Path]:
    store = new_store()
    dumps = tmp / ("edges" if per_edge else "shared") / "dumps"
    job = launch(
        "pipeline_edges.py",
        4,
        port=store.port,
        dump_dir=dumps,
        timeout=240,
        env=worker_env(**{VAR: "1" if per_edge else "0"}),
    )
    return job.results(), dumps


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, tuple[list[dict[str, Any]], Path]]:
    tmp = tmp_path_factory.mktemp("pipelining_edges")
    return {per_edge: _job(tmp, per_edge) for per_edge in (True, False)}


@pytest.mark.timeout(600)
def test_training_matches_the_reference_with_and_without_edge_groups(
    jobs: dict[bool, tuple[list[dict[str, Any]], Path]],
) -> None:
    for per_edge, (seen, _) in jobs.items():
        for out in seen:
            assert out["per_edge"] is per_edge
            for name, err in out["grad_rel_err"].items():
                assert err < 1e-5, (per_edge, out["rank"], name)


@pytest.mark.timeout(600)
def test_every_transfer_moves_to_its_edge_group(
    jobs: dict[bool, tuple[list[dict[str, Any]], Path]],
) -> None:
    edged, shared = jobs[True][0], jobs[False][0]
    for on, off in zip(edged, shared, strict=True):
        me = on["rank"]
        planned = on["planned"]
        assert planned == off["planned"] and planned
        # This rank's groups: the job's default group and one per edge it sends or receives on.
        assert set(on["edge_groups"]) == set(planned) and on["other_groups"] == ["default_pg"], me
        assert off["edge_groups"] == [] and off["other_groups"] == ["default_pg"], me
        for edge, count in planned.items():  # every planned transfer, and set-up traffic
            assert on["p2p_entries"][edge] == count, (me, edge)
            assert on["setup_entries"][edge] >= 1, (me, edge)  # a warm-up at least
        assert set(on["p2p_entries"]) == set(planned), me  # none left on the default group
        assert off["p2p_entries"] == {"default_pg": sum(planned.values())}, me


@pytest.mark.timeout(600)
def test_1f1b_releases_each_output_once_its_send_is_waited(
    jobs: dict[bool, tuple[list[dict[str, Any]], Path]],
) -> None:
    for seen, _ in jobs.values():
        for out in seen:
            stage, n_stages = out["rank"], out["world"]
            warmup = n_stages - stage  # torch's loop holds every warm-up forward's outputs
            expected = 0 if stage == n_stages - 1 else min(2, warmup)
            assert out["fwd_outputs_peak_1f1b"] == expected, out["rank"]
    assert jobs[True][0][0]["fwd_outputs_peak_1f1b"] == 2  # the first stage: 2, not 4


@pytest.mark.timeout(600)
def test_tether_analyze_reads_edge_groups_as_groups(
    jobs: dict[bool, tuple[list[dict[str, Any]], Path]], tmp_path: Path
) -> None:
    dumps = jobs[True][1]
    trace = tmp_path / "trace.json"
    out = tether_cli("analyze", str(dumps), "--json", "--chrome-trace", str(trace))
    assert out.returncode == 0, out.stderr
    diagnosis = json.loads(out.stdout)
    assert diagnosis["verdict"] == "healthy" and diagnosis["ranks_loaded"] == 4
    assert diagnosis["unmatched_p2p"] == []  # each send met its receive on the edge's group
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    threads = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    descs = {desc for out in jobs[True][0] for desc in out["edge_descs"]}
    assert descs
    for desc in descs:
        assert any(name.endswith(f"({desc})") for name in threads), (desc, threads)
