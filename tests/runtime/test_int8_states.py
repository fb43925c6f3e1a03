"""optimizer.state_dtype int8 (toolkit/runtime/int8_moments.py, int8_adamw.py, zero/adamw.py): the blockwise
quantization's error bound and its fixed point, one step against the formula, stages 1-3 against stage 0 in one
process, the checkpoint round trip and resume, the bytes against the estimate, and the combinations refused.
Two and four gloo ranks: tests/runtime/test_int8_states_dist.py."""
import pytest
import torch

from tests.runtime.zero_helpers import (SMALL_BUCKETS, assert_offload_param_changes_nothing,
                                        assert_stages_1_to_3_track_stage_0, assert_swap_files_change_nothing,
                                        save_and_resume, tiny_engine, train)
from toolkit.runtime.int8_adamw import Int8AdamW
from toolkit.runtime.int8_moments import (BLOCK, SIGNED_MAP, UNSIGNED_MAP, dequantize_blockwise,
                                          quantize_blockwise)

INT8 = ["optimizer.state_dtype=int8"]
# Half the widest gap between neighbouring codes: the most a value moves when quantized, in units of its block's
# absmax (the gap between the two largest signed codes, 0.9789 and 1.0).
HALF_GAP = {"signed": float((SIGNED_MAP[1:] - SIGNED_MAP[:-1]).max()) / 2,
            "unsigned": float((UNSIGNED_MAP[1:] - UNSIGNED_MAP[:-1]).max()) / 2}


@pytest.mark.parametrize("kind, code_map", [("signed", SIGNED_MAP), ("unsigned", UNSIGNED_MAP)])
def test_a_round_trip_moves_each_value_at_most_half_a_code_gap_of_its_block_absmax_and_is_a_fixed_point(kind, code_map):
    """1000 values over four decades (a partial last block): |dequantize(quantize(x)) - x| <= HALF_GAP x absmax; the
    block's largest magnitude comes back exactly; quantizing the dequantized values again gives the same codes."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 0, 1000)
    x = x if kind == "signed" else x * x
    codes, absmax = quantize_blockwise(x, code_map)
    assert codes.dtype == torch.uint8 and absmax.shape == (-(-1000 // BLOCK),)
    y = dequantize_blockwise(codes, absmax, code_map)
    per_element = absmax.repeat_interleave(BLOCK)[:1000]
    assert bool(((y - x).abs() <= HALF_GAP[kind] * per_element * (1 + 1e-6)).all())
    assert HALF_GAP[kind] < 0.011  # under 1.1% of the block's absmax
    assert torch.equal(y.view(-1)[:768].view(3, BLOCK).abs().amax(1), x[:768].view(3, BLOCK).abs().amax(1))
    again, again_absmax = quantize_blockwise(y, code_map)
    assert torch.equal(again, codes) and torch.equal(again_absmax, absmax)
    # the dynamic map keeps small values to a relative precision: at 1e-3 of the absmax and above, within 16% (the
    # signed map's widest relative gap there is 30.5%; a linear 8-bit map's step would be 400% of such a value)
    small = (x.abs() >= 1e-3 * per_element) & (x.abs() < 1e-2 * per_element)
    assert int(small.sum()) > 20
    assert bool(((y - x).abs()[small] <= 0.16 * x.abs()[small]).all())


def _reference_adamw(params, grads_per_step, lr, betas, eps, wd):
    """AdamW from its formula over the parameters end to end, the moments quantized after each step."""
    beta1, beta2 = betas
    p = torch.cat([q.detach().reshape(-1) for q in params]).double()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, grads in enumerate(grads_per_step, start=1):
        g = torch.cat([x.reshape(-1) for x in grads]).double()
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p * (1 - lr * wd) - lr / (1 - beta1 ** t) * m / ((v / (1 - beta2 ** t)).sqrt() + eps)
        m = dequantize_blockwise(*quantize_blockwise(m.float(), SIGNED_MAP), SIGNED_MAP).double()
        v = dequantize_blockwise(*quantize_blockwise(v.float(), UNSIGNED_MAP), UNSIGNED_MAP).double()
    return p.float(), m.float(), v.float()


def test_three_steps_equal_adamw_from_its_formula_with_the_moments_quantized_after_each():
    """Three tensors (300, 7 x 40 and 5 elements: blocks span them), three steps: the weights equal the formula's
    within 1e-6 relative (fp32 against float64 maths) and the stored moments dequantize to the formula's."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in ((300,), (7, 40), (5,))]
    grads_per_step = [[torch.randn_like(p) * 10.0 ** -k for k, p in enumerate(params)] for _ in range(3)]
    settings = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    want_p, want_m, want_v = _reference_adamw(params, grads_per_step, settings["lr"], settings["betas"],
                                              settings["eps"], settings["weight_decay"])
    optimizer = Int8AdamW(params, **settings)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()
    got = torch.cat([p.detach().reshape(-1) for p in params])
    torch.testing.assert_close(got, want_p, rtol=1e-6, atol=1e-6)
    m, v = optimizer.moments.read(0, optimizer.moments.numel)
    absmax_m = optimizer.moments.exp_avg_absmax.repeat_interleave(BLOCK)[:m.numel()]
    absmax_v = optimizer.moments.exp_avg_sq_absmax.repeat_interleave(BLOCK)[:v.numel()]
    # one code step at most: a last-bit difference of the fp32 moment can cross a midpoint between two codes
    assert bool(((m - want_m).abs() <= 2 * HALF_GAP["signed"] * absmax_m + 1e-12).all())
    assert bool(((v - want_v).abs() <= 2 * HALF_GAP["unsigned"] * absmax_v + 1e-12).all())
    assert float((m - want_m).abs().max()) < 1e-6 * float(want_m.abs().max())  # and in fact no code moved


