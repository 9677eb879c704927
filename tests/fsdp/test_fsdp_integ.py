"""tether.fsdp in real gloo jobs of 2 and 4 processes (``tests/workers/fsdp_controls.py``): torch
2.15's FSDP2 precision and gradient-accumulation controls on the torch installed here, through
whatever ``from tether.fsdp import ...`` hands out: tether's backport on torch 2.13/2.14, torch's
own classes on 2.15, held to the same expectations. A few stages exercise what only the backport has
(its ``reduce_dtype=None`` switch, its refusals): they skip on 2.15, saying so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._jobs import launch, new_store
from tether._versions import TORCH_FSDP_CONTROLS

pytestmark = [pytest.mark.every_torch, pytest.mark.slow]

BF16, FP32 = "torch.bfloat16", "torch.float32"


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def seen(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    world = request.param
    store = new_store()
    dumps = tmp_path_factory.mktemp("fsdp") / "dumps"
    job = launch("fsdp_controls.py", world, port=store.port, dump_dir=Path(dumps), timeout=240)
    return job.results()


@pytest.mark.timeout(300)
def test_fp32_gates_and_norms_in_a_bf16_group_match_the_reference(seen: list[Any]) -> None:
    for out in seen:
        parity = out["parity"]
        # The gate is computed in its own fp32 while the rest of the block computes in bf16.
        assert parity["compute_dtypes"] == [BF16, FP32]
        # Forward bit-identical to a single process applying the same casts, every step;
        # gradients too (the same fp32 sums here), within float tolerance by contract.
        assert parity["losses_equal"] == [True, True, True]
        assert max(parity["grad_err"]) < 1e-5
        assert parity["grad_dtypes"] == [FP32]


@pytest.mark.timeout(300)
def test_one_all_gather_per_group_as_many_collectives_as_the_bf16_policy(seen: list[Any]) -> None:
    for out in seen:
        parity = out["parity"]
        for mixed, baseline in zip(parity["counts"], parity["baseline"], strict=True):
            assert len(mixed["all_gather"]) == len(baseline["all_gather"])
            assert len(mixed["reduce_scatter"]) == len(baseline["reduce_scatter"])
            # A block's bf16 and fp32 parameters travel in one uint8 all-gather, forward and
            # backward (blocks reshard after forward); the root's head is bf16 only.
            assert mixed["all_gather"].count("torch.uint8") == 2 * parity["groups"]
            assert baseline["all_gather"].count("torch.uint8") == 0
            # One reduce-scatter per group, in the policy's fp32 reduce dtype.
            assert len(mixed["reduce_scatter"]) == parity["groups"] + 1
            assert {dtype for dtype, _ in mixed["reduce_scatter"]} == {FP32}


@pytest.mark.timeout(300)
def test_gradient_accumulation_in_every_dtype_combination(seen: list[Any]) -> None:
    for out in seen:
        for combo in ("bf16+reduce_fp32", "bf16+follow_grad_dtype"):
            accumulated = out[f"accumulate {combo}"]
            # Accumulated in fp32 in .grad, reduced once in fp32: as exact as fp32 sums.
            assert accumulated["err"] < 1e-5, combo
            assert accumulated["reduce_dtypes"] == [FP32]
            assert accumulated["reduce_scatters"] == 4  # the last micro-step only
            assert accumulated["grad_dtypes"] == [FP32]
        if TORCH_FSDP_CONTROLS:  # torch 2.15's reduce_dtype=None has no 2.13/2.14 mode
            continue
        legacy = out["accumulate bf16+legacy"]
        # torch 2.13/2.14's reduce_dtype=None: bf16 gradients for the bf16-only root group; the
        # blocks' bf16 and fp32 gradients promote to fp32. bf16 accumulation: bf16 accuracy.
        assert legacy["reduce_dtypes"] == [BF16, FP32]
        assert 0 < legacy["err"] < 2e-2
        assert legacy["grad_dtypes"] == [FP32]


@pytest.mark.timeout(300)
def test_an_fp32_grad_dtype_accumulates_256_plus_1_minus_256_exactly(seen: list[Any]) -> None:
    for out in seen:
        assert out["256_tether"] == [1.0] * len(out["256_tether"])
        # torch's own fully_shard before 2.15 drops the grad_dtype: bf16 accumulation loses the 1.
        torchs = 1.0 if TORCH_FSDP_CONTROLS else 0.0
        assert out["256_torch"] == [torchs] * len(out["256_torch"])


@pytest.mark.timeout(300)
def test_grad_dtype_survives_sharding_conversion_and_assign(seen: list[Any]) -> None:
    for out in seen:
        kept = out["grad_dtype"]
        # torch's own fully_shard before 2.15 drops it (pytorch#170648).
        assert kept["torch_after_fully_shard"] == (FP32 if TORCH_FSDP_CONTROLS else BF16)
        assert kept["after_fully_shard"] == FP32
        # bf16 and fp32 gradients in one group: reduced in their promoted fp32 (blocks), the
        # root's bf16-only group in bf16; each shard keeps its parameter's gradient dtype.
        assert kept["reduce_dtypes"] == [BF16, FP32]
        assert kept["reduce_scatters"] == 4
        assert kept["shard_grad_dtypes"] == {"blocks.0.gate.weight": FP32, "head.weight": BF16}
        assert kept["gate_err"] < 1e-2  # bf16 compute against an fp32-accumulated reference
        assert kept["after_to"] == ["torch.float16", FP32, FP32]  # the override and its grad
        assert kept["others_after_to"] == "torch.float16"  # an unset one follows the dtype
        assert kept["after_assign"] == FP32


def ran(seen: list[Any], stage: str) -> list[Any]:
    """Every rank's output, if this job ran ``stage`` (the 4-process job skips the stages that
    do not depend on the world size)."""
    if stage not in seen[0]:
        pytest.skip(f"the {len(seen)}-process job does not run {stage}")
    return seen


@pytest.mark.timeout(300)
def test_unused_parameters_with_grad_dtype_none_need_a_reduce_dtype(seen: list[Any]) -> None:
    for out in ran(seen, "unused"):  # every rank raises, together, before any collective
        assert out["unused"].startswith(
            "ValueError: Reducing unused parameters with grad_dtype=None requires an explicit "
            "MixedPrecisionPolicy.reduce_dtype"
        )


@pytest.mark.timeout(300)
def test_policy_edges(seen: list[Any]) -> None:
    for out in ran(seen, "edges"):
        edges = out["edges"]
        assert edges["set_after_fully_shard"] == FP32  # read at lazy init, as in 2.15
        assert edges["offload_one_dtype"] == FP32


@pytest.mark.timeout(300)
@pytest.mark.skipif(TORCH_FSDP_CONTROLS, reason="the backport's own switch and refusals")
def test_the_backports_switch_and_refusals(seen: list[Any]) -> None:
    for out in ran(seen, "edges"):
        edges = out["edges"]
        # Switching reduce_dtype=None's meaning after a module's first unshard does not change
        # it for that module (its accumulation dtype was fixed then): compute dtype, no error.
        assert edges["toggled"] == "no error"
        assert edges["toggled_reduce_dtypes"] == [BF16]
        assert edges["offload_mixed"].startswith(
            "NotImplementedError: tether.fsdp: CPU offload of a group whose gradients have "
            "several dtypes is not supported"
        )
        message = "tether.fsdp: every fully_shard of a model must be tether.fsdp.fully_shard"
        assert [m.split(": ", 1)[1].startswith(message) for m in edges["mixed_twice"]] == [True] * 2


@pytest.mark.timeout(300)
def test_the_override_function_runs_once_per_parameter_and_is_checked(seen: list[Any]) -> None:
    for out in ran(seen, "override"):
        override = out["override"]
        assert override["calls"] == override["params"]
        assert override["not_a_dtype"] == (
            "ValueError: param_dtype_override_fn must return a torch.dtype or None but got "
            "<class 'str'>"
        )
        assert override["other_dtype"] == (
            "ValueError: param_dtype_override_fn must return None, param_dtype, or the "
            "parameter's original dtype but got torch.float16 for a parameter with dtype "
            "torch.float32 and param_dtype torch.bfloat16"
        )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["manual_sync", "manual_async"])
def test_manual_finalization_reduces_once_at_finalize(seen: list[Any], mode: str) -> None:
    for out in seen:
        manual = out[mode]
        assert manual["equal"]  # bit-identical to automatic finalization
        assert manual["returned"] == (
            "GradientReductionHandle" if mode == "manual_async" else "NoneType"
        )
        assert manual["reduce_scatters_in_backward"] == 0
        # finalize_backward reduces the groups in reverse order: the last block first.
        blocks = manual["group_numels"][:3]
        assert manual["finalize_order"][:3] == blocks[::-1]
        assert len(manual["finalize_order"]) == 4


MANUAL_ERRORS = {
    "before_forward": "NoneNone",
    "not_manual": "RuntimeError: FSDP finalize_backward requires manual backward finalization. "
    "Call set_manual_backward_finalization(True) before forward",
    "non_root_finalize": "RuntimeError: finalize_backward must be called on the root FSDP module",
    "non_root_set": "RuntimeError: set_manual_backward_finalization must be called on the root "
    "FSDP module",
    "non_root_at_lazy_init": "RuntimeError: set_manual_backward_finalization must be called on "
    "the root FSDP module",
    "during_backward": "RuntimeError: set_manual_backward_finalization cannot change mode "
    "during backward",
    "after_backward_starts": "RuntimeError: set_manual_backward_finalization cannot change mode "
    "after backward starts",
    "finalize_in_backward": "RuntimeError: FSDP finalize_backward must be called after backward "
    "completes",
    "twice": "RuntimeError: The previous gradient reduction must be waited on before finalizing "
    "backward again",
    "forward_pending": "RuntimeError: The previous gradient reduction must be waited on before "
    "forward",
    "shared_pending": "RuntimeError: Another gradient reduction sharing this communication "
    "context must be waited on before finalizing backward",
    "shared_overlap": "RuntimeError: Asynchronous gradient finalization cannot overlap work from "
    "another FSDP root sharing the communication context",
}


@pytest.mark.timeout(300)
def test_every_manual_finalization_error(seen: list[Any]) -> None:
    for out in ran(seen, "manual_errors"):
        errors = out["manual_errors"]
        for case, message in MANUAL_ERRORS.items():
            assert errors[case] == message, case
        assert errors["invalidated"].startswith(
            "RuntimeError: This gradient reduction handle was invalidated"  # 2.15's text
        )


@pytest.mark.timeout(300)
def test_hsdp_refusals(seen: list[Any]) -> None:
    for out in ran(seen, "hsdp"):  # a 2 x 2 mesh: the 4-process job
        refused = out["hsdp"]["no_all_reduce"]
        if TORCH_FSDP_CONTROLS:
            # 2.15 reduce-scatters in backward without the all-reduce, and refuses the partial
            # output; the backport defers every reduction to finalize (docs/compat.md).
            assert refused.startswith(
                "RuntimeError: FSDP manual backward finalization does not support partial "
                "gradient reductions for parameter group 'blocks."
            ), refused
        else:
            assert refused == (
                "RuntimeError: FSDP manual backward finalization requires all-reduce for "
                "parameter group '<root>'. Call set_requires_all_reduce(True) before finalization"
            )
        assert out["hsdp"]["partial"] == (
            "RuntimeError: FSDP manual backward finalization does not support partial gradient "
            "reductions for parameter group '<root>'. Use automatic backward finalization for "
            "this configuration"
        )


@pytest.mark.timeout(300)
def test_kept_unsharded_storage_keeps_its_address(seen: list[Any]) -> None:
    for out in ran(seen, "keep_storage"):
        kept = out["keep_storage"]
        assert kept["pointers_equal"]
        assert min(kept["kept_sizes"]) > 0
        assert kept["freed"] == 0  # without it, resharding frees the storage again
