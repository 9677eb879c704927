"""tether installed in every Python process that starts with this directory on ``PYTHONPATH``,
as a user's own ``sitecustomize`` would: the test runner, and every worker torch's test harness
spawns (``tests/torch_suite/run.py`` puts it there for the "tether" run). Each process where
tether records notes its pid in ``$TORCH_SUITE_MARKS``, so the run can prove it was there."""

import os

import tether

if tether.install() is not None and os.environ.get("TORCH_SUITE_MARKS"):
    with open(os.environ["TORCH_SUITE_MARKS"], "a") as marks:
        marks.write(f"{os.getpid()}\n")
