"""The native core from the outside: what torch and its libraries see of a group it records, the
operations it records on the paths the Python recorder cannot see cheaply, and `tether doctor`."""

from __future__ import annotations

import inspect
import logging
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests._jobs import result_of, worker_env
from tether.config import Config
from tether.events.ringfile import RECORD_LAYOUT
from tether.recorder import native_core
from tether.recorder.native import NativeRecorder, load, new_recorder

pytestmark = [
    pytest.mark.skipif(load()[0] is None, reason=f"no native core here: {load()[1]}"),
    pytest.mark.every_torch,
]

SCRIPT = """
import json, sys, tempfile
from datetime import timedelta
import torch, torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch.distributed.device_mesh import init_device_mesh
import tether
from tether.runtime import current
tether.install(tether.Config(dump_dir=tempfile.mkdtemp(), recorder="native", debug_port=None))
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
out = {}
"""


def run(body: str, timeout: float = 90, *, ext: bool = False) -> dict[str, Any]:
    """Run ``body`` after SCRIPT (and, with ``ext``, after compiling CPP_LOOP as ``ext``)."""
    prelude = SCRIPT + (_load_ext() if ext else "")
    code = prelude + textwrap.dedent(body) + "\nprint('RESULT ' + json.dumps(out))\n"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, timeout=timeout, env=worker_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result: dict[str, Any] = result_of(proc.stdout)
    return result


@pytest.mark.timeout(120)
def test_torch_sees_its_own_group_and_backend() -> None:
    out = run(
        """
        pg = dist.group.WORLD
        backend = pg._get_backend(torch.device("cpu"))
        out["type"] = [type(pg).__name__, type(backend).__name__]
        out["backend"] = [dist.get_backend(pg), backend.name()]
        out["name"] = [pg.group_name, pg.group_desc, backend.inner("cpu").options._timeout.seconds]
        # torch sets timeouts on gloo's own class only: the core passes it on.
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=77), pg)
        out["timeout"] = backend.options._timeout.seconds  # answered by the wrapped backend
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        dist.all_reduce(torch.ones(2), group=mesh.get_group("dp"))
        fc.all_reduce(torch.ones(2), "sum", pg).wait()
        out["ops"] = [(e.profiling_name, e.group.desc) for e in current().entries()]
        """
    )
    assert out["type"] == ["ProcessGroup", "RecordingBackend"]
    assert out["backend"] == ["gloo", "gloo"]
    assert out["name"][:2] == ["0", "default_pg"]
    assert out["timeout"] == 77 and out["name"][2] != 77
    assert out["ops"] == [["gloo:all_reduce", "default_pg"], ["gloo:all_reduce", "default_pg"]]


@pytest.mark.timeout(120)
def test_a_backend_that_is_a_python_process_group_still_works() -> None:
    """A third-party backend may hand torch a Python ProcessGroup of its own (torch then uses it
    as the group): it has no C++ backend to wrap, so it runs unrecorded rather than fail."""
    out = run(
        """
        class Echo(dist.ProcessGroup):
            def getBackendName(self):
                return "echo"

            def broadcast(self, tensors, opts):
                tensors[0].add_(1)
                fut = torch.futures.Future()
                fut.set_result(tensors)
                return torch._C._distributed_c10d._create_work_from_future(fut)

        dist.Backend.register_backend(
            "echo", lambda store, rank, size, timeout: Echo(rank, size), devices=["cpu"]
        )
        sub = dist.new_group([0], backend="echo")
        t = torch.zeros(2)
        dist.broadcast(t, 0, group=sub)
        dist.all_reduce(torch.ones(2))
        out["t"] = t.tolist()
        out["ops"] = [(e.profiling_name, e.group.desc) for e in current().entries()]
        """
    )
    assert out["t"] == [1.0, 1.0]
    assert out["ops"] == [["gloo:all_reduce", "default_pg"]]


