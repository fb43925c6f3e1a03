"""DeepSpeed's ZeRO-Offload as the peer of the toolkit's offloaded step (issue 36): ZeRO stage 2 with the optimizer
in CPU memory (DeepSpeedCPUAdam), on the model and batch of a toolkit recipe, timed the way
benchmarks/first_step.py reads a toolkit run (median tokens/s of the steps after the warm-up).

    python -m benchmarks.deepspeed_offload [--recipe gpt2-1.5b-h200] [--steps 12] [--warmup 3] [--markdown FILE]
                                              [OVERRIDES ...]

The model is Hugging Face's GPT-2 built from the recipe's shape (the toolkit trains the same class, with its fused
kernels swapped in; DeepSpeed runs it as it is), bf16 through DeepSpeed's `bf16` section, AdamW with the recipe's
lr, betas and weight decay, its gradient clipping, random tokens (the recipe's synthetic data is random tokens too),
one process. DeepSpeed is not a dependency of the toolkit: carry its wheel to the GPU machine (gpu_check.sh stage
`deepspeed`); it JIT-builds its CPU Adam on first use, before the timed steps.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


def ds_config(recipe, micro: int) -> dict:
    """DeepSpeed's config for the recipe's optimizer and precision: ZeRO-2, optimizer offloaded to pinned CPU memory."""
    opt = recipe.optimizer
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": recipe.training.grad_clip,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "overlap_comm": True, "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps,
                                                  "weight_decay": opt.weight_decay}},
        "steps_per_print": 1 << 30,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="gpt2-1.5b-h200")
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12, help="timed steps, after --warmup")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("overrides", nargs="*", help="recipe overrides (the model's shape, data.seq_len)")
    args = parser.parse_args(argv)
    for key, value in {"DS_ACCELERATOR": "cuda", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29571"}.items():
        os.environ.setdefault(key, value)  # one process without a launcher; the wheel was built on a CPU machine

    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    from transformers import GPT2Config, GPT2LMHeadModel

    from toolkit.observe.estimate import resolve_model_shape
    from toolkit.observe.memory_monitor import rss_bytes
    from toolkit.recipe.load import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    shape, _ = resolve_model_shape(recipe.model)
    seq = recipe.data.seq_len
    config = GPT2Config(n_layer=shape.n_layer, n_embd=shape.n_embd, n_head=shape.n_head,
                        vocab_size=shape.vocab_size, n_positions=seq, resid_pdrop=shape.dropout,
                        embd_pdrop=shape.dropout, attn_pdrop=shape.dropout)
    torch.manual_seed(recipe.training.seed)
    model = GPT2LMHeadModel(config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(recipe, args.micro))
    tokens = torch.Generator().manual_seed(0)
    seconds, losses = [], []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, shape.vocab_size, (args.micro, seq), generator=tokens).to(engine.device)
        get_accelerator().synchronize()
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())  # NOTE: a sync, as a toolkit run logging every step has
        seconds.append(time.perf_counter() - start)
        print(f"step {step + 1}: loss {losses[-1]:.4f}, {args.micro * seq / seconds[-1]:,.0f} tokens/s", flush=True)
    tokens_per_s = args.micro * seq / statistics.median(seconds[args.warmup:])
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    rss = rss_bytes() / 2**30
    line = (f"| DeepSpeed {deepspeed.__version__} ZeRO-2 + CPU offload, {args.recipe}, micro {args.micro} x {seq} | "
            f"{tokens_per_s:,.0f} | {peak:.1f} GiB | {rss:.1f} GiB | {losses[0]:.4f} -> {losses[-1]:.4f} |")
    print("| configuration | tokens/s (median of steps after the warm-up) | GPU peak (allocated) | host RSS | loss |")
    print("| --- | --- | --- | --- | --- |")
    print(line)
    if args.markdown:
        with args.markdown.open("a") as out:
            out.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
