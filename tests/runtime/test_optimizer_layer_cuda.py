"""GPU: the optimizer layer's newer paths on CUDA (issues 35 and 36), on the tiny GPT-2 of
tests/runtime/zero_helpers.py in one process, fp32 compute with TF32 off:

- bf16 states (drawn stochastic-rounding bits on the device) and int8 blockwise moments: ZeRO 1-3 track
  stage 0 within the CPU tests' tolerances (rounding noise: 2e-4 and 1e-4 relative on the losses);
- bf16 states offloaded to the CPU Adam kernel (hashed bits) track the device's within the same 2e-4;
- Muon (fp32 Newton-Schulz) at ZeRO 2 and 3 ends within 1e-5 of stage 0;
- the delayed offloaded update, whose background step waits on CUDA events, follows the delayed rule
  written out by hand around a stage-0 CUDA engine (tests/runtime/test_delayed_offload.py), within 1e-5;
- the overlapped offloaded update (its thread copies each bucket after a CUDA event recorded in backward) gives
  exact offload's losses and weights bit for bit at stages 2 and 3, also with the parameters in pinned CPU memory
  and the optimizer in swap files; and with clipping, speculating on the coefficient (the device's in-place clip
  ordered between the thread's copies);
- the 16-bit layout at stage 3 (bf16 states, parameters in pinned CPU memory as the offloaded master, a bf16
  gradient shard): without clipping, bit for bit the same run with the parameters on the GPU and an fp32 shard.
"""
import pytest
import torch

from tests.runtime.zero_helpers import (DELAYED, RTOL, SMALL_BUCKETS, WARMUP, assert_params_close,
                                        assert_stages_1_to_3_track_stage_0,
                                        assert_the_repeated_clip_equals_copying_again, delayed_reference, train)

pytestmark = pytest.mark.cuda

CUDA = ["training.device=cuda"]
BF16 = ["precision.dtype=bf16", "optimizer.state_dtype=bf16"]
MUON = ["optimizer.type=muon", "optimizer.muon_lr=0.02", "optimizer.muon_weight_decay=0.1",
        "optimizer.muon_ns_dtype=fp32"]


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def on_cpu(params: dict) -> dict:
    return {name: p.detach().float().cpu() for name, p in params.items()}


def test_bf16_states_at_zero_1_to_3_track_stage_0():
    assert_stages_1_to_3_track_stage_0([*CUDA, *BF16], torch.bfloat16, rel=2e-4)


def test_int8_moments_at_zero_1_to_3_track_stage_0():
    assert_stages_1_to_3_track_stage_0([*CUDA, "optimizer.state_dtype=int8"], torch.uint8, rel=1e-4)


def test_offloaded_bf16_states_track_the_devices():
    device = train(1, [*CUDA, "zero.stage=2", SMALL_BUCKETS, *BF16])[2]
    engine, _, losses, _ = train(1, [*CUDA, "zero.stage=2", SMALL_BUCKETS, *BF16, "zero.offload_optimizer=cpu"])
    assert engine.device.type == "cuda" and engine.strategy.parts[-1].offloaded
    assert losses == pytest.approx(device, rel=2e-4)


def test_muon_at_zero_2_and_3_ends_within_1e_5_of_stage_0():
    reference = train(1, [*CUDA, *MUON, "zero.stage=0"])[0]
    for stage in (2, 3):
        engine = train(1, [*CUDA, *MUON, f"zero.stage={stage}"])[0]
        assert_params_close(on_cpu(engine.strategy.full_parameters()), on_cpu(reference.strategy.full_parameters()))


@pytest.mark.parametrize("stage", [2, 3])
def test_the_delayed_update_follows_the_hand_written_rule(stage):
    ref_losses, ref_master = delayed_reference(WARMUP, base=CUDA)
    engine, _, losses, _ = train(1, [*CUDA, f"zero.stage={stage}", SMALL_BUCKETS, *DELAYED])
    assert engine.device.type == "cuda" and engine.strategy.parts[-1].delayed.in_flight
    engine.strategy.complete_pending_update()
    assert losses == pytest.approx(ref_losses, rel=RTOL)
    assert_params_close(on_cpu(engine.strategy.full_parameters()), on_cpu(ref_master))


