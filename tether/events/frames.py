"""Which frame of a stack is the user's: one filter for the recorder, ``tether analyze`` and
``tether show``. Torch-free.

Every frame is one of four kinds, best first: the user's own code; a third-party framework
(anything installed under ``site-packages``/``dist-packages``: transformers, lightning,
accelerate...); a library that says nothing about the job (torch, the standard library,
``<frozen ...>``); tether's own machinery. The frame to show is the innermost one of the best kind
present: the user's line when there is one, else the framework's, else torch's.

Paths of another machine's dump are matched by what they look like (``.../site-packages/torch/``,
``.../lib/python3.11/``), this interpreter's own by where its standard library, torch and tether
are; package-relative either way, never by a parent directory's name: a checkout in ``~/tether``
or ``~/torch`` keeps its frames, and so does tether's demo job (``tether/demo``).

Also which thread to show (the main thread), and a ``stacks_<rank>.txt`` file's body read as
frames (:mod:`tether.events.stacks` is its contract).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sysconfig
from collections.abc import Mapping, Sequence
from typing import Any

from tether.events.schema import ELIDED
from tether.events.stacks import HEADER_PREFIX, StacksHeader, parse_header

__all__ = [
    "ELIDED",
    "FRAMEWORK",
    "LIBRARY",
    "TETHER",
    "USER",
    "format_frame",
    "frame_kind",
    "is_library",
    "main_thread",
    "parse_blocks",
    "pick",
    "pick_index",
    "stacks_source",
    "stacks_text_main_thread",
    "traceback_lines",
]

USER, FRAMEWORK, LIBRARY, TETHER = 0, 1, 2, 3
"""Frame kinds, in order of preference."""


_INSTALLED = re.compile(r"/(?:site|dist)-packages/(?P<top>[^/]+)")
# Torch and what ships with it; a source checkout installed in place is matched by its layout.
_TORCH_TOPS = frozenset({"torch", "functorch", "torchgen"})
_TORCH_TREE = re.compile(r"/torch/(?:distributed|nn|autograd|utils|cuda|fx|_[a-z_]+)/")
# Tether's machinery, by package-relative path; tether/demo is a user's job.
_TETHER_TREE = re.compile(
    r"/tether/(?:recorder|watchdog|launcher|server|cli|analyze|transport|events)/"
    r"|/tether/(?:api|config|_log|_lazy|_exceptions|__init__)\.py$"
)
_STDLIB_TREE = re.compile(r"/lib/python3\.\d+t?/|^[A-Za-z]:/(?:[^/]+/)*Lib/")  # POSIX, Windows


@functools.cache
def _local_roots() -> tuple[tuple[str, int], ...]:
    """This interpreter's own directories, as (prefix, kind), the most specific first."""
    roots: list[tuple[str, int]] = []
    tether_dir = _norm(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + "/"
    roots.append((tether_dir + "demo/", USER))
    roots.append((tether_dir, TETHER))
    try:  # where torch is, without importing it (analyze must never import torch)
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        roots.append((_norm(location) + "/", LIBRARY))
    for site in {sysconfig.get_paths().get(k) for k in ("purelib", "platlib")}:
        if site:
            roots.append((_norm(site) + "/", FRAMEWORK))
    for std in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib")}:
        if std:
            roots.append((_norm(std) + "/", LIBRARY))
    return tuple(roots)


def _norm(path: str) -> str:
    return path.replace("\\", "/")


@functools.lru_cache(maxsize=16384)
def frame_kind(filename: str) -> int:
    """The kind of a frame from its file name: :data:`USER`, :data:`FRAMEWORK`,
    :data:`LIBRARY` or :data:`TETHER`. Cached: a dump holds thousands of frames of few files."""
    if filename.startswith("<"):  # <frozen runpy>, torch.fx's <eval_with_key>; <string> is -c
        return LIBRARY if filename.startswith(("<frozen ", "<eval_with_key>")) else USER
    path = _norm(filename)
    # Installed packages first: a virtual environment's site-packages lies inside platstdlib.
    installed = _INSTALLED.search(path)
    if installed is not None:
        top = installed["top"]
        if top in _TORCH_TOPS:
            return LIBRARY
        if top == "tether":
            return USER if path[installed.end() :].startswith("/demo/") else TETHER
        return FRAMEWORK
    for prefix, kind in _local_roots():
        if path.startswith(prefix):
            return kind
    if _TETHER_TREE.search(path):
        return TETHER
    if _TORCH_TREE.search(path) or _STDLIB_TREE.search(path):
        return LIBRARY
    return USER


def is_library(filename: str) -> bool:
    """True for torch, the standard library and tether's machinery: frames that never hold the
    user's line (the recorder walks past its depth limit until the first other frame)."""
    return frame_kind(filename) >= LIBRARY


def pick_index(frames: Sequence[Mapping[str, Any]]) -> int | None:
    """The index of the frame to show (innermost first): the innermost of the best kind."""
    best, best_kind = None, TETHER + 1
    for i, f in enumerate(frames):
        kind = frame_kind(str(f.get("filename", "")))
        if kind < best_kind:
            best, best_kind = i, kind
            if kind == USER:
                break
    return best


def pick(frames: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The frame to show of a stack, innermost first; None for an empty stack."""
    i = pick_index(frames)
    return None if i is None else frames[i]


def format_frame(f: Mapping[str, Any]) -> str:
    """``file:line in func``."""
    return f"{f.get('filename', '?')}:{f.get('line', '?')} in {f.get('name', '?')}"


def traceback_lines(frames: Sequence[Mapping[str, Any]]) -> list[str]:
    """A stack as lines, innermost first, with a line where the recorder left frames out."""
    out = []
    for f in frames:
        elided = f.get(ELIDED)
        if isinstance(elided, int) and elided > 0:
            out.append(f"... {elided} frames not recorded ...")
        out.append(format_frame(f))
    return out


def main_thread(threads: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The thread to show of a dump's ``stacks``: the main thread, else a non-daemon one, else
    any with frames."""
    usable = [t for t in threads if isinstance(t, Mapping) and isinstance(t.get("frames"), list)]
    for wanted in (
        lambda t: t.get("thread_name") == "MainThread",
        lambda t: not t.get("daemon"),
        lambda t: True,
    ):
        for t in usable:
            if wanted(t) and t["frames"]:
                return t
    return None


_FH_THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+[^\n]*$", re.M)
_FH_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.M)
_COMMENT = re.compile(r"^#[^\n]*$", re.M)


def stacks_source(header: StacksHeader | None) -> str:
    """Where a stacks file came from, in words, from its header (None: a file without one, which
    only the signalled ``faulthandler`` wrote)."""
    if header is None:
        return "faulthandler (a peer signalled it)"
    method = header.get("method")
    if method == "fatal-signal" or header.get("when") == "death":
        return f"faulthandler at its death ({header.get('signal') or 'a fatal signal'})"
    state = _state_words(header)
    if method == "py-spy":
        return f"py-spy (read from outside{'; ' + state if state else ''})"
    return f"faulthandler (a peer signalled it{'; ' + state if state else ''})"


_STATES = {
    "stopped": "the rank was stopped",
    "tracing-stop": "the rank was stopped by a tracer",
    "disk-sleep": "the rank was stuck in the kernel",
    "sleeping": "the rank was sleeping",
    "running": "the rank was running",
    "zombie": "the rank had exited",
}


def _state_words(header: StacksHeader) -> str:
    state, syscall = header.get("state"), header.get("syscall")
    words = _STATES.get(state or "", f"the rank was {state}" if state else "")
    if syscall:
        words = f"{words or 'the rank was'} in {syscall}"
    return words


def parse_blocks(text: str) -> list[tuple[bool, list[dict[str, Any]]]]:
    """The threads of a stacks file's body (faulthandler's text format), each as (named as the
    main thread, frames innermost first). Comment lines are passed over, except that one naming
    ``MainThread`` marks its thread so: the comment lines right above a thread's first line
    (where the launcher's py-spy reader puts a thread's name) or inside its block."""
    heads = list(_FH_THREAD.finditer(text))
    leads = [_lead(text, h.start()) for h in heads]
    blocks = []
    for i, head in enumerate(heads):
        end = leads[i + 1] if i + 1 < len(heads) else len(text)
        frames = [
            {"filename": m["file"], "line": int(m["line"]), "name": m["func"]}
            for m in _FH_FRAME.finditer(text, head.end(), end)
        ]
        comments = [c[0] for c in _COMMENT.finditer(text, leads[i], end)]
        named = "MainThread" in head[0] or any(
            "MainThread" in c for c in comments if not c.startswith(HEADER_PREFIX)
        )
        if frames:
            blocks.append((named, frames))
    return blocks


def _lead(text: str, start: int) -> int:
    """Where the run of comment lines right above the line at ``start`` begins."""
    while start > 0:
        above = text.rfind("\n", 0, start - 1) + 1
        if not text.startswith("#", above):
            break
        start = above
    return start


def stacks_text_main_thread(text: str) -> tuple[list[dict[str, Any]], str]:
    """The main thread's frames (innermost first) of a ``stacks_<rank>.txt`` file's text, and
    where they came from in words; no frames when the text holds none."""
    blocks = parse_blocks(text)
    if not blocks:
        return [], ""
    # faulthandler does not name threads: the main thread is the one running <module>.
    main = (
        [f for named, f in blocks if named]
        or [f for _, f in blocks if f[-1]["name"] == "<module>"]
        or [blocks[-1][1]]
    )
    return main[0], stacks_source(parse_header(text))
