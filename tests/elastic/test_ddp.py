"""tether.elastic.DistributedDataParallel's gradient buckets: laid out on a rank's first step as
on every later step, so that a replacement's first step averages the same gradients in the same
places as the survivors' hundredth, last layers first (a subprocess: a process group of its
own)."""

from __future__ import annotations

import pytest

from tests._jobs import script_result

pytestmark = pytest.mark.every_torch

SCRIPT = """
import json, torch, torch.distributed as dist
import tether.elastic

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)


class Net(torch.nn.Module):  # its first layer is registered last: gradients come out of order
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))
        self.first = torch.nn.Linear(64, 64)

    def forward(self, x):
        x = self.first(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum()


def layout(net):  # each bucket's parameters, by their index in the model
    index = {id(p): i for i, p in enumerate(net.module.parameters())}
    return [
        [index[id(p)] for p in bucket.parameters()]
        for bucket in net.reducer._get_zeros_like_grad_buckets()
    ]


def ddp():
    torch.manual_seed(0)
    return tether.elastic.DistributedDataParallel(Net(), bucket_cap_mb=0.03)


survivor, seen = ddp(), []
for step in range(3):
    survivor(torch.randn(8, 64)).backward()
    seen.append(layout(survivor))
replacement = ddp()
replacement(torch.randn(8, 64)).backward()
print("RESULT " + json.dumps({"survivor": seen, "replacement": layout(replacement)}))
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_a_replacement_s_first_step_has_the_survivors_buckets() -> None:
    out = script_result(SCRIPT, timeout=120)
    first, *later = out["survivor"]
    assert all(buckets == first for buckets in later), out
    assert out["replacement"] == first, out
    assert len(first) > 1, first  # several buckets: their order could have differed
    # The bucket launched first holds the parameters registered last (a model's last layers,
    # whose gradients the backward pass makes first): its all_reduce overlaps the rest of it.
    assert first[0][0] > first[-1][0], first
