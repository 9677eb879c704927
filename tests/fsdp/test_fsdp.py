"""tether.fsdp's pieces that need no process group: the policy's contract, the name helper, and
examples/fsdp_precision.py run as users run it, on whatever ``tether.fsdp`` hands out (torch's own
classes on 2.15); and the backport's internals (the torch gate, the mixed-dtype chunk-cat op),
which skip on 2.15."""

from __future__ import annotations

import dataclasses
import gc
import re
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

import tether.fsdp
from tests._jobs import REPO, worker_env
from tether import UnsupportedTorchError
from tether._versions import TORCH_FSDP_CONTROLS
from tether.fsdp import MixedPrecisionPolicy, keep_original_dtype

pytestmark = pytest.mark.every_torch

backport_only = pytest.mark.skipif(
    TORCH_FSDP_CONTROLS, reason="the backport's internals: tether.fsdp is torch's own on 2.15"
)

BF16, FP32 = torch.bfloat16, torch.float32


def test_the_policy_is_torchs_with_a_keyword_only_override() -> None:
    assert issubclass(MixedPrecisionPolicy, TorchPolicy)
    names = [f.name for f in dataclasses.fields(MixedPrecisionPolicy)]
    assert names == [
        "param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs",
        "param_dtype_override_fn",
    ]  # fmt: skip
    assert MixedPrecisionPolicy(BF16, FP32, None, False).reduce_dtype == FP32  # positional order
    with pytest.raises(TypeError):
        MixedPrecisionPolicy(BF16, FP32, None, True, lambda p: None)  # type: ignore[misc]
    policy = MixedPrecisionPolicy(param_dtype=BF16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.param_dtype = FP32  # type: ignore[misc]
    assert policy.param_dtype_override_fn is None
    assert policy._resolve_for_param(nn.Parameter(torch.zeros(2))) is policy


def test_the_override_resolves_per_parameter_with_torchs_two_errors() -> None:
    param = nn.Parameter(torch.zeros(2))

    def policy(answer: object, param_dtype: torch.dtype | None = BF16) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=FP32, param_dtype_override_fn=lambda p: answer
        )

    for answer, expected in ((None, BF16), (BF16, BF16), (FP32, FP32)):
        resolved = policy(answer)._resolve_for_param(param)
        assert (resolved.param_dtype, resolved.reduce_dtype) == (expected, FP32)
        assert resolved.param_dtype_override_fn is None
    with pytest.raises(
        ValueError, match=r"must return a torch\.dtype or None but got <class 'int'>"
    ):
        policy(3)._resolve_for_param(param)
    message = (
        "param_dtype_override_fn must return None, param_dtype, or the parameter's original dtype "
        "but got torch.float16 for a parameter with dtype torch.float32 and param_dtype "
        "torch.bfloat16"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        policy(torch.float16)._resolve_for_param(param)
    # Without a param_dtype, the only answer besides None is the parameter's own dtype.
    assert policy(FP32, None)._resolve_for_param(param).param_dtype == FP32
    with pytest.raises(ValueError, match="and param_dtype None"):
        policy(BF16, None)._resolve_for_param(param)


@backport_only
def test_an_untested_torch_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.fsdp import _torch as fsdp_torch

    fsdp_torch.require_tested_torch()  # this one is tested
    monkeypatch.setattr(fsdp_torch, "TORCH", (2, 12, 1))
    with pytest.raises(
        UnsupportedTorchError, match=r"tested with torch 2\.13, 2\.14; this is torch"
    ):
        fsdp_torch.require_tested_torch()


@backport_only
def test_a_torch_whose_fsdp_classes_changed_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.fsdp import _torch as fsdp_torch

    monkeypatch.delattr(fsdp_torch.fsdp_param.FSDPParam, "init_dtype_attrs")
    with pytest.raises(UnsupportedTorchError, match=r"_fsdp_param\.FSDPParam as tether knows it"):
        fsdp_torch.require_tested_torch()


@backport_only
def test_chunk_cat_mixed_dtype_casts_then_concatenates_chunks() -> None:
    from tether.fsdp import reduce

    reduce.install()
    reduce.install()  # idempotent
    grads = [torch.randn(4, 3, dtype=BF16), torch.randn(6, dtype=FP32), torch.randn(2, dtype=BF16)]
    out = torch.empty(2, 6 + 3 + 1, dtype=FP32)
    torch.ops.fsdp.chunk_cat_mixed_dtype(grads, dim=0, num_chunks=2, out=out)
    expected = torch.empty_like(out)
    torch._chunk_cat([g.to(FP32) for g in grads], 0, 2, out=expected)
    assert torch.equal(out, expected)
    # Rank 0's row holds the first half of each gradient.
    assert torch.equal(out[0, :6], grads[0][:2].to(FP32).flatten())


def test_keep_original_dtype_matches_names_and_holds_parameters_weakly() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    override = keep_original_dtype(model, lambda name: name.startswith("1."))
    assert [override(p) for p in model.parameters()] == [None, None, FP32, FP32]
    assert override(nn.Parameter(torch.zeros(2))) is None  # identity, not equal values
    norm = model[1].weight
    gone = weakref.ref(model[0].weight)
    del model
    gc.collect()
    assert override(norm) == FP32  # still referenced here
    assert gone() is None  # the override function kept no parameter alive


def test_public_names() -> None:
    assert tether.fsdp.__all__ == sorted(tether.fsdp.__all__)
    for name in tether.fsdp.__all__:
        assert getattr(tether.fsdp, name) is not None


@pytest.mark.timeout(180)
def test_the_example_trains_its_block_with_fp32_gate_and_norms() -> None:
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *("--nproc-per-node", "2", str(REPO / "examples" / "fsdp_precision.py")),
            *("--steps", "6"),
        ],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert (
            f"rank {rank} computes experts in torch.bfloat16, the gate in torch.float32, norms "
            "in torch.float32" in proc.stdout
        )
        losses = [
            float(x) for x in re.findall(rf"rank {rank} step \d+ loss ([0-9.]+)", proc.stdout)
        ]
        assert len(losses) == 6 and losses[-1] < 0.5 * losses[0], proc.stdout
