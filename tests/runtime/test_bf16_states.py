"""optimizer.state_dtype bf16 (toolkit/runtime/low_precision_adamw.py): the stochastic rounding against its definition,
the bf16-state AdamW against torch's fp32 AdamW, the checkpoint round trip and resume, the bytes against the
estimate, and the combinations refused."""
import pytest
import torch

from tests.runtime.zero_helpers import (SMALL_BUCKETS, assert_offload_param_changes_nothing,
                                        assert_stages_1_to_3_track_stage_0, assert_swap_files_change_nothing,
                                        save_and_resume, tiny_engine, train)
from toolkit.observe.step_memory_timeline import _LiveBytes
from toolkit.runtime import low_precision_adamw
from toolkit.runtime.low_precision_adamw import (BF16AdamW, adam_reference_update_, bf16_adam_update_,
                                                 stochastic_round_to_bf16)

BF16 = ["precision.dtype=bf16", "optimizer.state_dtype=bf16"]
BF16_STATES = ["zero.stage=0", *BF16]


def _neighbours(x):
    """The bf16 values just below and above each element of fp32 `x` (by magnitude: truncation and one ulp up)."""
    low = (x.view(torch.int32) & -65536).view(torch.float32)
    high = ((x.view(torch.int32) & -65536) + 65536).view(torch.float32)
    return low, high


def test_stochastic_rounding_is_unbiased_lands_on_a_neighbour_and_is_seeded():
    """4096 rounded copies of 256 values: each lands on one of the two bf16 neighbours, and their mean is within
    1/16 of the gap of the value (the mean's standard deviation is at most gap/128 at 4096 copies: 8 sigma)."""
    x = torch.randn(256, generator=torch.Generator().manual_seed(0)) * 10
    low, high = _neighbours(x)
    copies = 4096
    generator = torch.Generator().manual_seed(7)
    rounded = stochastic_round_to_bf16(x.repeat(copies, 1), generator).float()
    assert bool(((rounded == low) | (rounded == high)).all())
    gap = (high - low).abs()
    assert bool(((rounded.mean(0) - x).abs() <= gap / 16).all())
    # round to nearest is biased for the same values (the test can fail: a rounding that ignores the noise fails it)
    assert not bool(((x.to(torch.bfloat16).float() - x).abs() <= gap / 16).all())
    again = stochastic_round_to_bf16(x.repeat(copies, 1), torch.Generator().manual_seed(7)).float()
    assert torch.equal(rounded, again)
    other = stochastic_round_to_bf16(x.repeat(copies, 1), torch.Generator().manual_seed(8)).float()
    assert not torch.equal(rounded, other)


def _bf16_step_peak(n: int, seed: int = 3) -> tuple[int, torch.Tensor, torch.Tensor]:
    """One bf16 step on `n` elements: the bytes of the temporaries it held at once, its weights, and the fp32 weights
    of the same step unrounded."""
    gen = torch.Generator().manual_seed(seed)
    p, g, m = (torch.randn(n, generator=gen) for _ in range(3))
    v = torch.rand(n, generator=gen)
    p, m, v = (t.to(torch.bfloat16) for t in (p, m, v))
    settings = dict(step=3, lr=1e-2, wd=0.1, betas=(0.9, 0.95), eps=1e-8, l2=False)
    exact = p.float()
    adam_reference_update_(exact, g.clone(), m.float(), v.float(), **settings)
    with _LiveBytes(torch.device("cpu")) as live:
        bf16_adam_update_(p, g, m, v, torch.Generator().manual_seed(5), **settings)
    return max(live.samples), p, exact


def test_the_bf16_step_holds_its_fp32_temporaries_for_one_window_at_a_time(monkeypatch):
    """A shard segment of llama-1b stepped whole held 11.1 GiB of fp32 temporaries on an H100 (the reserved peak in
    benchmarks/RESULTS.md): the step goes STEP_WINDOW elements at a time, and each weight still lands on a bf16
    neighbour of torch's fp32 update."""
    from toolkit.observe.peak import BF16_STEP_WINDOW

    assert BF16_STEP_WINDOW == low_precision_adamw.STEP_WINDOW  # the memory model counts the same window
    n, window = 1 << 16, 1 << 12
    whole, _, _ = _bf16_step_peak(n)
    monkeypatch.setattr(low_precision_adamw, "STEP_WINDOW", window)
    windowed, p, exact = _bf16_step_peak(n)
    assert whole >= 5 * 4 * n  # several fp32 copies of the whole tensor (the test fails if the window is ignored)
    assert windowed <= 8 * 4 * window, (windowed, whole)
    low, high = _neighbours(exact)
    assert bool(((p.float() == low) | (p.float() == high)).all())


