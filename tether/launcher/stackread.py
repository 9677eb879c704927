"""Reading a live worker's stacks from outside, without disturbing it, and a dead one's last
words; both written as ``stacks_<rank>.txt`` (see :mod:`tether.events.stacks`).

- py-spy's non-blocking mode reads the interpreter's memory (``process_vm_readv``): the process
  is neither stopped nor signalled, so a rank stuck in a system call that does not retry on
  EINTR stays exactly where it is. ~20 ms per read; it works on a stopped process too.
- ``/proc/<pid>/task/<tid>/{stat,syscall,wchan}`` say what each thread is doing in the kernel
  (scheduler state, blocked system call, wait channel), also without touching it.
- what faulthandler wrote at a fatal signal, from the rank's own stack file.

The body is faulthandler's text format whatever read it, so one parser reads every stacks file;
thread names, states and system calls are ``#`` comment lines before each thread's block.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from tether._log import get_logger

__all__ = [
    "PY_SPY_TIMEOUT_S",
    "ProcState",
    "answering",
    "find_py_spy",
    "native_where",
    "proc_state",
    "py_spy_stacks",
    "py_spy_threads",
]

logger = get_logger(__name__)

PY_SPY_TIMEOUT_S = 10.0
"""One py-spy read takes ~20 ms; a loaded host or a huge process may take seconds."""

_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "disk-sleep",
    "T": "stopped",
    "t": "tracing-stop",
    "Z": "zombie",
    "X": "dead",
    "I": "idle",
}
# The system calls a stuck rank is usually blocked in, by number (the kernel gives numbers).
_SYSCALLS = {
    "x86_64": {
        0: "read", 1: "write", 7: "poll", 16: "ioctl", 23: "select", 24: "sched_yield",
        34: "pause", 35: "nanosleep", 42: "connect", 43: "accept", 44: "sendto",
        45: "recvfrom", 46: "sendmsg", 47: "recvmsg", 61: "wait4", 62: "kill", 202: "futex",
        230: "clock_nanosleep", 232: "epoll_wait", 247: "waitid", 270: "pselect6",
        271: "ppoll", 281: "epoll_pwait", 288: "accept4", 441: "epoll_pwait2",
    },
    "aarch64": {
        22: "epoll_pwait", 29: "ioctl", 63: "read", 64: "write", 72: "pselect6", 73: "ppoll",
        95: "waitid", 98: "futex", 101: "nanosleep", 115: "clock_nanosleep", 124: "sched_yield",
        129: "kill", 202: "accept", 203: "connect", 206: "sendto", 207: "recvfrom", 211: "sendmsg",
        212: "recvmsg", 242: "accept4", 260: "wait4", 441: "epoll_pwait2",
    },
}  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class ProcState:
    """What the kernel says one thread is doing."""

    state: str | None
    """``running``, ``sleeping``, ``disk-sleep``, ``stopped``... (see ``StacksHeader.state``)."""
    syscall: str | None
    """The system call it is blocked in, else its kernel wait channel; None if neither."""


def proc_state(pid: int, tid: int | None = None) -> ProcState:
    """Thread ``tid`` of ``pid`` (the main thread by default), read from ``/proc``."""
    base = Path(f"/proc/{pid}/task/{tid or pid}")
    state = None
    try:
        # The command name (field 2, in parentheses) may itself hold spaces.
        code = (base / "stat").read_text().rsplit(")", 1)[1].split()[0]
        state = _STATES.get(code, code)
    except (OSError, IndexError):
        pass
    return ProcState(state, _syscall(base))


def _syscall(base: Path) -> str | None:
    try:
        first = (base / "syscall").read_text().split()[0]
    except (OSError, IndexError):
        first = ""
    # "running" while on a CPU; -1 while not in a system call (a stopped process, user code).
    if first.isdigit():
        number = int(first)
        return _SYSCALLS.get(platform.machine(), {}).get(number, f"syscall {number}")
    try:
        wchan = (base / "wchan").read_text().strip()
    except OSError:
        return None
    return wchan if wchan and wchan != "0" else None


def native_where(pid: int, tid: int | None = None) -> list[str]:
    """What the kernel shows of a blocked thread below Python, as comment text: the library its
    program counter is in (py-spy's native mode would stop the process, so no C function names)
    and its kernel stack (readable by root only). Empty where neither is known."""
    base = Path(f"/proc/{pid}/task/{tid or pid}")
    out = []
    try:
        fields = (base / "syscall").read_text().split()
        pc = int(fields[-1], 16) if len(fields) > 2 else None
    except (OSError, ValueError):
        pc = None
    if pc:
        library = _library_at(pid, pc)
        if library:
            out.append(f"native: pc in {library}")
    try:
        kernel = [line.split("] ", 1)[-1].split("+", 1)[0] for line in (base / "stack").open()]
    except OSError:
        kernel = []
    kernel = [k for k in kernel if k and not k.startswith(("entry_SYSCALL", "do_syscall"))]
    if kernel:
        out.append("kernel: " + " <- ".join(kernel[:8]))
    return out


def _library_at(pid: int, pc: int) -> str | None:
    """``libc.so.6+0x1234``: the mapped file holding address ``pc`` of ``pid``."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                parts = line.split()
                start, end = (int(x, 16) for x in parts[0].split("-"))
                if start <= pc < end and len(parts) >= 6:
                    offset = pc - start + int(parts[2], 16)
                    return f"{os.path.basename(parts[5])}+0x{offset:x}"
    except (OSError, ValueError, IndexError):
        pass
    return None


def find_py_spy() -> str | None:
    """The py-spy binary: beside this interpreter (a virtual environment not activated), else on
    the PATH; None where it is not installed."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


class PySpyError(RuntimeError):
    """py-spy could not read the process (it exited, the tool failed, or it is missing)."""


def py_spy_stacks(
    pid: int, py_spy: str, *, timeout: float = PY_SPY_TIMEOUT_S, native: bool = False
) -> str:
    """Every thread of ``pid``, read by py-spy, in faulthandler's format (main thread first,
    each block preceded by a ``#`` line: name, kernel state, system call, whether it holds the
    GIL); ``native``: see :func:`py_spy_threads`."""
    return to_faulthandler(pid, py_spy_threads(pid, py_spy, timeout=timeout, native=native))


def stacks_or_why(pid: int, *, timeout: float = PY_SPY_TIMEOUT_S, native: bool = False) -> str:
    """:func:`py_spy_stacks` of ``pid``, or one line saying why they could not be read: for a
    log or a report, where a process that cannot be read must not stop the rest."""
    spy = find_py_spy()
    if spy is None:
        return "(py-spy is not installed)"
    try:
        return py_spy_stacks(pid, spy, timeout=timeout, native=native)
    except PySpyError as exc:
        return f"(could not read them: {exc})"


def answering(threads: list[Any]) -> bool:
    """Whether one of a rank's threads (as py-spy read them) is its responder answering an
    alarm: the rank is slow, not stuck, and will write its own dump."""
    for t in threads:
        for f in t.get("frames") or []:
            name, filename = str(f.get("name") or ""), str(f.get("filename") or "")
            if filename.endswith(_RESPONDER) and name.rsplit(".", 1)[-1] == "answer":
                return True
    return False


_RESPONDER = os.path.join("tether", "watchdog", "responder.py")


def py_spy_threads(
    pid: int, py_spy: str, *, timeout: float = PY_SPY_TIMEOUT_S, native: bool = False
) -> list[Any]:
    """py-spy's JSON of every thread of ``pid``: read without stopping it, or (``native``) with
    the C frames below each Python thread's, which py-spy reads only from a stopped process
    (for a process that is hung anyway: a test's, say)."""
    mode = "--native" if native else "--nonblocking"
    try:
        proc = subprocess.run(
            [py_spy, "dump", "--pid", str(pid), mode, "--json"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PySpyError(f"py-spy did not run: {exc}") from exc
    if proc.returncode != 0:
        why = (proc.stderr or proc.stdout).strip().splitlines()
        raise PySpyError(f"py-spy failed ({why[-1] if why else f'exit {proc.returncode}'})")
    try:
        threads = json.loads(proc.stdout)
    except ValueError as exc:
        raise PySpyError(f"py-spy printed no JSON: {exc}") from exc
    if not isinstance(threads, list) or not threads:
        raise PySpyError("py-spy found no Python thread")
    return threads


def to_faulthandler(pid: int, threads: list[Any]) -> str:
    """py-spy's JSON threads as faulthandler writes them, with ``#`` lines for what
    faulthandler cannot say."""
    ordered = sorted(threads, key=lambda t: t.get("os_thread_id") != pid)  # main thread first
    lines = []
    for t in ordered:
        tid = t.get("os_thread_id")
        kernel = proc_state(pid, tid if isinstance(tid, int) else None)
        notes = [f"tid {tid}", f"state {kernel.state or 'unknown'}"]
        if kernel.syscall:
            notes.append(f"in {kernel.syscall}")
        if t.get("owns_gil"):
            notes.append("holds the GIL")
        lines.append(f"# thread {json.dumps(str(t.get('thread_name') or ''))}: {', '.join(notes)}")
        if tid == pid or t.get("owns_gil"):  # the threads a reader looks at, not every one
            lines.extend(
                f"#   {n}" for n in native_where(pid, tid if isinstance(tid, int) else None)
            )
        lines.append(f"Thread 0x{int(t.get('thread_id') or 0):016x} (most recent call first):")
        for f in t.get("frames") or []:
            lines.append(f'  File "{f.get("filename")}", line {f.get("line")} in {f.get("name")}')
        lines.append("")
    return "\n".join(lines) + "\n"
