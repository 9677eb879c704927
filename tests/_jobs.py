"""Real multi-process jobs over a real TCPStore on port 0, for the integration tests."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

WORKERS = Path(__file__).parent / "workers"
REPO = Path(__file__).parent.parent


@dataclasses.dataclass
class JobResult:
    returncodes: list[int]
    outputs: list[str]

    def check(self) -> None:
        for rank, (rc, out) in enumerate(zip(self.returncodes, self.outputs, strict=True)):
            assert rc == 0, f"rank {rank} exited {rc}:\n{out}"


def worker_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def launch(
    script: str,
    world_size: int,
    *args: str,
    port: int,
    dump_dir: Path,
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
) -> JobResult:
    """Run ``tests/workers/<script>`` as ``world_size`` processes; each gets
    ``--rank R --world-size N --port P --dump-dir D`` followed by ``args``."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKERS / script),
                *("--rank", str(rank), "--world-size", str(world_size)),
                *("--port", str(port), "--dump-dir", str(dump_dir)),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=worker_env(**(env or {})),
        )
        for rank in range(world_size)
    ]
    outputs: list[str] = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return JobResult([p.returncode for p in procs], outputs)


def new_store() -> dist.TCPStore:
    """A TCPStore server on an ephemeral port, hosted by the test process."""
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