def _regression_loss(optimizer_for, dtype, steps=50):
    """fp32 loss after `steps` full-batch steps of a seeded 2-layer MLP (weights in `dtype`) fitting a tanh teacher
    plus noise 0.1 (512 samples: it does not memorise the noise in 50 steps)."""
    torch.manual_seed(0)
    data, teacher = torch.randn(512, 32), torch.randn(32, 1) / 32 ** 0.5
    target = torch.tanh(2 * data @ teacher) + 0.1 * torch.randn(512, 1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(dtype)
    optimizer = optimizer_for(model.parameters())
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(data.to(dtype)).float(), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return torch.nn.functional.mse_loss(model.float()(data), target).item()


def test_bf16_state_adamw_reaches_torch_adamw_loss_within_1_percent_after_50_steps():
    """The same seeded MLP: torch AdamW in fp32 against BF16AdamW with bf16 weights and moments. Tolerance 1%
    (measured: 0.03-0.1% over seeds 1-3): bf16 keeps 8 significant bits, so forward values differ by ~0.4% per
    layer; a wrong update (a dropped bias correction, a lost decay, no step at all) moves the loss by tens of
    percent here (50 steps take it from 0.79 to 0.089)."""
    settings = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    fp32 = _regression_loss(lambda p: torch.optim.AdamW(p, **settings), torch.float32)
    bf16 = _regression_loss(lambda p: BF16AdamW(p, seed=1234, **settings), torch.bfloat16)
    start = _regression_loss(lambda p: torch.optim.AdamW(p, **settings), torch.float32, steps=0)
    assert fp32 < 0.2 * start  # the problem trains, so the comparison means something
    assert bf16 == pytest.approx(fp32, rel=0.01)


def test_the_factory_builds_bf16_adamw_and_the_engine_holds_bf16_weights_and_moments():
    _, engine, stream = tiny_engine(1, BF16_STATES)
    engine.train_batch(stream.next_step())
    assert isinstance(engine.strategy.optimizer, BF16AdamW)
    state = engine.strategy.optimizer.state
    assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters())
    assert all(state[p]["exp_avg"].dtype == state[p]["exp_avg_sq"].dtype == torch.bfloat16
               for p in engine.model.parameters())


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_checkpoint_round_trips_bf16_states_exactly_and_resumes_bit_exactly(stage, tmp_path):
    """Saved after step 5, restored into a fresh engine: every bf16 weight and moment equal, the next losses equal
    bit for bit (the rounding's bits are seeded by training.seed and the step, not by a stream the restore misses)."""
    overrides = [f"zero.stage={stage}", SMALL_BUCKETS, *BF16]
    saved, restored, uninterrupted, resumed, _ = save_and_resume(tmp_path / "run", overrides, overrides)
    assert restored.keys() == saved.keys()
    assert all(restored[key].dtype == torch.bfloat16 and torch.equal(restored[key], saved[key]) for key in saved)
    assert len(resumed) == 5 and resumed == uninterrupted


