"""The job's protocol at 64 to 16,384 ranks, simulated on this machine: what the job's store sees
in steady state, and how long an alarm takes to reach every rank.

    python bench/scale.py [--ranks 64,512,4096,16384] [--per-node 16] [--steady 5] [--reps 1]

No torch training, no process group; but every simulated rank and agent runs tether's own
protocol code, the modules a real rank and a real ``tether run`` agent run:

- each node's agent (a few processes hold up to 128 each, two threads a node) runs the
  :class:`~tether.job.relay.AlarmLook` and :class:`~tether.job.relay.RelayServer` that
  ``tether run``'s alarm watch runs, and beats every :data:`~tether.job.nodes.BEAT_S` as its
  cluster part does; node 0's judges the others by their beats (:class:`_Beats`);
- each rank is its :class:`~tether.watchdog.responder.Responder` (its dump writes a synthetic
  file of :data:`DUMP_BYTES` into its node's own directory), without its thread: one thread of
  a process drives up to 2,048 of them through the calls that thread makes (a thread per rank
  queued for one interpreter's lock past 512 ranks on 2 cores, and ranks went unanswered).

The store is a real TCPStore, hosted by a process of its own, whose CPU time is read from
``/proc``. Every store request is counted (``tether.testing.stores.CountingStore`` around each
client: one per agent, one for all the ranks of a process).

Two protocols in the same run, each on a fresh store:

- ``store``: every rank looks for alarms in the store itself (what a rank does without
  ``tether run``, and what every rank did before the relay): every
  :func:`~tether.watchdog.responder.poll_period`;
- ``relay``: each node's agent looks, and tells its ranks over the node's relay.

For each: store requests a second per node and the store host's CPU over ``--steady`` seconds of
nothing happening; then one alarm raised, and the time until every rank has heard of it and
until every rank's dump is on its node's disk (``alarm_to_all_dumped_s``: each rank dumps on its
own core and its node's disk as soon as it hears, so the last to finish is when it heard plus
what its dump took; ``alarm_to_all_dumped_here_s`` is what 2 cores and one disk take to write
every rank's dump in turn); then the last node's agent ends (its beats stop, its port closes),
and the time until node 0's watch judges it lost (``dead_node_detected_s``). Not simulated: a
dead rank, which its own node's agent sees exit (no store request, no other node: what it costs
does not grow with the job), and an elastic job's heartbeats (each worker's goes to its node's
agent over the relay: none reaches the store).

Then ``tether analyze`` of an event of ``--analyze-ranks`` ranks (16,384 by default; 0: none),
2,000 entries each, built as ``bench/analyze_speed.py`` builds it (a hang, one culprit): its wall
time and peak memory over ``--reps`` runs, each a fresh process, files in the page cache
(``analyze_s_16k``, ``analyze_peak_mb_16k``). ``--analyze-event DIR`` keeps the event in
``DIR/<ranks>/`` and reuses it. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import os
import queue
import random
import secrets
import select
import selectors
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import env, spread

DUMP_BYTES = 64 << 10
"""A simulated rank's dump (a real 2,000-entry dump is ~360 KB; all simulated nodes share this
machine's one disk, where a real node writes to its own)."""
MODES = ("store", "relay")
BEATS = {"store": "store", "relay": "udp"}
"""How each protocol's nodes beat: the protocol before (every rank looking in the store, every
node beating through it) against the one now (the agents look and relay, and beat to node 0)."""
SWITCH_S = 1e-3
"""How long a rank's read of its relay connection waits once it has something to read."""
READY_TIMEOUT_S = 600.0
ANSWER_TIMEOUT_S = 400.0
"""Longer than the longest wait a command asks of a simulated process (300 s)."""
SHARE = {
    "agents": lambda nodes, world: max(1, min(8, nodes // 128)),
    "relay": lambda nodes, world: max(1, min(8, world // 2048)),
    "store": lambda nodes, world: max(1, min(8, world // 2048)),
}
"""How many processes simulate a role's nodes: each drives up to 2,048 ranks from one thread,
or runs up to 128 nodes' agents (two threads each)."""

_STORE_HOST = r"""
import sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False, use_libuv=True)
print(store.port, flush=True)
sys.stdin.read()
"""


def simulate(
    mode: str, port: int, nodes: range, per_node: int, world: int, root: Path, beat_over: str
) -> None:
    """One process's share of the simulated nodes: their ranks (``store``: looking in the store
    themselves; ``relay``: hearing from their agents), or their agents (``agents``: each node's
    look and relay, in processes of their own as a real agent is); commands on stdin, answers
    on stdout. ``beat_over``: how the agents beat (``udp``, ``store``).

    A rank is its :class:`~tether.watchdog.responder.Responder` without its thread: one thread
    of this process drives all of them through the calls the responder's own thread makes
    (:meth:`~tether.watchdog.responder.Responder.from_agent` when its relay connection has
    something to read, :meth:`~tether.watchdog.responder.Responder.look_in_store` when its
    period is up, :meth:`~tether.watchdog.responder.Responder.handle` for an alarm). A thread per
    rank does not hold past 512 ranks on 2 cores: thousands of threads queue for one
    interpreter's lock, where real ranks each have their own."""
    from datetime import timedelta

    import torch.distributed as dist

    from tether.job.alarm import AlarmBoard
    from tether.job.relay import AlarmLook, RelayServer
    from tether.job.stacks import agent_key
    from tether.testing.stores import CountingStore
    from tether.watchdog.responder import Responder

    # The reading thread must not wait 5 ms (the default) for the answering one at each read.
    sys.setswitchinterval(SWITCH_S)
    stores: list[CountingStore] = []
    blob = b"\0" * DUMP_BYTES
    responders: list[Responder] = []
    agents: list[tuple[AlarmLook, RelayServer]] = []
    heard: dict[int, float] = {}  # rank -> when it heard of the alarm
    dumped: dict[int, float] = {}  # rank -> when its dump was written
    finished: dict[int, float] = {}  # rank -> when it heard, plus what its dump took
    relayed: list[float] = []
    beats = None
    if mode == "agents":
        beats = _Beats(nodes, per_node, world // per_node, root, udp=beat_over == "udp")

    def dump_into(node_dir: Path, rank: int) -> Any:
        def dump(alarm: Any) -> Path:
            start = time.time()
            heard.setdefault(rank, start)  # looking in the store itself: it heard just now
            event = node_dir / alarm.event_id
            event.mkdir(parents=True, exist_ok=True)
            path = event / f"rank_{rank}"
            path.write_bytes(blob)
            dumped[rank] = time.time()
            finished[rank] = heard[rank] + dumped[rank] - start
            return path

        return dump

    def connect() -> Any:
        client = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port, 1, False, timeout=timedelta(seconds=120), use_libuv=True
        )
        stores.append(CountingStore(client))
        return client

    # A connection per agent, as each node's agent has; the ranks of this process share one
    # (each of their requests is made by one thread, in turn, on any connection). TCPStore's
    # server looks up each new client's name, in its one thread: where the resolver drops a
    # query, every client waits 5 s, so 16,384 connections took minutes to open here.
    shared = connect() if mode != "agents" else None
    for node in nodes:
        host = f"sim-node{node:05d}"
        client = connect() if shared is None else shared
        board = AlarmBoard(stores[-1])  # type: ignore[arg-type]
        name = f"tether-scale-{port}-{node}" if mode != "store" else ""
        if mode == "agents":
            # As tether run's watch says it: its agent reads this host's silent ranks' stacks.
            client.set(agent_key(host), json.dumps({"pid": os.getpid(), "tool": "py-spy"}))
            server = RelayServer(name)

            def found(alarm: Any, server: RelayServer = server) -> None:
                server.send(alarm)
                relayed.append(time.time())

            look = AlarmLook(board, epoch=1, found=found)
            look.start()
            agents.append((look, server))
            beats.add(node, host, stores[-1])
            continue
        if mode == "store":
            client.set(agent_key(host), json.dumps({"pid": os.getpid(), "tool": "py-spy"}))
        node_dir = root / host
        for local in range(per_node):
            rank = node * per_node + local
            responders.append(
                Responder(
                    board,
                    rank=rank,
                    world_size=world,
                    host=host,
                    dump=dump_into(node_dir, rank),
                    event_dir=lambda event_id, d=node_dir: d / event_id,
                    abort_on=lambda alarm: False,
                    relay=name,
                )
            )
    if mode == "relay":
        deadline = time.monotonic() + READY_TIMEOUT_S
        for responder in responders:
            while responder.fileno() < 0:
                responder.reach_agent(deadline)
                if responder.fileno() < 0:
                    if time.monotonic() > deadline:
                        raise SystemExit("the simulated ranks did not reach their agents")
                    time.sleep(0.01)
    stop = threading.Event()
    if beats is not None:
        threading.Thread(target=beats.run, args=(stop,), name="sim-beats", daemon=True).start()
    drive = _hear_from_agents if mode == "relay" else _look_in_store
    driver = threading.Thread(
        target=drive, args=(responders, heard, stop), name="sim-ranks", daemon=True
    )
    if mode != "agents":
        driver.start()
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.split()
        if command[0] == "count":
            print(json.dumps(sum(store.total() for store in stores)), flush=True)
        elif command[0] == "answered":
            deadline = time.monotonic() + float(command[1])
            while time.monotonic() < deadline and (
                any(r.answered == 0 for r in responders) or len(relayed) < len(agents)
            ):
                time.sleep(0.01)
            print(
                json.dumps(
                    {
                        "answered": sum(r.answered > 0 for r in responders),
                        "relayed": max(relayed, default=None),
                        "heard": max(heard.values(), default=None),
                        "dumped": max(dumped.values(), default=None),
                        "finished": max(finished.values(), default=None),
                    }
                ),
                flush=True,
            )
        elif command[0] == "kill":  # the last node's agent dies
            killed = beats.kill() if beats is not None else None
            print(json.dumps({"killed": killed}), flush=True)
        elif command[0] == "detected":
            found = beats.detected(float(command[1])) if beats is not None else None
            print(json.dumps({"detected": found}), flush=True)
        elif command[0] == "exit":
            break
    stop.set()
    os._exit(0)  # thousands of sockets' and threads' teardown is not what is measured


class _Beats:
    """What this process's agents do in a job of several nodes, as ``tether run``'s cluster
    watch does it: each beats every :data:`~tether.job.nodes.BEAT_S` and is reached at an
    :class:`~tether.launcher.gather.EventPort` (one for all of them, and one of its own for the
    last node, the one :meth:`kill` ends); node 0's agent, the assembler, judges every other
    node by its beats with :class:`~tether.job.nodes.NodeWatch` and a probe of a silent one's
    port. ``udp``: the beats go to the assembler (:class:`~tether.job.nodes.BeatPort`), as
    ``tether run``'s do; else through the store (:class:`~tether.job.nodes.NodeBoard`), the
    assembler reading each node's, as they did before."""

    def __init__(self, nodes: range, per_node: int, count: int, root: Path, *, udp: bool) -> None:
        from tether.job.nodes import BeatPort
        from tether.launcher.gather import EventPort

        self.per_node = per_node
        self.count = count
        self.victim = count - 1
        self.udp = udp
        self.boards: dict[int, Any] = {}
        self._ports = {}
        for node in {nodes[0], self.victim} & set(nodes):
            port = EventPort(root / "events", node=node, host="sim", address="127.0.0.1")
            key = secrets.token_hex(16)
            self._ports[node] = (port, BeatPort(port.address, key), key)
        self._table: dict[int, Any] = {}
        self._found: dict[int, float] = {}
        self._killed = threading.Event()
        self._cond = threading.Condition()

    def _port(self, node: int) -> Any:
        return self._ports.get(node) or next(iter(self._ports.values()))

    def add(self, node: int, host: str, store: Any) -> None:
        """Publish ``node`` as its agent does, and beat for it from now on."""
        from tether.job.nodes import NodeBoard

        port, beats, key = self._port(node)
        ranks = range(node * self.per_node, (node + 1) * self.per_node)
        info = port.info(ranks=ranks)
        info = dataclasses.replace(info, node=node, host=host, beat_port=beats.port, beat_key=key)
        self.boards[node] = NodeBoard(store, attempt=0)
        self.boards[node].publish(info)

    def kill(self) -> float | None:
        """End the last node's agent (its beat and its port), if it is here; when."""
        if self.victim not in self.boards:
            return None
        self._killed.set()
        port, beats, _ = self._ports.pop(self.victim)
        beats.close()
        port.close()
        return time.time()

    def detected(self, timeout: float) -> float | None:
        """When the assembler (if here) judged the last node a fault."""
        with self._cond:
            self._cond.wait_for(lambda: self.victim in self._found, timeout)
            return self._found.get(self.victim)

    def run(self, stop: threading.Event) -> None:
        from tether.job.nodes import BEAT_S, NodeWatch
        from tether.launcher.gather import probe

        watch = NodeWatch()
        board = next(iter(self.boards.values()))
        while len(self._table) < self.count:  # until every agent has published
            self._table = board.nodes(self.count)
            if len(self._table) < self.count and stop.wait(1.0):
                return
        assembler = self.boards.get(0)
        if assembler is not None and self.udp:
            self._ports[0][1].take(lambda node: getattr(self._table.get(node), "beat_key", None))
        while not stop.wait(BEAT_S):
            for node, board in self.boards.items():
                if node == self.victim and self._killed.is_set():
                    continue
                if self.udp:
                    self._port(node)[1].send(node, self._table[0])
                else:
                    board.beat(node)
            if assembler is None:
                continue
            others = [n for n in range(1, self.count) if n not in self._found]
            if self.udp:
                beats = self._ports[0][1].counts(others)
            else:  # as the assembler read them before: a request for each node
                beats = {n: assembler.beat(n, 0) for n in others}
            for node, _, verdict in watch.judge(
                beats,
                time.monotonic(),
                ended=assembler.ended,
                probe=lambda node: probe(self._table[node]),
            ):
                if verdict is not None:
                    with self._cond:
                        self._found[node] = time.time()
                        self._cond.notify_all()


def _hear_from_agents(
    responders: list[Any], heard: dict[int, float], stop: threading.Event
) -> None:
    """What each rank's responder thread does under an agent, for all of them: wait on their
    relay connections, and answer what arrives. One thread reads, another answers: when a rank
    heard is then not when the ranks before it in this process finished dumping."""
    arrived: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def answer() -> None:
        while (item := arrived.get()) is not None:
            item[0].handle(item[1])

    threading.Thread(target=answer, name="sim-answers", daemon=True).start()
    selector = selectors.DefaultSelector()
    for responder in responders:
        selector.register(responder.fileno(), selectors.EVENT_READ, responder)
    while not stop.is_set():
        for key, _ in selector.select(0.5):
            responder = key.data
            alarm = responder.from_agent(SWITCH_S)
            if responder.fileno() < 0:  # its agent is gone: not simulated
                selector.unregister(key.fd)
            if alarm is not None:
                heard[responder.rank] = time.time()
                arrived.put((responder, alarm))
    arrived.put(None)


def _look_in_store(responders: list[Any], heard: dict[int, float], stop: threading.Event) -> None:
    """What each rank's responder thread does without an agent, for all of them: look in the
    store when its period is up (the first looks spread over one period)."""
    due = [(random.uniform(0, r.period), i) for i, r in enumerate(responders)]
    start = time.monotonic()
    due = [(start + at, i) for at, i in due]
    heapq.heapify(due)
    while due and not stop.is_set():
        at, i = heapq.heappop(due)
        late = at - time.monotonic()
        if late > 0:
            stop.wait(late)
        wait = responders[i].look_in_store()
        if wait is not None:
            heapq.heappush(due, (time.monotonic() + wait, i))


def latest(answers: list[dict[str, Any]], key: str) -> float:
    """The last time any simulated process says ``key`` happened."""
    return max(a[key] for a in answers if a[key] is not None)


def _line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The next line ``proc`` writes (one a command: none waits in its buffer), within
    ``timeout`` seconds."""
    assert proc.stdout is not None
    if not select.select([proc.stdout], [], [], timeout)[0]:
        raise TimeoutError(f"a simulated process said nothing for {timeout:g}s")
    return proc.stdout.readline()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one(mode: str, world: int, per_node: int, steady: float) -> dict[str, Any]:
    """One protocol at one size: a fresh store, the simulated nodes, the figures."""
    import torch.distributed as dist

    from tether.job.alarm import AlarmBoard

    nodes = world // per_node
    host = subprocess.Popen(
        [sys.executable, "-c", _STORE_HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env=env(),
    )  # fmt: skip
    sims: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory(prefix="tether-scale-") as tmp:
        try:
            assert host.stdout is not None
            port = int(_line(host, READY_TIMEOUT_S))
            roles = ["agents", mode]  # the agents look and beat either way
            for role in roles:
                share = SHARE[role](nodes, world)
                bounds = [nodes * k // share for k in range(share + 1)]
                started = []
                for a, b in itertools.pairwise(bounds):
                    started.append(subprocess.Popen(
                        [sys.executable, __file__, "--simulate", role, "--port", str(port),
                         "--nodes", f"{a}:{b}", "--per-node", str(per_node), "--world",
                         str(world), "--root", tmp, "--beats", BEATS[mode]],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env(),
                    ))  # fmt: skip
                sims += started
                for sim in started:  # the agents listen before their ranks start
                    assert _line(sim, READY_TIMEOUT_S).strip() == "ready"

            def ask(command: str) -> list[Any]:
                for sim in sims:
                    assert sim.stdin is not None
                    sim.stdin.write(command + "\n")
                    sim.stdin.flush()
                return [json.loads(_line(sim, ANSWER_TIMEOUT_S)) for sim in sims]

            time.sleep(1.0)  # past start-up: each rank's first looks
            ops0, cpu0, t0 = sum(ask("count")), cpu_s(host.pid), time.monotonic()
            time.sleep(steady)  # the window measured: nothing happens in it
            ops1, cpu1, t1 = sum(ask("count")), cpu_s(host.pid), time.monotonic()
            board = AlarmBoard(
                dist.TCPStore("127.0.0.1", port, 1, False, use_libuv=True)  # type: ignore[attr-defined]
            )
            raised_at = time.time()
            board.raise_alarm("manual", origin="bench/scale.py")
            answers = ask("answered 300")
            killed = latest(ask("kill"), "killed")
            detected = [a["detected"] for a in ask("detected 30") if a["detected"] is not None]
        finally:
            for proc in [*reversed(sims), host]:  # ranks before their agents: no "agent gone"
                proc.kill()
                proc.wait(30)
    answered = sum(a["answered"] for a in answers)
    if answered < world:
        print(f"  {mode} {world}: only {answered} ranks answered in 300 s", file=sys.stderr)
    return {
        "answered": answered,
        "store_ops_per_s_per_node": (ops1 - ops0) / (t1 - t0) / nodes,
        "store_host_cpu": (cpu1 - cpu0) / (t1 - t0),
        "alarm_to_all_relayed_s": (
            latest(answers, "relayed") - raised_at if mode == "relay" else None
        ),
        "alarm_to_all_heard_s": latest(answers, "heard") - raised_at,
        "alarm_to_all_dumped_here_s": latest(answers, "dumped") - raised_at,
        # Each rank dumps on its own core and its node's disk as soon as it hears (here 2 cores
        # and one disk write every rank's dump in turn): when it heard, plus what its dump took.
        "alarm_to_all_dumped_s": latest(answers, "finished") - raised_at,
        "dead_node_detected_s": detected[0] - killed if detected else None,
    }


def analyze(ranks: int, reps: int, keep: Path | None) -> dict[str, Any]:
    """``tether analyze --json`` of a synthetic hang of ``ranks`` ranks, ``reps`` times."""
    from analyze_speed import CULPRIT, build_event, measure, warm

    root = keep or Path(tempfile.mkdtemp(prefix="tether-scale-analyze-"))
    event = root / str(ranks) / "20261130T101500.000000Z-hang"
    try:
        if not (event / f"rank_{ranks - 1}").exists():
            build_event(event, ranks, 2000)
        runs = []
        for _ in range(reps):
            warm(event)
            run = measure([sys.executable, "-m", "tether.cli.main", "analyze", str(event),
                           "--json"], 900)  # fmt: skip
            if run.rc != 0:
                raise SystemExit(f"tether analyze failed:\n{run.out[-2000:]}")
            got = json.loads(run.out.strip().splitlines()[-1])
            runs.append((run.wall_s, run.peak_mb, got["verdict"], got["culprit_ranks"]))
            print(f"  analyze {ranks}: {run.wall_s:.2f} s, {run.peak_mb:.0f} MB, {got['verdict']} "
                  f"{got['culprit_ranks']}", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return {
        "wall_s": [r[0] for r in runs],
        "peak_mb": [r[1] for r in runs],
        "right": all(r[2] == "hang" and r[3] == [CULPRIT] for r in runs),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--ranks", default="64,512,4096,16384")
    ap.add_argument("--per-node", type=int, default=16)
    ap.add_argument("--steady", type=float, default=5.0, help="seconds of steady state measured")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--analyze-ranks", type=int, default=16384, help="0: no analyze step")
    ap.add_argument("--analyze-event", type=Path, help="build the analyzed event here, and keep it")
    ap.add_argument("--simulate", choices=(*MODES, "agents"), help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--nodes", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--beats", choices=("udp", "store"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.simulate:
        a, b = map(int, args.nodes.split(":"))
        simulate(
            args.simulate, args.port, range(a, b), args.per_node, args.world, args.root, args.beats
        )
        return 0
    sizes = [int(n) for n in args.ranks.split(",")]
    modes = args.modes.split(",")
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {(m, n): [] for m in modes for n in sizes}
    for _ in range(args.reps):
        for n in sizes:
            for mode in modes:
                runs[mode, n].append(one(mode, n, args.per_node, args.steady))
                print(f"  {mode} {n}: {runs[mode, n][-1]}", file=sys.stderr, flush=True)

    def col(mode: str, n: int, key: str) -> list[float]:
        return [r[key] for r in runs[mode, n] if r[key] is not None]

    print(
        f"{'ranks':>6} {'protocol':>8} {'store ops/s/node':>18} {'store host CPU':>16} "
        f"{'alarm -> all heard, s':>22} {'-> all dumped, s':>18} {'(one machine), s':>17} "
        f"{'dead node -> found, s':>22}"
    )
    for n in sizes:
        for mode in modes:
            print(
                f"{n:>6} {mode:>8} "
                f"{spread(col(mode, n, 'store_ops_per_s_per_node'), '{:.2f}'):>18} "
                f"{spread([100 * v for v in col(mode, n, 'store_host_cpu')], '{:.1f}%'):>16} "
                f"{spread(col(mode, n, 'alarm_to_all_heard_s'), '{:.2f}'):>22} "
                f"{spread(col(mode, n, 'alarm_to_all_dumped_s'), '{:.2f}'):>18} "
                f"{spread(col(mode, n, 'alarm_to_all_dumped_here_s'), '{:.2f}'):>17} "
                f"{spread(col(mode, n, 'dead_node_detected_s'), '{:.2f}'):>22}"
            )
    analyzed = (
        analyze(args.analyze_ranks, args.reps, args.analyze_event) if args.analyze_ranks else None
    )
    if analyzed is not None:
        print(
            f"tether analyze, {args.analyze_ranks} ranks x 2,000 entries: "
            f"{spread(analyzed['wall_s'], '{:.2f}')} s, peak {max(analyzed['peak_mb']):.0f} MB, "
            f"verdict and culprit {'right' if analyzed['right'] else 'WRONG'}"
        )
    figures: dict[str, Any] = {"bench": "scale", "reps": args.reps, "per_node": args.per_node}
    if analyzed is not None:
        size = (
            f"{args.analyze_ranks // 1024}k"
            if args.analyze_ranks % 1024 == 0
            else str(args.analyze_ranks)
        )
        figures[f"analyze_s_{size}"] = round(statistics.median(analyzed["wall_s"]), 2)
        figures[f"analyze_peak_mb_{size}"] = round(max(analyzed["peak_mb"]), 1)
        figures["analyze_right"] = analyzed["right"]
    for key in ("store_ops_per_s_per_node", "store_host_cpu", "alarm_to_all_heard_s",
                "alarm_to_all_dumped_s", "alarm_to_all_dumped_here_s",
                "dead_node_detected_s"):  # fmt: skip
        for mode in modes:
            name = key if mode == "relay" else f"{key}_before"
            values = {n: col(mode, n, key) for n in sizes}
            figures[name] = {
                str(n): round(statistics.median(v), 4) if v else None for n, v in values.items()
            }
    print(json.dumps(figures))
    return 0 if analyzed is None or analyzed["right"] else 1


if __name__ == "__main__":
    sys.exit(main())