CPP_LOOP = """
// Issues all_reduces from C++ with the GIL released, as DDP's reducer does: on the calling
// (Python) thread, then on a thread that has never run Python (DDP's autograd thread on GPU).
#include <thread>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>
namespace py = pybind11;
void loop(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, int64_t n, bool own_thread) {
  py::gil_scoped_release nogil;
  auto run = [&] {
    std::vector<at::Tensor> t{at::ones({3})};
    for (int64_t i = 0; i < n; ++i) pg->allreduce(t)->wait();
  };
  if (own_thread) std::thread(run).join(); else run();
}

// A backend whose works stay where gloo's are between completing their future and finishing
// (AsyncWork::finishWorkGloo): the future done, isCompleted() false.
class HeldWork : public c10d::Work {
 public:
  explicit HeldWork(const std::vector<at::Tensor>& t)
      : c10d::Work(-1, c10d::OpType::ALLREDUCE),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {
    future_->markCompleted(c10::IValue(t));
  }
  bool wait(std::chrono::milliseconds) override { return true; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};
class HeldBackend : public c10d::Backend {
 public:
  HeldBackend(int rank, int size) : c10d::Backend(rank, size) {}
  const std::string getBackendName() const override { return "held"; }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& t,
                                           const c10d::AllreduceOptions&) override {
    return c10::make_intrusive<HeldWork>(t);
  }
};
c10::intrusive_ptr<c10d::Backend> held(int64_t rank, int64_t size) {
  return c10::make_intrusive<HeldBackend>(rank, size);
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("loop", &loop); m.def("held", &held); }
"""


def _load_ext() -> str:
    """Code that compiles CPP_LOOP as ``ext`` (once per venv, about 40 s)."""
    build = Path(sys.prefix) / "tether-test-build"
    build.mkdir(exist_ok=True)
    # A build killed midway leaves torch's lock file, and the next build would wait on it for
    # ever; the tests run one at a time, so a lock here is such a leftover.
    (build / "lock").unlink(missing_ok=True)
    return f"""
from torch.utils.cpp_extension import load_inline
ext = load_inline("tether_test_cpp_loop", cpp_sources=[{CPP_LOOP!r}],
                  build_directory={str(build)!r})
"""


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_ops_issued_from_cpp_are_recorded_with_the_stack_a_thread_has() -> None:
    out = run(
        """
        from tether.recorder.frames import symbolize
        ext.loop(dist.group.WORLD, 3, False)  # MARK python-thread
        ext.loop(dist.group.WORLD, 2, True)
        current().reap()
        entries = current().entries()
        out["names"] = [e.profiling_name for e in entries]
        out["states"] = [e.state for e in entries]
        stacks = symbolize([e.frames for e in entries], 16)
        out["lines"] = [[f["line"] for f in s if f["filename"] == "<string>"] for s in stacks]
        out["threads"] = [e.thread_id == __import__("threading").get_ident() for e in entries]
        """,
        timeout=280,  # the first run compiles the extension
        ext=True,
    )
    assert out["names"] == ["gloo:all_reduce"] * 5
    assert out["states"] == ["completed"] * 5
    python_thread, own_thread = out["lines"][:3], out["lines"][3:]
    assert all(len(lines) == 1 for lines in python_thread), out["lines"]
    assert own_thread == [[], []], out["lines"]  # no Python there: no stack, and no GIL taken
    assert out["threads"] == [True, True, True, False, False]


@pytest.mark.timeout(320)
def test_a_done_future_finishes_an_operation_whose_work_still_says_running() -> None:
    """gloo completes a work's future before the work itself, and DDP's reducer waits on the
    future: once the caller has its result, neither a dump nor the watchdog sees it running."""
    out = run(
        """
        # A group of the held backend alone, wrapped by the core as it wraps every new group
        # (torch would register a third-party backend in the CUSTOM slot the core needs).
        recorder = current()
        sub = dist.ProcessGroup(store, 0, 1)
        group = recorder.add_group(name="held", desc="held", ranks=[0], group_rank=0,
                                   backends={"cpu": "held"}, timeout_ms=60000)
        recorder.wrap(sub, group, {"cpu": ext.held(0, 1)})
        sub._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
        work = sub.allreduce([torch.ones(2)])
        work.get_future().wait()
        out["work_says"] = work.is_completed()
        recorder.reap()
        out["ops"] = [(e.profiling_name, e.state) for e in recorder.entries()]
        out["inflight"] = len(recorder.inflight())
        """,
        timeout=280,  # the first run compiles the extension
        ext=True,
    )
    assert out["work_says"] is False  # the stand-in holds gloo's window open
    assert out["ops"] == [["held:all_reduce", "completed"]]
    assert out["inflight"] == 0


