"""zero.grad_dtype bf16: the reduced gradient shard in bf16 (stages 1-3, under bf16 states). The reduce's bf16 result
lands unchanged, so with no clipping and no accumulation the run equals the fp32 shard's bit for bit; clipping and
accumulation round to bf16, within a stated tolerance; the bytes are the estimate's; the combinations refused."""
import pytest
import torch

from tests.runtime.zero_helpers import SMALL_BUCKETS, save_and_resume, tiny_engine, train

BF16 = ["precision.dtype=bf16", "optimizer.state_dtype=bf16"]
GRAD = ["zero.grad_dtype=bf16"]


@pytest.mark.parametrize("overrides", [
    ["zero.stage=1"], ["zero.stage=2", "zero.offload_optimizer=cpu"],
    ["zero.stage=3", "zero.offload_optimizer=nvme"],
    ["zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_ratio=0.6", "zero.offload_param=cpu"]],
    ids=["stage1", "stage2-cpu", "stage3-nvme", "stage3-infinity"])
def test_without_clipping_or_accumulation_a_bf16_shard_trains_as_the_fp32_one_bit_for_bit(overrides, tmp_path):
    base = ["training.grad_clip=0", SMALL_BUCKETS, *BF16, *overrides, f"zero.nvme_path={tmp_path}"]
    fp32 = train(1, base)
    engine, _, losses, _ = train(1, [*base, *GRAD])
    assert all(chunk.dtype == torch.bfloat16 for chunk in engine.strategy.grad_chunks)
    assert losses == fp32[2]
    want = fp32[0].strategy.full_parameters()
    assert all(torch.equal(got, want[name]) for name, got in engine.strategy.full_parameters().items())


@pytest.mark.parametrize("stage", [2, 3])
def test_with_clipping_and_accumulation_a_bf16_shard_tracks_the_fp32_one(stage):
    """Clipping (training.grad_clip 0.5 is active here) and 2 micro-steps round the shard to bf16: losses within 1e-4
    relative of the fp32 shard's over 10 steps (measured: 2.6e-5 with clipping alone). The control: a 10% larger lr
    moves them by more than that."""
    base = [f"zero.stage={stage}", SMALL_BUCKETS, *BF16, "batch.grad_accum_steps=2", "zero.offload_optimizer=cpu"]
    fp32 = train(1, base)[2]
    assert train(1, [*base, *GRAD])[2] == pytest.approx(fp32, rel=1e-4)
    assert train(1, [*base, "optimizer.lr=0.0033"])[2] != pytest.approx(fp32, rel=1e-4)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_gradient_bytes_held_equal_the_estimate(stage):
    """Stage 2-3: 2 bytes an element of the shard, half of fp32's; stage 1: the full bf16 gradient buffer's own chunk
    is the shard (no second buffer); the tiers row says bf16."""
    from toolkit.observe.estimate_input import EstimateInput
    from toolkit.observe.tiers import input_tiers

    recipe, engine, _ = tiny_engine(1, [f"zero.stage={stage}", *BF16, *GRAD])
    fp32 = tiny_engine(1, [f"zero.stage={stage}", *BF16])[1]
    held = engine.strategy.memory_bytes()["mem_grads_bytes"]
    inp = EstimateInput.from_recipe(recipe)
    assert held == inp.model_states(num_params=engine.num_parameters).grads
    mem = engine.strategy.memory_bytes()
    assert input_tiers(inp, num_params=engine.num_parameters).gpu == (mem["mem_params_bytes"] + held
                                                                      + mem["mem_optim_bytes"] + mem["mem_master_bytes"])
    shard = engine.strategy.layout.numel
    assert fp32.strategy.memory_bytes()["mem_grads_bytes"] - held == (4 if stage == 1 else 2) * shard
    assert "bf16 grads device" in engine.strategy.describe_tiers()


def test_a_bf16_shard_resumes_bit_exactly_and_takes_the_delayed_update(tmp_path):
    overrides = ["zero.stage=2", SMALL_BUCKETS, *BF16, *GRAD, "zero.offload_optimizer=cpu",
                 "zero.offload_update=delayed", "zero.offload_update_warmup=2"]
    saved, restored, uninterrupted, resumed, _ = save_and_resume(tmp_path / "run", overrides, overrides)
    assert all(torch.equal(restored[key], saved[key]) for key in saved)
    assert resumed == uninterrupted


@pytest.mark.parametrize("overrides, what", [
    (["zero.stage=0", *BF16], "needs zero.stage 1-3"),
    (["zero.stage=2", "precision.dtype=bf16"], "needs optimizer.state_dtype 'bf16' (it is 'fp32')")])
def test_a_bf16_shard_where_it_is_not_built_is_refused_in_one_line(overrides, what):
    from toolkit.recipe.load import RecipeError, load_recipe

    with pytest.raises(RecipeError) as caught:
        load_recipe("quickstart", [*overrides, *GRAD])
    assert len(caught.value.lines) == 1
    assert caught.value.lines[0].startswith("recipe.zero.grad_dtype: 'bf16' needs") and what in caught.value.lines[0]


def test_a_bf16_shard_clipped_after_its_early_copies_is_copied_again(monkeypatch):
    """The device's clip rounds a bf16 shard's products to bf16, which the thread's fp32 multiply of its copy would
    not: a delayed update copies such a shard again after a clip (an fp32 shard's copy takes the multiply instead,
    tests/runtime/test_delayed_offload.py)."""
    from toolkit.runtime.zero.delayed_update import DelayedUpdate

    seen = []  # at each launch's stage: the multiplies the thread would repeat (None: copy again)
    stage = DelayedUpdate.stage
    monkeypatch.setattr(DelayedUpdate, "stage", lambda self: seen.append(self.scales) or stage(self))
    engine, _, _, norms = train(1, ["zero.stage=2", SMALL_BUCKETS, *BF16, *GRAD, "zero.offload_optimizer=cpu",
                                    "zero.offload_update=delayed", "zero.offload_update_warmup=2"])
    assert not engine.strategy.parts[-1].delayed.scale_on_host
    assert seen and all(norm > 0.5 for norm in norms[2:])  # the recipe's clip 0.5 clips each delayed step
    assert all(scales is None for scales in seen) and engine.strategy.parts[-1].delayed.cpu_step.grad_scales == ()
