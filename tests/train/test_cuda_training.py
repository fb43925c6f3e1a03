"""GPU: GPT-2 124M trains for a few hundred steps in bf16 and in fp16 (dynamic
loss scaling) with the loss falling and never NaN. Figures (tokens/s, peak
memory) go to $TOOLKIT_FIGURES (a JSONL file) when set, for the benchmark notes.
A bf16 step never waits for the GPU (the host runs ahead, as plain PyTorch's does)."""
import json
import math
import os

import pytest
import torch

from toolkit.runtime.engine import Engine
from toolkit.recipe.load import load_recipe
from toolkit.train.loop import run

STEPS = 300


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_gpt2_124m_trains_in_mixed_precision_on_gpu(dtype, tmp_path):
    recipe = load_recipe("gpt2-124m", [
        f"precision.dtype={dtype}", f"training.max_steps={STEPS}", "training.eval_interval=0",
        "training.eval_batches=2", "training.log_interval=10", "batch.micro_batch_per_rank=8",
        "batch.grad_accum_steps=1", "data.num_samples=4096", "scheduler.warmup_num_steps=30",
        "logging.tensorboard=false", "checkpoint.save_final=false", "checkpoint.interval=0",
    ])
    torch.cuda.reset_peak_memory_stats()
    result = run(recipe, run_dir=tmp_path, quiet=True)
    train = result.train_metrics
    losses = [m["loss"] for m in train]
    tokens_per_s = sum(m["tokens_per_s"] for m in train[len(train) // 2:]) / (len(train) - len(train) // 2)
    figures = {"test": "gpt2-124m", "dtype": dtype, "steps": STEPS, "micro_batch": 8, "seq_len": 1024,
               "first_loss": losses[0], "last_loss": losses[-1], "skipped_steps": train[-1]["skipped_steps"],
               "tokens_per_s": round(tokens_per_s), "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
               "device": torch.cuda.get_device_name()}
    print(figures)
    if os.environ.get("TOOLKIT_FIGURES"):
        with open(os.environ["TOOLKIT_FIGURES"], "a") as f:
            f.write(json.dumps(figures) + "\n")
    assert all(math.isfinite(loss) for loss in losses), losses
    # NOTE: a 50257-token Markov chain is learnt slowly (10.9 -> ~10.0 in 300 steps on an
    # H200); the point here is a falling, finite loss in both precisions.
    assert losses[-1] < losses[0] - 0.5, (losses[0], losses[-1])
    assert math.isfinite(result.eval_metrics[-1]["eval_loss"])
    assert train[-1]["skipped_steps"] < STEPS // 10


@pytest.mark.cuda
@pytest.mark.parametrize("kernels", ["on", "off"])
def test_the_engine_never_waits_for_the_gpu_in_a_bf16_step(kernels):
    # The loss, the clipping norm and multiplier, and the divergence check stay on the device;
    # torch raises on any synchronizing call (a .item(), a device-to-host copy) in this mode.
    # NOTE: only the engine's own work is watched: transformers' eager forward syncs once itself
    # (masking_utils.find_packed_sequence_indices); under training.compile it is traced away.
    names = ("adamw", "layernorm", "bias_gelu", "cross_entropy")
    recipe = load_recipe("quickstart", ["training.device=cuda", "precision.dtype=bf16", "training.grad_clip=1.0",
                                        *(f"kernels.{name}={kernels}" for name in names),
                                        f"optimizer.implementation={'fused' if kernels == 'on' else 'torch'}"])
    engine = Engine(recipe)
    tokens = torch.randint(0, recipe.data.vocab_size, (recipe.batch.micro_batch_per_rank, recipe.data.seq_len + 1),
                           device="cuda")
    for _ in range(2):  # kernels loaded, optimizer state and buckets built
        engine.train_batch([tokens])
    results = []
    for _ in range(3):
        loss = engine(tokens)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            engine.backward(loss)
            results.append(engine.step())
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert all(math.isfinite(r.loss) and 0 < r.grad_norm < math.inf for r in results)
    assert results[-1].loss < results[0].loss  # the same batch, learnt
