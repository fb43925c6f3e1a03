"""Benchmark (not a test): GPT-2 training end to end on one GPU, the toolkit against plain PyTorch.

GPT-2 (transformers, SDPA attention), sequence 1024, micro batch 16 (--micro), bf16 autocast,
AdamW, grad clip 1.0, random tokens; after 3 warm-up steps (compilation included),
tokens/s over --steps optimizer steps, peak allocated memory and MFU:

  toolkit fused           toolkit.Engine at ZeRO stage 0 (fp32 weights under autocast), recipe.kernels
                          auto (fused LayerNorm, bias+GELU, cross-entropy, AdamW), eager
  toolkit fused parallel 1x1  as the first with parallel.tensor = parallel.pipeline = 1 named
  toolkit fused stage 1   as the first at ZeRO stage 1: 16-bit weights, fp32 master in the optimizer
  ... unfused residual    the same with each block's attention residual add apart from the norm after it
                          (the blocks' fused forward off: toolkit/ops/fused_modules.py)
  toolkit fallbacks       toolkit.Engine, recipe.kernels off (torch everywhere), eager
  toolkit fused compiled  as the first, training.compile: true
  ... unpadded head      the same with the LM head at the vocabulary's width (the engine pads it
                          to a multiple of 128 columns on the GPU, toolkit/ops/fused_modules.py)
  plain eager             a hand-written loop: autocast, torch AdamW(fused=True),
                          F.cross_entropy(logits.float()), clip_grad_norm_
  plain compiled          the same with torch.compile(model)

    python -m benchmarks.end_to_end [--size 124m] [--micro 16] [--steps 10] [--only name,name] [--rounds R]
                                    [--markdown FILE]

MFU = tokens/s x (6 N + 12 L d T) / 989.4e12 (nanoGPT's FLOPs per token with attention;
H200 SXM dense bf16 peak from the datasheet; about 790e12 measured on random matrices).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

PEAK_FLOPS = 989.4e12
SEQ = 1024
MICRO = 16  # set by --micro before anything is built


def flops_per_token(n_params: int, layers: int, width: int) -> float:
    return 6 * n_params + 12 * layers * width * SEQ


def run_toolkit(size: str, steps: int, overrides: list[str], pad_head: bool = True, fuse_residual: bool = True):
    from toolkit.runtime.engine import Engine
    from toolkit.recipe.load import load_recipe

    recipe = load_recipe("gpt2-124m", [f"model.size={size}", "batch.grad_accum_steps=1", "zero.stage=0",
                                       f"batch.micro_batch_per_rank={MICRO}", "training.device=cuda",
                                       "training.max_steps=1000", *overrides])
    engine = Engine(recipe)
    if not pad_head:
        engine._padded_head = None  # its `padded` flag then stays unset: logits at the vocabulary's width
    if not fuse_residual:
        for module in engine.model.modules():
            if type(module).__name__ in ("FusedGPT2Block", "FusedLlamaDecoderLayer"):
                module.fused = False  # the block's own forward: add, then the fused norm
    return engine.model, lambda tokens: engine.train_batch([tokens]).loss_tensor, engine.kernels.describe()


def run_plain(size: str, steps: int, compiled: bool, padded_vocab: bool = False):
    """Plain PyTorch; padded_vocab: the model's vocabulary padded to a multiple of 128 as nanoGPT does
    (50304: the extra classes are never targets but take part in the softmax), the data's unchanged."""
    import dataclasses

    from toolkit.models.build import build_model
    from benchmarks.plain_baseline import plain_step
    from toolkit.recipe.load import load_recipe

    spec = load_recipe("gpt2-124m", [f"model.size={size}"]).model
    data_vocab = spec.vocab_size
    if padded_vocab:
        spec = dataclasses.replace(spec, vocab_size=(spec.vocab_size + 127) // 128 * 128)
    model = build_model(spec, seed=0, device="cuda").train()
    model.data_vocab = data_vocab
    return model, plain_step(model, compiled), "torch, vocabulary padded" if padded_vocab else "torch"


def batches_for(model) -> list:
    vocab = getattr(model, "data_vocab", model.config.vocab_size)
    return [torch.randint(0, vocab, (MICRO, SEQ + 1), device="cuda") for _ in range(4)]


def timed(step, batches, steps: int) -> tuple[float, float]:
    """(seconds for `steps` steps, last loss)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for i in range(steps):
        loss = step(batches[i % 4])
    torch.cuda.synchronize()
    return time.perf_counter() - started, float(loss)


def result(model, steps: int, elapsed: float, peak_gib: float | None, warmup_s: float, loss: float) -> dict:
    n_params = sum(p.numel() for p in model.parameters())
    config = model.config
    tokens_per_s = MICRO * SEQ * steps / elapsed
    return {"tokens/s": tokens_per_s, "ms/step": 1e3 * elapsed / steps,
            "mfu": tokens_per_s * flops_per_token(n_params, config.n_layer, config.n_embd) / PEAK_FLOPS,
            "peak GiB": peak_gib, "warmup s": warmup_s, "loss": loss}


def measure(model, step, steps: int) -> dict:
    batches = batches_for(model)
    warmup_s, _ = timed(step, batches, 3)
    torch.cuda.reset_peak_memory_stats()
    elapsed, loss = timed(step, batches, steps)
    return result(model, steps, elapsed, torch.cuda.max_memory_allocated() / 2**30, warmup_s, loss)


def measure_interleaved(built: dict, steps: int, rounds: int) -> dict:
    """Every configuration stays built; `rounds` rounds each time `steps` steps of each in turn, so a
    drift of the GPU's clocks or temperature over the run reaches every configuration alike. Peak
    memory is not reported: the other configurations' weights and optimizer states are resident too."""
    batches = {name: batches_for(model) for name, (model, _, _) in built.items()}
    warmup = {name: timed(step, batches[name], 3)[0] for name, (_, step, _) in built.items()}
    total = dict.fromkeys(built, 0.0)
    loss = {}
    for _ in range(rounds):
        for name, (_, step, _) in built.items():
            elapsed, loss[name] = timed(step, batches[name], steps)
            total[name] += elapsed
    return {name: result(model, steps * rounds, total[name], None, warmup[name], loss[name])
            for name, (model, _, _) in built.items()}


CONFIGS = {
    "toolkit fused": lambda size, steps: run_toolkit(size, steps, ["precision.dtype=bf16"]),
    # issue 24: a recipe that names tensor = pipeline = 1 must cost nothing against one without a parallel section
    "toolkit fused parallel 1x1": lambda size, steps: run_toolkit(size, steps, ["precision.dtype=bf16",
                                                                              "parallel.tensor=1",
                                                                              "parallel.pipeline=1"]),
    # on one rank stage 1 holds 16-bit weights (fp32 master in the optimizer) where stage 0 casts fp32 weights
    "toolkit fused stage 1": lambda size, steps: run_toolkit(size, steps, ["precision.dtype=bf16", "zero.stage=1"]),
    "toolkit fused stage 1 unfused residual": lambda size, steps: run_toolkit(
        size, steps, ["precision.dtype=bf16", "zero.stage=1"], fuse_residual=False),
    "toolkit fallbacks": lambda size, steps: run_toolkit(
        size, steps, ["precision.dtype=bf16"] + [f"kernels.{k}=off" for k in
                                                 ("adamw", "layernorm", "rmsnorm", "bias_gelu", "cross_entropy")]),
    "plain eager": lambda size, steps: run_plain(size, steps, compiled=False),
    "toolkit fused compiled": lambda size, steps: run_toolkit(size, steps, ["precision.dtype=bf16",
                                                                           "training.compile=true"]),
    "plain compiled": lambda size, steps: run_plain(size, steps, compiled=True),
    "plain compiled padded vocab": lambda size, steps: run_plain(size, steps, compiled=True, padded_vocab=True),
    "toolkit fused unpadded head": lambda size, steps: run_toolkit(size, steps, ["precision.dtype=bf16"],
                                                                    pad_head=False),
    "toolkit fused compiled unpadded head": lambda size, steps: run_toolkit(
        size, steps, ["precision.dtype=bf16", "training.compile=true"], pad_head=False),
}


def main() -> int:
    global MICRO
    parser = argparse.ArgumentParser(prog="python -m benchmarks.end_to_end", description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="124m")
    parser.add_argument("--micro", type=int, default=MICRO, help="micro batch (sequences), every configuration")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", default=",".join(CONFIGS))
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--rounds", type=int, default=0,
                        help="keep every configuration built and time them in turn, this many rounds of --steps "
                             "steps each (0: one configuration after the other, with peak memory)")
    args = parser.parse_args()
    MICRO = args.micro
    header = (f"GPT-2 {args.size}, seq {SEQ}, micro batch {MICRO}, bf16, {args.steps} timed steps; "
              f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.rounds:
        header += f"; interleaved, {args.rounds} rounds"
    lines = [f"### End to end: {header}", "", "| config | kernels | tokens/s | ms/step | MFU | peak GiB | warm-up s |",
             "|---|---|---|---|---|---|---|"]
    print(header, flush=True)

    def add_row(name: str, kernels: str, r: dict) -> None:
        peak = f"{r['peak GiB']:.1f}" if r["peak GiB"] is not None else "-"
        row = (f"| {name} | {kernels} | {r['tokens/s']:,.0f} | {r['ms/step']:.1f} | {100 * r['mfu']:.1f}% | "
               f"{peak} | {r['warmup s']:.0f} |")
        print(row, f"loss {r['loss']:.3f}", flush=True)
        lines.append(row)
        if args.markdown:
            Path(args.markdown).write_text("\n".join(lines) + "\n")

    names = args.only.split(",")
    if args.rounds:
        built = {}
        for name in names:
            built[name] = CONFIGS[name](args.size, args.steps)
        for name, r in measure_interleaved(built, args.steps, args.rounds).items():
            add_row(name, built[name][2], r)
    else:
        for name in names:
            torch._dynamo.reset()
            model, step, kernels = CONFIGS[name](args.size, args.steps)
            add_row(name, kernels, measure(model, step, args.steps))
            del model, step
            torch.cuda.empty_cache()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