def test_the_delayed_update_repeats_the_clip_on_its_early_copy_as_copying_again_would_bit_for_bit(monkeypatch):
    """The recipe's clip 0.5 clips every step: the thread multiplies the backward's early copy by the coefficient.
    The device's clip waits for those copies (CUDA streams), so the run equals one whose steps copy the clipped
    gradients again, bit for bit; a clip racing the copies would not."""
    assert_the_repeated_clip_equals_copying_again([*CUDA, "zero.stage=2", SMALL_BUCKETS, *DELAYED], monkeypatch)


def test_the_16_bit_layout_at_stage_3_trains_as_the_fp32_shard_with_the_parameters_on_the_gpu(tmp_path):
    """zero.offload_param cpu (pinned; the host shard is the CPU step's master) and nvme with zero.grad_dtype bf16
    and the optimizer 60% in CPU memory: the CPU tests' bit-for-bit claims (tests/runtime/test_grad_dtype.py,
    test_bf16_states.py), on CUDA streams and pinned copies."""
    base = [*CUDA, "zero.stage=3", SMALL_BUCKETS, *BF16, "training.grad_clip=0", "zero.offload_optimizer=cpu",
            "zero.offload_ratio=0.6", f"zero.nvme_path={tmp_path}"]
    reference = train(1, base)
    for param in ("cpu", "nvme"):
        engine, _, losses, _ = train(1, [*base, f"zero.offload_param={param}", "zero.grad_dtype=bf16"])
        assert engine.strategy.grad_chunks[0].dtype == torch.bfloat16
        assert engine.strategy.parts[-1].weights_are_master == (param == "cpu")
        assert losses == reference[2], param
        want = on_cpu(reference[0].strategy.full_parameters())
        assert all(torch.equal(got, want[name]) for name, got in on_cpu(engine.strategy.full_parameters()).items())


@pytest.mark.parametrize("overrides", [["zero.stage=2", SMALL_BUCKETS], ["zero.stage=3", "precision.dtype=bf16"],
                                       ["zero.stage=3", "zero.offload_param=cpu", "zero.offload_optimizer=nvme"]],
                         ids=["stage2", "stage3 bf16", "stage3 params cpu, nvme"])
def test_the_overlapped_update_is_exact_offload_bit_for_bit(overrides, tmp_path, monkeypatch):
    monkeypatch.setattr("toolkit.runtime.zero.offload.PIECE_NUMEL", 1000)  # several pieces a bucket
    base = [*CUDA, "zero.offload_optimizer=cpu", "training.grad_clip=0", f"zero.nvme_path={tmp_path}", *overrides]
    exact = train(1, base)
    engine, _, losses, _ = train(1, [*base, "zero.offload_update=overlapped"])
    assert engine.device.type == "cuda" and engine.strategy.parts[-1].overlapped is not None
    assert losses == exact[2]
    want = on_cpu(exact[0].strategy.full_parameters())
    assert all(torch.equal(got, want[name]) for name, got in on_cpu(engine.strategy.full_parameters()).items())


@pytest.mark.parametrize("overrides", [["zero.stage=2", SMALL_BUCKETS], ["zero.stage=3", "precision.dtype=bf16"]],
                         ids=["stage2", "stage3 bf16"])
def test_the_overlapped_update_speculating_on_the_clip_is_exact_offload_bit_for_bit(overrides, monkeypatch):
    """training.grad_clip 0.9 (the tiny run's norms are 0.84-1.0: some steps clip): the pieces step before the
    coefficient, the device clips the chunks between the thread's copies (CUDA streams), the clipped steps redo."""
    monkeypatch.setattr("toolkit.runtime.zero.offload.PIECE_NUMEL", 1000)
    base = [*CUDA, "zero.offload_optimizer=cpu", "training.grad_clip=0.9", *overrides]
    exact = train(1, base)
    engine, _, losses, _ = train(1, [*base, "zero.offload_update=overlapped"])
    speculation = engine.strategy.parts[-1].overlapped.speculation
    assert engine.device.type == "cuda" and speculation is not None and len(speculation.outcomes) == len(losses)
    assert losses == exact[2]
    want = on_cpu(exact[0].strategy.full_parameters())
    assert all(torch.equal(got, want[name]) for name, got in on_cpu(engine.strategy.full_parameters()).items())
