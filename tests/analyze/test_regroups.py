"""The sentences an elastic job's timeline makes in ``tether analyze``: a node lost whole and its
replacement node, written as the launchers write them."""

from __future__ import annotations

import json
from pathlib import Path

from tether.analyze.regroups import regroup_sentences
from tether.events.layout import elastic_timeline_file
from tether.job.elastic import Decision


def test_a_lost_node_and_its_replacement_read_as_one_sentence_each(tmp_path: Path) -> None:
    lost = Decision(1, (0, 1, 2, 3), dead={4: "node2 lost", 5: "node2 lost"})
    back = Decision(2, (0, 1, 2, 3, 4, 5), joined=(4, 5), fresh=(4, 5), joined_on="node2")
    regroup = {"step": 31, "since_decision_s": 0.91}
    healed = {"step": 40, "since_decision_s": 0.8, "heal_bytes": 52_000_000, "heal_s": 0.7}
    timeline = {
        "world_size": 6,
        "epochs": [
            {"decision": json.loads(lost.to_json()), "regrouped": regroup},
            {"decision": json.loads(back.to_json()), "regrouped": {**healed, "heal_over": "tcp"}},
        ],
    }
    path = elastic_timeline_file(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(timeline))
    assert regroup_sentences(tmp_path) == [
        "node2 (ranks 4-5) lost at step 31; survivors regrouped to 4 rank(s) in 0.91 s",
        "replacement for ranks 4-5 joined on node2 at step 40, healed from a survivor "
        "(52.0 MB in 0.70 s over tcp); regrouped to 6 rank(s) in 0.80 s",
    ]


def test_a_rank_death_and_an_unreported_regroup_are_said_as_they_are(tmp_path: Path) -> None:
    died = Decision(1, (0, 1, 3), dead={2: "signal SIGKILL"})
    path = elastic_timeline_file(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"world_size": 4, "epochs": [{"decision": json.loads(died.to_json())}]})
    )
    assert regroup_sentences(tmp_path) == [
        "rank 2 (signal SIGKILL) died; epoch 1: 3 rank(s) [0, 1, 3] (regroup not reported)"
    ]