def _held(overrides):
    """(parameters, the strategy's memory_bytes, bytes of the two moments) after one step."""
    _, engine, stream = tiny_engine(1, overrides)
    engine.train_batch(stream.next_step())
    strategy = engine.strategy
    if strategy.stage == 0:
        state = strategy.optimizer.state.values()
        moments = sum(s[k].numel() * s[k].element_size() for s in state for k in ("exp_avg", "exp_avg_sq"))
    else:
        moments = sum(t.numel() * t.element_size() for part in strategy.parts
                      for t in (part.optimizer.exp_avg, part.optimizer.exp_avg_sq))
    return engine.num_parameters, strategy.memory_bytes(), moments


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_optimizer_bytes_the_engine_holds_equal_the_estimate_and_half_of_fp32_states(stage):
    """The bf16 weights are the master (no separate copy), the moments 2 + 2 bytes per element of the shard; stage 0's
    gradients are bf16 too: toolkit estimate and the tiers row count the same bytes."""
    from toolkit.observe.estimate import estimate_model_state_bytes
    from toolkit.observe.tiers import estimate_tiers

    n, live, moments = _held([f"zero.stage={stage}", *BF16])
    want = estimate_model_state_bytes(n, stage=stage, world_size=1, dtype="bf16", state_dtype="bf16")
    assert live["mem_master_bytes"] == 0
    assert (live["mem_params_bytes"], live["mem_grads_bytes"], moments) == (want.params, want.grads, want.optim)
    assert want.optim == 4 * n and want.params == 2 * n
    tiers = estimate_tiers(n, stage=stage, world_size=1, dtype="bf16", state_dtype="bf16")
    assert tiers.gpu == want.params + want.grads + 4 * n
    _, fp32_live, fp32_moments = _held([f"zero.stage={stage}", "precision.dtype=bf16"])
    assert moments * 2 == fp32_moments  # and the fp32 master (stages 1-3) is gone
    assert fp32_live["mem_master_bytes"] == (0 if stage == 0 else 4 * n)


def test_zero_1_to_3_with_bf16_states_match_stage_0_within_rounding_noise():
    """10 steps at stages 1-3 against stage 0, all with bf16 states: losses within 2e-4 relative (measured: 6e-5 at
    most). Not bit for bit: stage 0 draws the rounding bits per parameter, the shards per segment, so a written
    element can land on the other bf16 neighbour (one ulp, 2^-8 relative) on either side. The control: a 10%
    larger lr moves the losses by 2.1e-3, ten times the tolerance. Too small for it to see over 10 steps (measured
    4e-5): weight decay off, and fp32 against bf16 states, so the moments' dtype is asserted."""
    assert_stages_1_to_3_track_stage_0(BF16, torch.bfloat16, rel=2e-4)


@pytest.mark.parametrize("overrides, what", [
    (["optimizer.type=muon"], "not 'muon'"),
    (["optimizer.type=onebit_adam"], "not 'onebit_adam'"),
    (["parallel.tensor=2"], "parallel.tensor/pipeline > 1"),
    (["precision.dtype=fp32"], "needs precision.dtype 'bf16'")])
