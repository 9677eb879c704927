"""A node's agent killed under its rank: three processes, run as ``python -m
tests.watchdog._orphan harness``.

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
import select
import signal
import subprocess
import sys
import tempfile
import threading

LIMIT_S = 60.0
MODULE = "tests.watchdog._orphan"
PR_SET_CHILD_SUBREAPER = 36


def harness() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("prctl failed", flush=True)
        return 2
    with tempfile.TemporaryDirectory(prefix="tether-orphan-") as tmp:
        argv = [sys.executable, "-m", MODULE, "agent", tmp]
        agent = subprocess.Popen(argv, stdout=subprocess.PIPE)
        assert agent.stdout is not None
        line = agent.stdout.readline().decode()  # "connected <pid>", or EOF: the agent failed
        if not line.startswith("connected "):
            agent.kill()
            agent.wait()
            print(f"the agent never said its rank connected: {line!r}", flush=True)
            return 2
        rank = int(line.split()[1])
        exited = os.pidfd_open(rank)  # readable once the rank has exited
        try:
            os.kill(agent.pid, signal.SIGKILL)
            agent.wait()
            if not select.select([exited], [], [], LIMIT_S)[0]:
                os.kill(rank, signal.SIGKILL)
                os.waitpid(rank, 0)
                print("the rank outlived its agent", flush=True)
                return 1
        finally:
            os.close(exited)
        _, status = os.waitpid(rank, 0)  # ours since its agent died: reaped here
        print(f"rank exit {os.waitstatus_to_exitcode(status)}", flush=True)
        return 0


def agent(tmp: str) -> int:
    from tests._jobs import until
    from tether.job.relay import RelayServer, relay_name

    server = RelayServer(relay_name())
    rank = subprocess.Popen([sys.executable, "-m", MODULE, "rank", server.name, tmp])
    until(lambda: server.connected >= 1, "the rank never connected", timeout=LIMIT_S)
    print(f"connected {rank.pid}", flush=True)
    threading.Event().wait(LIMIT_S)  # killed long before
    return 1


def rank(relay: str, tmp: str) -> int:
    from pathlib import Path

    import torch.distributed as dist

    from tests.watchdog.test_alarm import responder_on
    from tether.job.alarm import AlarmBoard

    board = AlarmBoard(dist.HashStore())
    responder_on(board, Path(tmp), [], world_size=2, relay=relay, stop_if_orphaned=True).start()
    threading.Event().wait(LIMIT_S)  # stopped by the responder long before
    return 1


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    sys.exit({"harness": harness, "agent": agent, "rank": rank}[role](*args))
