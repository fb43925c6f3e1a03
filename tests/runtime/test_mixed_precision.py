"""Precision and memory-saving paths through the engine on the CPU: activation
checkpointing changes nothing but memory, bf16 autocast trains, and the fp16 loss
scaler, attached to the engine, skips overflowing steps the way DeepSpeed does."""
import copy
import dataclasses
import math

import pytest
import torch

from tests.oracles import deepspeed
from toolkit.data.batches import BatchStream, Dataset
from toolkit.runtime.engine import Engine
from toolkit.runtime.precision import make_loss_scaler
from toolkit.recipe.load import load_recipe
from toolkit.specs import PrecisionSpec

TINY = ["training.max_steps=6", "data.num_samples=256", "scheduler.type=constant"]


def tiny(*overrides):
    return load_recipe("quickstart", [*TINY, *overrides])


def stream_for(recipe):
    return BatchStream(Dataset(recipe.data).train, recipe.batch, rank=0, seed=recipe.training.seed)


def params_of(engine):
    return [p.detach().clone() for p in engine.model.parameters()]


def optimizer_state_of(engine) -> dict:
    """{(param index, name): value} of AdamW's per-parameter state (moments, step), copied."""
    state = copy.deepcopy(engine.optimizer.state_dict()["state"])
    return {(index, name): value for index, entry in state.items() for name, value in entry.items()}


def assert_same_optimizer_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]) if torch.is_tensor(a[key]) else a[key] == b[key], key


# ---------------------------------------------------------------------------
# Activation checkpointing

def saved_activation_elements(engine, batch) -> int:
    """Elements autograd saves for backward during one forward (weights included)."""
    count = 0

    def pack(tensor):
        nonlocal count
        count += tensor.numel()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        engine(batch)
    return count


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_activation_checkpointing_gives_the_same_losses_and_params(family):
    results, saved = [], []
    for checkpointing in (False, True):
        recipe = tiny(f"model.family={family}", f"model.activation_checkpointing={str(checkpointing).lower()}")
        assert recipe.model.dropout == 0.0
        engine = Engine(recipe)
        saved.append(saved_activation_elements(engine, Dataset(recipe.data).train[:8]))
        stream = stream_for(recipe)
        losses = [engine.train_batch(stream.next_step()).loss for _ in range(4)]
        results.append((losses, params_of(engine)))
    # checkpointing is really on: the blocks' activations are not kept (about 5x fewer saved here)
    assert saved[1] < 0.5 * saved[0]
    (losses_off, params_off), (losses_on, params_on) = results
    # NOTE: non-reentrant checkpointing replays the same ops on the same inputs (dropout 0),
    # so in fp32 on one CPU the results are bitwise equal; the stated tolerance is exact.
    assert losses_on == losses_off
    for a, b in zip(params_on, params_off):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------------------
# bf16 on the CPU

def test_bf16_autocast_trains_on_the_cpu():
    recipe = tiny("precision.dtype=bf16")
    engine = Engine(recipe)
    head_dtypes = []
    engine.model.lm_head.register_forward_hook(lambda _m, _i, out: head_dtypes.append(out.dtype))
    stream = stream_for(recipe)
    losses = [engine.train_batch(stream.next_step()).loss for _ in range(8)]
    assert head_dtypes and set(head_dtypes) == {torch.bfloat16}  # matmuls run in bf16
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())  # weights stay fp32
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0] - 0.2  # ln(256) = 5.55 at start; it learns
    assert engine.loss_scaler is None and engine.skipped_steps == 0  # bf16 needs no loss scale


# ---------------------------------------------------------------------------
# The loss scaler in the engine

# Step by step: which steps get an inf/NaN gradient injected.
OVERFLOWS = [False, True, False, False, False, True, True, True, False, False, False, False]