def test_bf16_states_with_an_unbuilt_combination_are_refused_in_one_line(overrides, what):
    from toolkit.recipe.load import RecipeError, load_recipe

    precision = [] if "precision.dtype=fp32" in overrides else ["precision.dtype=bf16"]
    with pytest.raises(RecipeError) as caught:
        load_recipe("quickstart", ["optimizer.state_dtype=bf16", *precision, *overrides], world_size=2)
    assert len(caught.value.lines) == 1
    assert caught.value.lines[0].startswith("recipe.optimizer.state_dtype: 'bf16'") and what in caught.value.lines[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_bf16_states_match_the_device_ones_within_rounding_noise_and_hold_6_bytes(stage):
    """zero.offload_optimizer cpu with bf16 states: a bf16 master and two bf16 moments in CPU memory, stepped by the
    CPU Adam kernel's bf16 step (kernels/cpu_adam.cpp; its rounding bits are hashed, the device's drawn), so the losses
    agree with the device's bf16 states within the rounding noise of the test above; the bytes are the estimate's."""
    from toolkit.observe.estimate import estimate_model_state_bytes

    device = train(1, [f"zero.stage={stage}", SMALL_BUCKETS, *BF16])[2]
    engine, _, losses, _ = train(1, [f"zero.stage={stage}", SMALL_BUCKETS, *BF16, "zero.offload_optimizer=cpu"])
    part = engine.strategy.parts[-1]
    assert part.offloaded and part.master.dtype == part.optimizer.exp_avg.dtype == torch.bfloat16
    assert losses == pytest.approx(device, rel=2e-4)
    want = estimate_model_state_bytes(engine.num_parameters, stage=stage, world_size=1, dtype="bf16",
                                      offload="cpu", state_dtype="bf16")
    assert engine.strategy.memory_bytes()["mem_offload_bytes"] == want.cpu_optim == 6 * engine.strategy.layout.numel
    assert "bf16 master and moments offloaded" in engine.strategy.describe()


def test_offloaded_bf16_states_resume_bit_exactly_also_with_the_delayed_update(tmp_path):
    for name, extra in {"exact": [], "delayed": ["zero.offload_update=delayed", "zero.offload_update_warmup=2"]}.items():
        overrides = ["zero.stage=2", SMALL_BUCKETS, *BF16, "zero.offload_optimizer=cpu", *extra]
        saved, restored, uninterrupted, resumed, _ = save_and_resume(tmp_path / name, overrides, overrides)
        assert all(torch.equal(restored[key], saved[key]) for key in saved), name
        assert resumed == uninterrupted, name


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_states_in_swap_files_step_as_in_cpu_memory_bit_for_bit_at_6_bytes(stage, tmp_path, monkeypatch):
    """zero.offload_optimizer nvme: the bf16 master and moments in the swap file (6 bytes an element, half of fp32's),
    streamed through the slots in bf16 and stepped by the same kernel step with the same hashed rounding bits as in
    CPU memory: the same losses and weights; the file, the estimate and the tiers row count the same bytes."""
    monkeypatch.setattr("toolkit.runtime.zero.offload.PIECE_NUMEL", 5000)  # several pieces through the slots
    _, engine, tiers = assert_swap_files_change_nothing([f"zero.stage={stage}", SMALL_BUCKETS, *BF16], tmp_path)
    part = engine.strategy.parts[-1]
    assert part.swap is not None and part.swap.path.stat().st_size == 6 * part.layout.numel
    assert tiers.nvme == 6 * part.layout.numel


def test_bf16_states_in_swap_files_resume_bit_exactly(tmp_path):
    overrides = ["zero.stage=2", SMALL_BUCKETS, *BF16, "zero.offload_optimizer=nvme", f"zero.nvme_path={tmp_path}"]
    saved, restored, uninterrupted, resumed, _ = save_and_resume(tmp_path / "run", overrides, overrides)
    assert all(torch.equal(restored[key], saved[key]) for key in saved)
    assert resumed == uninterrupted


@pytest.mark.parametrize("optimizer", ["none", "cpu", "nvme"])
def test_bf16_states_with_the_parameters_offloaded_train_as_with_them_on_the_device(optimizer, tmp_path, monkeypatch):
    """zero.offload_param cpu and nvme (ZeRO-Infinity's parameter tiers) with bf16 states on the device, in CPU memory
    or in swap files: the same losses and weights bit for bit as offload_param none. With both in CPU memory the
    host's bf16 weights are the master: 6 bytes an element there in all (2 weights + 4 moments), not 8."""
    monkeypatch.setattr("toolkit.runtime.zero.offload.PIECE_NUMEL", 5000)
    engines = assert_offload_param_changes_nothing([*BF16, f"zero.offload_optimizer={optimizer}"], tmp_path)
    strategy = engines["cpu"].strategy
    part = strategy.parts[-1]
    assert part.master is None or part.master.dtype == torch.bfloat16  # a device part's separate master too
    if optimizer == "cpu":
        assert part.weights_are_master and part.master.untyped_storage().data_ptr() == strategy.weights.shard.data_ptr()
        assert strategy.memory_bytes()["mem_offload_bytes"] == 6 * strategy.layout.numel
        assert "(master: the params)" in strategy.describe_tiers()


def test_bf16_states_with_the_parameters_in_cpu_memory_resume_bit_exactly(tmp_path):
    """The master is the host's weights: a checkpoint loads into it once, and resume is bit for bit."""
    overrides = ["zero.stage=3", SMALL_BUCKETS, *BF16, "zero.offload_optimizer=cpu", "zero.offload_param=cpu"]
    saved, restored, uninterrupted, resumed, engine = save_and_resume(tmp_path / "run", overrides, overrides)
    assert engine.strategy.parts[-1].weights_are_master
    assert all(torch.equal(restored[key], saved[key]) for key in saved)
    assert resumed == uninterrupted
