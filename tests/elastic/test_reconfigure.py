"""torch's reconfigure API on a recorded one-rank group, torch 2.14's or tether's for torch 2.13:
the refusals carry torch 2.14's own texts, a set of handles works, and the group's backend object
answers what torch's own reconfigure tests ask of it (a subprocess each: tether patches torch in
the process it is installed in)."""

from __future__ import annotations

import pytest

from tests._jobs import script_result

pytestmark = [pytest.mark.every_torch, pytest.mark.python_recorder, pytest.mark.regroup]

SCRIPT = """
import json, tempfile, torch, torch.distributed as dist
import tether
tether.install(tether.Config(dump_dir=tempfile.mkdtemp(), debug_port=None))
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=0, world_size=1, enable_reconfigure=True)
mine = dist._get_reconfigure_handle()
out = {"supports": dist._supports_reconfigure(), "handle": mine}
cases = {
    "empty": [],
    "repeated": [mine, mine],
    "invalid": [mine, "nope"],
    "stranger": ["gloo:0:-1:5:127.0.0.1:1"],
}
for name, handles in cases.items():
    try:
        dist._reconfigure(1, handles).wait()
        out[name] = "accepted"
    except RuntimeError as exc:
        out[name] = str(exc)
work = dist._reconfigure(1, {mine})
t = torch.ones(2)
dist.all_reduce(t)
out["after"] = [work.is_completed(), dist.get_rank(), dist.get_world_size(), t.tolist()]
# What torch's own reconfigure tests ask of the group's backend object: torch 2.14's gloo answers.
backend = dist.group.WORLD._get_backend(torch.device("cpu"))
out["backend"] = [backend.supports_reconfigure, str(backend.get_error())]
backend.abort()  # a reconfigure with a fresh uuid recovers the group
dist._reconfigure(2, {dist._get_reconfigure_handle()}).wait()
dist.all_reduce(t)
out["after_abort"] = [str(backend.get_error()), t.tolist()]
print("RESULT " + json.dumps(out))
"""


@pytest.mark.timeout(60)
def test_refusals_say_what_torch_says() -> None:
    out = script_result(SCRIPT, timeout=60)
    assert out["supports"] is True
    assert out["handle"].startswith("gloo:0:-1:0:127.0.0.1:")
    assert out["empty"] == "Reconfigure requires at least one handle"
    assert out["repeated"] == "Reconfigure handles must be unique"
    assert out["invalid"] == "Invalid Gloo reconfigure handle: nope"
    assert out["stranger"] == "Local Gloo reconfigure handle is not part of the new communicator"
    # A refusal leaves the group unconfigured; a set of handles then configures it, synchronously.
    assert out["after"] == [True, 0, 1, [1.0, 1.0]]
    assert out["backend"] == [True, "ErrorType.SUCCESS"]
    assert out["after_abort"] == ["ErrorType.SUCCESS", [1.0, 1.0]]


ONE_BACKEND = """
import threading, tempfile, torch.distributed as dist
import tether
from tether.recorder import reconfigure
tether.install(tether.Config(dump_dir=tempfile.mkdtemp(), debug_port=None))
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
pg = dist.distributed_c10d._get_default_group()
backend = reconfigure._recorder.recording_backend(pg)
if backend is None:  # the Python recorder: nothing of the core's to ask
    print('RESULT {"native": false}')
    raise SystemExit(0)
types = [d.type for d in pg._device_types]
assert len(types) > 1, types  # gloo serves cpu and cuda: one backend under two names
assert backend.inner(types[0]) is backend.inner(types[1])
stop = threading.Event()

def churn():  # a worker's other threads allocate while the check runs
    while not stop.is_set():
        [{"k": (i, i)} for i in range(20)] + [bytearray(i % 200) for i in range(40)]

thread = threading.Thread(target=churn, name="test-churn", daemon=True)
thread.start()
try:
    for _ in range(50_000):
        reconfigure._wrapped(pg)  # raises MULTIPLE_BACKENDS where it takes one for two
finally:
    stop.set()
print("RESULT {}")
"""


@pytest.mark.timeout(120)
def test_a_recorded_gloo_group_is_one_backend_however_often_it_is_asked() -> None:
    # The regroup of an elastic job asks it; a false "multiple backends" failed a survivor's
    # regroup (its process exited, and the job went on without it).
    out = script_result(ONE_BACKEND, timeout=120, TETHER_RECORDER="native")
    if out == {"native": False}:
        pytest.skip("the native core is not loaded here")
    assert out == {}