@pytest.mark.timeout(60)
def test_doctor_says_which_recorder_records() -> None:
    def doctor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tether.cli.main", "doctor", *args],
            capture_output=True, text=True, timeout=60, env=worker_env(**env),
        )  # fmt: skip

    native = doctor("--require-native")
    assert native.returncode == 0 and "recorder: native core" in native.stdout, native.stderr
    python = doctor("--require-native", TETHER_RECORDER="python")
    assert python.returncode == 1
    assert "Python recorder, because TETHER_RECORDER=python" in python.stdout
    bad = doctor(TETHER_RECORDER="fast")
    assert bad.returncode == 2 and "TETHER_RECORDER" in bad.stderr


# -- the typed boundary: native_core's stub against the module it describes -----------------------


def _bound_parameters(member: Any) -> list[str]:
    """Parameter names of a pybind-bound function, from its signature line (pybind names each
    argument bound with py::arg; ``self`` left out)."""
    line = (member.__doc__ or "").splitlines()[0]
    found = re.match(r"\w+\((.*)\) ->", line)
    assert found, f"no signature in {line!r}"
    names, depth, part = [], 0, ""
    for ch in found.group(1) + ",":
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            names.append(part.split(":")[0].strip())
            part = ""
        else:
            part += ch
    return [n for n in names if n and n != "self"]


def _stub_parameters(member: Any) -> list[str]:
    return [p for p in inspect.signature(member).parameters if p != "self"]


def _public(names: Any) -> set[str]:
    return {n for n in names if not n.startswith("_")}


@pytest.mark.parametrize("name", ["Core", "RecordingBackend"])
def test_the_stub_and_the_module_bind_the_same_names_alike(name: str) -> None:
    module = load()[0]
    real, stub = vars(getattr(module, name)), vars(getattr(native_core, name))
    assert _public(real) == _public(stub)
    for member in sorted(_public(stub) | {"__init__"}):
        if isinstance(stub[member], property):
            assert isinstance(real[member], property), member
            continue
        assert callable(real[member]), member
        assert _bound_parameters(real[member]) == _stub_parameters(stub[member]), member


def test_the_stub_names_what_the_module_holds() -> None:
    module = load()[0]
    assert _public(dir(module)) == set(native_core.NativeModule.__annotations__)
    assert isinstance(module.ABI, int) and isinstance(module.TORCH_VERSION, str)
    assert isinstance(module.Core, type) and isinstance(module.RecordingBackend, type)


# -- the ring record's layout, declared on both sides and compared at load -------------------------


def test_the_core_writes_the_record_layout_python_reads() -> None:
    module = load()[0]
    assert module is not None
    assert dict(module.RECORD_LAYOUT) == RECORD_LAYOUT


def test_a_core_writing_another_layout_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    module = load()[0]
    layout: Any = dict(module.RECORD_LAYOUT)  # the name a byte further on, as a drifted core
    layout["fields"] = [(n, at + (n == "name"), size) for n, at, size in layout["fields"]]
    monkeypatch.setattr(module, "RECORD_LAYOUT", layout)
    assert load()[0] is None and "layout" in load()[1]
    with caplog.at_level(logging.INFO, logger="tether"):
        recorder = new_recorder(Config(dump_dir=tmp_path, recorder="auto"))
    assert not isinstance(recorder, NativeRecorder) and not recorder.native
    said = [r for r in caplog.records if r.name.startswith("tether")]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, said
    message = said[0].getMessage()
    assert message.startswith("[rank ") and "ring-file records in another layout" in message
    assert "field ('name', 81, 48), not ('name', 80, 48)" in message
