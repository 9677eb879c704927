"""A node's agent killed under its rank: three processes, run as ``python -m
tests.watchdog._orphan``.

- ``harness``: reaps orphans (``PR_SET_CHILD_SUBREAPER``, as a container's init or systemd
  does), starts the agent, kills it with SIGKILL once its rank is connected, and prints the
  rank's exit status as it reaps it.
- ``agent``: a relay (:class:`~tether.job.relay.RelayServer`) and a rank started by it, as
  ``tether run`` starts its workers; says ``connected`` once the rank is, then waits to be killed.
- ``rank``: a responder reached through that relay, waiting for alarms until it is stopped.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
LIMIT_S = 60.0
MODULE = "tests.watchdog._orphan"


def harness() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("prctl failed", flush=True)
        return 2
    agent = subprocess.Popen([sys.executable, "-m", MODULE, "agent"], stdout=subprocess.PIPE)
    assert agent.stdout is not None
    line = agent.stdout.readline().decode()  # the agent's "connected <pid>", or EOF if it died
    if not line.startswith("connected "):
        agent.kill()
        print(f"the agent never said its rank connected: {line!r}", flush=True)
        return 2
    rank = int(line.split()[1])
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait()
    deadline = time.monotonic() + LIMIT_S
    while time.monotonic() < deadline:  # the rank is ours now: reap it
        pid, status = os.waitpid(rank, os.WNOHANG)
        if pid == rank:
            print(f"rank exit {os.waitstatus_to_exitcode(status)}", flush=True)
            return 0
        time.sleep(0.05)
    os.kill(rank, signal.SIGKILL)
    print("the rank outlived its agent", flush=True)
    return 1


def agent() -> int:
    from tether.job.relay import RelayServer, relay_name

    server = RelayServer(relay_name())
    rank = subprocess.Popen([sys.executable, "-m", MODULE, "rank", server.name])
    deadline = time.monotonic() + LIMIT_S
    while server.connected < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    print(f"connected {rank.pid}", flush=True)
    threading.Event().wait(LIMIT_S)  # killed long before
    return 1


def rank(relay: str) -> int:
    import torch.distributed as dist

    from tether.job.alarm import AlarmBoard
    from tether.watchdog.responder import Responder

    tmp = Path(tempfile.mkdtemp(prefix="tether-orphan-"))
    responder = Responder(
        AlarmBoard(dist.HashStore()),
        rank=1,
        world_size=2,
        host="h",
        dump=lambda alarm: tmp / alarm.event_id,
        event_dir=lambda event_id: tmp / event_id,
        abort_on=lambda alarm: False,
        relay=relay,
        stop_if_orphaned=True,
    )
    responder.start()
    threading.Event().wait(LIMIT_S)  # stopped by the responder long before
    return 1


if __name__ == "__main__":
    role = sys.argv[1]
    sys.exit(harness() if role == "harness" else agent() if role == "agent" else rank(sys.argv[2]))