def test_engine_skips_overflowing_steps_like_deepspeed():
    # fp16 is refused on the CPU (precision.check_precision_device), so run fp32 with the fp16 block's scaler attached.
    # (The recipe refuses an fp16 block under fp32, so the fp16 PrecisionSpec is built here.)
    recipe = tiny("scheduler.type=WarmupLR", "scheduler.warmup_num_steps=5", "training.max_steps=20")
    engine = Engine(recipe)
    settings = dataclasses.replace(recipe.precision.fp16, initial_scale_power=10, loss_scale_window=3, hysteresis=2)
    engine.loss_scaler = make_loss_scaler(PrecisionSpec(dtype="fp16", fp16=settings))
    reference = deepspeed.DynamicLossScaler(2.0 ** 10, 3, settings.min_loss_scale, 2, False)
    inject = {"value": None}
    probe = engine.model.transformer.h[0].mlp.c_fc.weight
    probe.register_hook(lambda grad: None if inject["value"] is None else torch.full_like(grad, inject["value"]))

    stream = stream_for(recipe)
    clean_batches = []
    for step, overflow in enumerate(OVERFLOWS):
        batches = stream.next_step()
        inject["value"] = (math.inf if step % 2 else math.nan) if overflow else None
        before_params = params_of(engine)
        before_optim = optimizer_state_of(engine)
        before_schedule = engine.scheduler.state_dict()
        used_scale = reference.cur_scale

        result = engine.train_batch(batches)
        reference.update_scale(overflow)

        assert result.skipped is overflow
        assert result.loss_scale == used_scale  # the scale this step's backward used
        assert engine.loss_scaler.scale == reference.cur_scale  # and DeepSpeed's next one
        assert engine.loss_scaler.cur_hysteresis == reference.cur_hysteresis
        if overflow:
            for a, b in zip(params_of(engine), before_params):
                assert torch.equal(a, b)
            assert_same_optimizer_state(optimizer_state_of(engine), before_optim)
            assert engine.scheduler.state_dict() == before_schedule
            assert math.isnan(result.grad_norm)
        else:
            clean_batches.append(batches)
    assert engine.skipped_steps == sum(OVERFLOWS) and engine.global_step == len(OVERFLOWS)
    assert engine.scheduler.last_batch_iteration == len(clean_batches) - 1
    # 1024, a hysteresis credit spent at step 1, halved three times by steps 5-7, doubled after 3 clean
    assert engine.loss_scaler.scale == 256.0

    # The applied steps are exactly a scaler-free run over the clean batches: power-of-two
    # scaling and unscaling is exact in fp32, and the schedule advanced once per applied step.
    plain = Engine(recipe)
    for batches in clean_batches:
        plain.train_batch(batches)
    for a, b in zip(params_of(engine), params_of(plain)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert plain.current_lr == engine.current_lr


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 runs on a CUDA device")
def test_fp16_on_a_cpu_is_refused_before_the_run_writes_anything(tmp_path, monkeypatch, capsys):
    from toolkit.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["run", "quickstart", "precision.dtype=fp16", "training.max_steps=2",
                 "scheduler.warmup_num_steps=1"]) == 2
    assert capsys.readouterr().err.strip() == ("error: recipe.precision.dtype: 'fp16' needs a CUDA device and torch "
                                               "sees none ('auto' chose the CPU); CPUs lack fast fp16: use 'bf16'")
    assert list(tmp_path.iterdir()) == []  # no runs/<name>-<time>/ holding only recipe.json


def test_validate_refuses_fp16_on_training_device_cpu_and_warns_on_auto_without_a_gpu(capsys):
    from toolkit.cli.main import main
    from toolkit.recipe.checks import fp16_device_warning

    assert main(["validate", "quickstart", "precision.dtype=fp16", "training.device=cpu"]) == 2
    assert capsys.readouterr().err.strip() == ("error: recipe.precision.dtype: 'fp16' needs a CUDA device but "
                                               "training.device is 'cpu'; use 'bf16' (or 'fp32') on a CPU")
    assert main(["validate", "quickstart", "precision.dtype=fp16"]) == 0
    err = capsys.readouterr().err.strip()
    if fp16_device_warning("fp16", "auto") is None:
        assert err == ""  # an NVIDIA driver is here: the run decides
    else:
        assert err.startswith("warning: recipe.precision.dtype: 'fp16' needs a CUDA device") and "\n" not in err
    assert main(["validate", "quickstart", "precision.dtype=bf16"]) == 0 and capsys.readouterr().err == ""