def test_the_factory_builds_int8_adamw_and_the_start_up_line_says_so():
    from toolkit.runtime.precision import describe_precision

    from toolkit.observe.estimate import format_bytes

    recipe, engine, stream = tiny_engine(1, ["zero.stage=0", *INT8])
    n = engine.num_parameters  # the tiers row counts the codes and scales before the first step: they exist
    assert f"optimizer states device ({format_bytes(2 * n + 8 * -(-n // 256))})" in engine.strategy.describe_tiers()
    engine.train_batch(stream.next_step())
    assert isinstance(engine.strategy.optimizer, Int8AdamW)
    state = engine.strategy.optimizer.state
    assert all(state[p]["exp_avg"].dtype == state[p]["exp_avg_sq"].dtype == torch.uint8
               for p in engine.model.parameters())
    assert "int8 blockwise moments" in describe_precision(recipe.precision, 0, "int8")
    _, sharded, _ = tiny_engine(1, ["zero.stage=2", *INT8])
    assert "int8 blockwise moments" in sharded.strategy.describe()


def test_zero_1_to_3_with_int8_moments_match_stage_0_within_quantization_noise():
    """10 steps in one process: losses within 1e-4 relative of stage 0's (measured: 3.2e-5 at most, stage 3). Not
    bit for bit: stage 0's blocks run over the parameters in optimizer order, the shard's over its buckets, so a
    block's absmax (and every code in it) differs. The control: a 10% larger lr moves the losses by 2e-3."""
    assert_stages_1_to_3_track_stage_0(INT8, torch.uint8, rel=1e-4)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_checkpoint_round_trips_int8_moments_and_resumes_bit_exactly(stage, tmp_path):
    """Saved after step 5 (the moments as dequantized fp32), restored into a fresh engine at the same stage: every
    weight and moment equal, the codes and scales re-quantized bit for bit, the next five losses equal."""
    overrides = [f"zero.stage={stage}", SMALL_BUCKETS, *INT8]
    saved, restored, uninterrupted, resumed, engine = save_and_resume(tmp_path / "run", overrides, overrides)
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[key], saved[key]) for key in saved)
    assert len(resumed) == 5 and resumed == uninterrupted


def test_a_stage_0_checkpoint_resumes_at_stage_2_within_one_code_step(tmp_path):
    """Another layout (stage 0's blocks over the parameters, stage 2's over the buckets): the weights come back
    exactly; each moment within half a code gap of the absmax of the block it lands in (a block may span parameters,
    so the bound is the moment's largest value over the model), and the next five losses within 1e-4 relative."""
    saved, restored, uninterrupted, resumed, engine = save_and_resume(
        tmp_path / "run", ["zero.stage=0", SMALL_BUCKETS, *INT8], ["zero.stage=2", SMALL_BUCKETS, *INT8])
    assert restored.keys() == saved.keys()
    for kind in ("exp_avg", "exp_avg_sq"):
        largest = max(float(value.abs().max()) for (_, k), value in saved.items() if k == kind)
        for (name, k), value in saved.items():
            if k == kind:
                assert float((restored[name, k] - value).abs().max()) <= max(HALF_GAP.values()) * largest, name
    assert all(torch.equal(restored[key], value) for key, value in saved.items() if key[1] == "param")
    assert any(not torch.equal(restored[key], value) for key, value in saved.items() if key[1] == "exp_avg")
    assert resumed == pytest.approx(uninterrupted, rel=1e-4)


