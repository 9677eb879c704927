"""``tether analyze``: name the culprit rank, the collective and the line, from a dump event.

    from tether.analyze import analyze, render
    d = analyze("tether-dumps")          # an event directory, or a dump directory (newest event)
    print(render(d))                     # a few lines for the on-call engineer
    d.to_json()                          # the --json object: event, verdict, culprit_ranks, ...

Reads tether's dumps and torch's native flight-recorder dumps (pickle or JSON, schema 2.10,
torch 2.13's gloo quirks, torchcomms), loading only plain data.
"""

from tether.analyze.diagnosis import VERDICTS, Diagnosis, GroupRef, Straggler, UnmatchedP2P, Verdict
from tether.analyze.engine import analyze
from tether.analyze.report import render

__all__ = [
    "VERDICTS",
    "Diagnosis",
    "GroupRef",
    "Straggler",
    "UnmatchedP2P",
    "Verdict",
    "analyze",
    "render",
]
