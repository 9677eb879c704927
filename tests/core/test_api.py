"""``tether.init_process_group``'s own settings against an installed tether: real gloo worlds of
size 1 over a real TCPStore on port 0, each in a fresh process (installing is for a process's
life)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests._jobs import native_expected, result_of, worker_env

pytestmark = [pytest.mark.every_torch, pytest.mark.python_recorder]

PRELUDE = """
import json, os, sys
from datetime import timedelta
from pathlib import Path
import torch, torch.distributed as dist
import tether
from tether.runtime import active, current, install, link

store = dist.TCPStore(
    "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
)
world = dict(store=store, rank=0, world_size=1)
out = {}

def attempt(**settings):
    try:
        tether.init_process_group("gloo", **world, **settings)
    except tether.ConfigError as exc:
        return str(exc)
    return None
"""


def run_script(body: str, *args: str) -> dict[str, Any]:
    code = PRELUDE + textwrap.dedent(body) + "\nprint('RESULT ' + json.dumps(out))\n"
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=90,
        env=worker_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result: dict[str, Any] = result_of(proc.stdout)
    return result


@pytest.mark.timeout(120)
def test_settings_that_contradict_the_installed_config_are_refused(tmp_path: Path) -> None:
    installed, other = tmp_path / "installed", tmp_path / "other"
    out = run_script(
        """
        installed, other = Path(sys.argv[1]), Path(sys.argv[2])
        # What `tether run --dump-dir INSTALLED --hang-timeout 60` does before the script runs.
        install(tether.load_config(dump_dir=installed, hang_timeout=60.0))
        try:
            out["conflict"] = attempt(
                dump_dir=other, hang_timeout=5, debug_port="off", ring_size=2000
            )
            out["formed_after_conflict"] = dist.is_initialized()
            try:
                install(tether.Config(dump_dir=other))
            except tether.ConfigError as exc:
                out["install_conflict"] = str(exc)
            # The same settings, the directory spelled another way: accepted.
            os.chdir(installed.parent)
            out["agreeing"] = attempt(dump_dir=installed.name, hang_timeout=60, debug_port=0)
            t = torch.ones(2)
            dist.all_reduce(t)
            config = current().config
            out["config"] = [str(config.dump_dir), config.hang_timeout]
            out["recorded"] = [e.profiling_name for e in current().ring.snapshot()]
            out["server"] = active().server is not None
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            tether.uninstall()
        """,
        str(installed),
        str(other),
    )
    conflict = out["conflict"]
    assert conflict is not None, "conflicting settings were dropped without a word"
    assert out["formed_after_conflict"] is False, "refused before the group formed"
    for named in ("dump_dir", "--dump-dir / TETHER_DUMP_DIR", str(other), str(installed)):
        assert named in conflict
    assert "hang_timeout 5.0 (installed: 60.0; --hang-timeout / TETHER_HANG_TIMEOUT)" in conflict
    assert "debug_port off (installed: 0; --debug-port / TETHER_DEBUG_PORT)" in conflict
    assert "ring_size" not in conflict, "a setting that agrees is no conflict"
    assert "dump_dir" in out["install_conflict"] and "ring_size" not in out["install_conflict"]
    assert out["agreeing"] is None
    assert out["config"] == [str(installed), 60.0]
    assert any("all_reduce" in name for name in out["recorded"])
    assert out["server"] is True


@pytest.mark.timeout(120)
def test_settings_apply_when_not_installed_and_off_turns_the_server_off(tmp_path: Path) -> None:
    out = run_script(
        """
        try:
            out["error"] = attempt(dump_dir=sys.argv[1], hang_timeout=7, debug_port="off")
            config = current().config
            out["config"] = [str(config.dump_dir), config.hang_timeout, config.debug_port]
            out["connected"] = link().board is not None
            out["server"] = active().server is not None
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            tether.uninstall()
        """,
        str(tmp_path / "dumps"),
    )
    assert out["error"] is None
    assert out["config"] == [str(tmp_path / "dumps"), 7.0, None]
    assert out["connected"] is True, "the default group formed, yet no debug server started"
    assert out["server"] is False


@pytest.mark.timeout(150)
def test_tether_run_refuses_a_script_contradicting_its_flags(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import tether
            tether.init_process_group("gloo", dump_dir={str(tmp_path / "mine")!r})
            print("FORMED")
            """
        )
    )
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "tether.cli.main", "run", "--standalone"),
            *("--nproc-per-node=1", f"--dump-dir={tmp_path / 'flags'}", str(script)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=worker_env(),
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "FORMED" not in output
    assert "ConfigError" in output and "--dump-dir / TETHER_DUMP_DIR" in output


@pytest.mark.timeout(120)
def test_a_recorder_bug_never_fails_the_users_collective(tmp_path: Path) -> None:
    # Recording fails for three collectives, then tracking completion for two: each collective
    # still runs and returns the right value, and the failure is logged once per kind. On the
    # Python recorder the ring and the tracking raise; in the native core a test hook makes them.
    out = run_script(
        """
        import logging
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())
        logging.getLogger("tether").addHandler(Keep())
        attempt(dump_dir=sys.argv[1], debug_port="off")
        rec = current()
        out["native"] = rec.native
        def broken(*args, **kwargs):
            raise RuntimeError("a recorder bug")
        if rec.native:
            rec.core.fail_next("record", 3)
        else:
            rec.ring.add = broken
        t = torch.ones(3)
        dist.all_reduce(t)
        dist.all_reduce(t).__class__  # a second call: logged once
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        if rec.native:
            rec.core.fail_next("track", 2)
        else:
            rec.ring.add = lambda entry: None  # begin works again; tracking fails
            rec.track = broken
        dist.all_reduce(t)
        dist.all_reduce(t)
        rec.reap()  # the native core's bugs are logged from here (no GIL where they happen)
        out["value"] = t.tolist()
        out["logged"] = [m.split(" (")[0] for m in records if "runs on unrecorded" in m]
        dist.destroy_process_group()
        """,
        str(tmp_path / "dumps"),
    )
    assert out["native"] is native_expected()
    assert out["value"] == [1.0, 1.0, 1.0]
    assert out["logged"] == [
        f"[rank 0 on {socket.gethostname()}] recording an operation failed; the operation runs "
        "on unrecorded",
        f"[rank 0 on {socket.gethostname()}] tracking an operation's completion failed; the "
        "operation runs on unrecorded",
    ], out["logged"]


@pytest.mark.timeout(120)
def test_torchs_own_recorder_is_not_attached_to_a_recorded_group(tmp_path: Path) -> None:
    """torch 2.15 attaches its flight recorder (``_maybe_attach_flight_recorder``) to new groups
    of backends that do not record themselves; tether keeps it off the groups it records (one
    recorder per group) and lets it through for anything else. torch before 2.15 has no such
    function: one stands in for it, installed before tether patches torch."""
    out = run_script(
        """
        import torch.distributed.distributed_c10d as c10d
        from tether._versions import TORCH_FR_AUTO_ATTACH
        attached = []
        def torchs(pg, *rest, **kw):
            attached.append(type(pg).__name__)
            return "hook"
        had = hasattr(c10d, TORCH_FR_AUTO_ATTACH)
        original = getattr(c10d, TORCH_FR_AUTO_ATTACH, None)
        setattr(c10d, TORCH_FR_AUTO_ATTACH, torchs)
        attempt(dump_dir=sys.argv[1], debug_port="off")
        auto = getattr(c10d, TORCH_FR_AUTO_ATTACH)
        recorded = dist.new_group([0])
        out["recorded"] = auto(recorded, [0], backend="gloo")
        out["other"] = auto(object())
        out["attached"] = attached
        tether.uninstall()
        out["restored"] = getattr(c10d, TORCH_FR_AUTO_ATTACH) is torchs
        dist.destroy_process_group()
        if had:
            setattr(c10d, TORCH_FR_AUTO_ATTACH, original)
        """,
        str(tmp_path / "dumps"),
    )
    assert out == {"recorded": None, "other": "hook", "attached": ["object"], "restored": True}


def test_nccl_names_are_one_backend_family() -> None:
    """torch 2.15 spells NCCL four ways (``nccl`` is ``nccl2`` unless TORCH_DIST_USE_NCCL2=0):
    wherever tether matches a backend name (a debug server's ``?backend=``, pipelining's device),
    they are one backend."""
    from tether._versions import backend_family

    assert {backend_family(n) for n in ("nccl", "NCCL", "nccl2", "nccl-legacy", "nccl-lazy")} == {
        "nccl"
    }
    assert backend_family("Gloo") == "gloo" and backend_family("ucc") == "ucc"