def _held(overrides):
    """(parameters, the strategy's memory_bytes) after one step."""
    _, engine, stream = tiny_engine(1, overrides)
    engine.train_batch(stream.next_step())
    return engine.num_parameters, engine.strategy.memory_bytes()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_optimizer_bytes_the_engine_holds_equal_the_estimate(stage, precision):
    """2 bytes of codes per element plus an fp32 absmax per 256, for each of the optimizer's elements (ceil: the last
    block is partial); the master as under fp32 states: toolkit estimate and the tiers row count the same bytes."""
    from toolkit.observe.estimate import estimate_model_state_bytes
    from toolkit.observe.tiers import estimate_tiers

    n, live = _held([f"zero.stage={stage}", f"precision.dtype={precision}", *INT8])
    moments = live["mem_optim_bytes"]
    want = estimate_model_state_bytes(n, stage=stage, world_size=1, dtype=precision, state_dtype="int8")
    assert moments == 2 * n + 8 * -(-n // 256)
    master = live["mem_master_bytes"]
    assert master == (4 * n if stage > 0 and precision == "bf16" else 0)
    assert (live["mem_params_bytes"], live["mem_grads_bytes"], moments + master) == (want.params, want.grads,
                                                                                      want.optim)
    tiers = estimate_tiers(n, stage=stage, world_size=1, dtype=precision, state_dtype="int8")
    assert tiers.gpu == want.params + want.grads + want.optim
    fp32 = estimate_model_state_bytes(n, stage=stage, world_size=1, dtype=precision)
    assert fp32.optim - want.optim == 8 * n - moments  # the moments shrink from 8 bytes to 2.03, the rest stays


@pytest.mark.parametrize("overrides, what", [
    (["optimizer.type=muon"], "not 'muon'"),
    (["optimizer.type=onebit_adam"], "not 'onebit_adam'"),
    (["parallel.tensor=2"], "parallel.tensor/pipeline > 1")])
def test_int8_moments_with_an_unbuilt_combination_are_refused_in_one_line(overrides, what):
    from toolkit.recipe.load import RecipeError, load_recipe

    with pytest.raises(RecipeError) as caught:
        load_recipe("quickstart", [*INT8, "precision.dtype=bf16", *overrides], world_size=2)
    assert len(caught.value.lines) == 1
    assert caught.value.lines[0].startswith("recipe.optimizer.state_dtype: 'int8'") and what in caught.value.lines[0]


def test_the_cli_refuses_int8_moments_with_1_bit_adam_with_exit_code_2(capsys, monkeypatch):
    from toolkit.cli.main import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main(["validate", "quickstart", *INT8, "optimizer.type=onebit_adam"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: recipe.optimizer.state_dtype: 'int8'"), err


# ---------------------------------------------------------------------------
# Offloaded to CPU memory: an fp32 master and the 8-bit moments there, stepped a piece at a time


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_int8_moments_step_as_on_the_device_bit_for_bit(stage, monkeypatch):
    """zero.offload_optimizer cpu: the offloaded step's pieces (cut small here, so blocks straddle pieces) open each
    block once a step and quantize it back once, as the device's windows do: the same losses, weights and codes."""
    monkeypatch.setattr("toolkit.runtime.zero.offload.PIECE_NUMEL", 1000)  # not a multiple of the 256-element block
    device, _, device_losses, _ = train(1, [f"zero.stage={stage}", SMALL_BUCKETS, *INT8])
    offloaded, _, losses, _ = train(1, [f"zero.stage={stage}", SMALL_BUCKETS, *INT8, "zero.offload_optimizer=cpu"])
    assert offloaded.strategy.parts[-1].offloaded and offloaded.strategy.parts[-1].optimizer.exp_avg.dtype == torch.uint8
    assert losses == device_losses
    for got, want in zip(offloaded.strategy.parts[-1].moment_tensors(), device.strategy.parts[-1].moment_tensors()):
        assert torch.equal(got, want)


def test_offloaded_int8_moments_hold_what_the_estimate_says_and_resume_bit_exactly(tmp_path):
    from toolkit.observe.estimate import estimate_model_state_bytes

    overrides = ["zero.stage=2", SMALL_BUCKETS, *INT8, "zero.offload_optimizer=cpu"]
    n, live = _held(overrides)
    want = estimate_model_state_bytes(n, stage=2, world_size=1, dtype="fp32", offload="cpu", state_dtype="int8")
    assert live["mem_offload_bytes"] == want.cpu_optim == 4 * n + 2 * n + 8 * -(-n // 256)
    assert live["mem_optim_bytes"] == want.optim == 0
    saved, restored, uninterrupted, resumed, _ = save_and_resume(tmp_path / "run", overrides, overrides)
    assert all(torch.equal(restored[key], saved[key]) for key in saved)
    assert len(resumed) == 5 and resumed == uninterrupted


def test_offloaded_int8_moments_take_the_delayed_update_too():
    """With a warm-up as long as the run the delayed mode is the exact one; after it, the update lands a step late."""
    base = ["zero.stage=2", SMALL_BUCKETS, *INT8, "zero.offload_optimizer=cpu", "zero.offload_update=delayed"]
    exact = train(1, base[:-1])[2]
    assert train(1, [*base, "zero.offload_update_warmup=10"])[2] == exact
    delayed = train(1, [*base, "zero.offload_update_warmup=3"])[2]
    assert delayed[:4] == exact[:4] and delayed[4:] != exact[4:]


@pytest.mark.parametrize("precision, optimizer", [("bf16", "none"), ("bf16", "cpu"), ("fp32", "cpu")])
def test_int8_moments_with_the_parameters_offloaded_train_as_with_them_on_the_device(precision, optimizer, tmp_path,
                                                                                      monkeypatch):
    """zero.offload_param cpu and nvme with int8 moments on the device or in CPU memory: the same losses and weights
    bit for bit as offload_param none. Under fp32 with both in CPU memory the host's fp32 weights are the master (an
    fp32 master is what int8 moments keep): 4 + 2.03 bytes an element there in all."""
    monkeypatch.setattr("toolkit.runtime.zero.offload.PIECE_NUMEL", 1000)
    engines = assert_offload_param_changes_nothing([*INT8, f"precision.dtype={precision}",
                                                    f"zero.offload_optimizer={optimizer}"], tmp_path)
    strategy = engines["cpu"].strategy
    part = strategy.parts[-1]
    assert part.weights_are_master == (precision == "fp32" and optimizer == "cpu")
    if part.weights_are_master:
        n = strategy.layout.numel
        assert strategy.memory_bytes()["mem_offload_bytes"] == 4 * n + 2 * n + 8 * -(-n // 256)



# ---------------------------------------------------------------------------
# In swap files (ZeRO-Infinity): the fp32 master in one file, the codes and block scales in another


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_int8_moments_in_swap_files_step_as_in_cpu_memory_bit_for_bit(stage, tmp_path, monkeypatch):
    """zero.offload_optimizer nvme: the offloaded step's open blocks are read from the moments' file once a step and
    written back once, quantized as in memory: the same losses and weights; the files hold 4 + 2 + 8/256 bytes an
    element, as the estimate, the tiers row and the pre-flight's disk check count."""
    monkeypatch.setattr("toolkit.runtime.zero.offload.PIECE_NUMEL", 1000)  # blocks straddle pieces
    _, engine, tiers = assert_swap_files_change_nothing([f"zero.stage={stage}", SMALL_BUCKETS, *INT8], tmp_path)
    part = engine.strategy.parts[-1]
    n = part.layout.numel
    assert part.swap_bytes == 4 * n + 2 * n + 8 * -(-n // 256) == sum(f.path.stat().st_size for f in part.swap_files)
    assert tiers.nvme == part.swap_bytes
    assert engine.strategy.memory_bytes()["mem_offload_bytes"] == 0  # no moments in memory between steps


def test_int8_moments_in_swap_files_resume_bit_exactly_also_with_the_delayed_update(tmp_path):
    for name, extra in {"exact": [], "delayed": ["zero.offload_update=delayed", "zero.offload_update_warmup=2"]}.items():
        overrides = ["zero.stage=2", SMALL_BUCKETS, *INT8, "zero.offload_optimizer=nvme",
                     f"zero.nvme_path={tmp_path}", *extra]
        saved, restored, uninterrupted, resumed, _ = save_and_resume(tmp_path / name, overrides, overrides)
        assert all(torch.equal(restored[key], saved[key]) for key in saved), name
        assert resumed == uninterrupted, name
