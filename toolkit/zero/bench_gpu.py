"""Benchmark (not a test): ZeRO stages and offload on one GPU against plain PyTorch.

    python -m toolkit.zero.bench_gpu [--size 124m | --layers L --width D --heads H] [--micro 16]
        [--configs plain,stage0,stage1,stage2,stage3,stage2-offload] [--ckpt] [--steps 10]
        [--markdown FILE]

Each configuration runs in its own child process (its own CUDA context, so the peaks are
its own and running out of memory ends one row, not the table), in an NCCL process group
of world size 1, so the stages' collectives go through NCCL as they would on many GPUs:

  plain           toolkit/plain_baseline.py: bf16 autocast, fp32 weights, torch AdamW(fused=True)
  stageN          toolkit.Engine, zero.stage N, bf16 (stages >= 1: bf16 weights, fp32 master), kernels auto
  stageN-offload  the same with zero.offload_optimizer cpu (master and moments in CPU memory)

GPT-2 shapes (transformers), vocabulary 50257, sequence 1024, random tokens, clip 1.0.
After --warmup steps, tokens/s over --steps steps; peak GPU memory (allocated and reserved),
the child's peak resident host memory, and `toolkit estimate`'s model-state figures.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

SEQ, VOCAB = 1024, 50257
DEFAULT_CONFIGS = "plain,stage0,stage1,stage2,stage3,stage2-offload"


def model_overrides(args) -> list[str]:
    """Recipe overrides for the model shape the arguments name."""
    if args.layers:
        return ["model.size=124m", f"model.n_layer={args.layers}", f"model.n_embd={args.width}",
                f"model.n_head={args.heads}"]
    return [f"model.size={args.size}"]


def engine_recipe(args, config: str):
    from toolkit.recipe import load_recipe

    stage = int(config[5])
    overrides = [*model_overrides(args), f"zero.stage={stage}",
                 f"zero.offload_optimizer={'cpu' if config.endswith('offload') else 'none'}",
                 *([f"zero.offload_ratio={args.offload_ratio}"] if config.endswith("offload") else []),
                 f"batch.micro_batch_per_rank={args.micro}", "batch.grad_accum_steps=1", "precision.dtype=bf16",
                 "training.device=cuda", "training.max_steps=1000", "checkpoint.save_final=false",
                 f"model.activation_checkpointing={'true' if args.ckpt else 'false'}",
                 "logging.tensorboard=false"]
    if args.kernels_off:
        overrides += [f"kernels.{k}=off" for k in ("adamw", "layernorm", "rmsnorm", "bias_gelu", "cross_entropy")]
    return load_recipe("gpt2-124m", overrides)


def build(args, config: str):
    """(model, step(tokens) -> loss) for one configuration."""
    if config == "plain":
        from toolkit.models import build_model
        from toolkit.plain_baseline import plain_step

        spec = engine_recipe(args, "stage0").model
        model = build_model(spec, seed=0, device="cuda").train()  # spec carries activation checkpointing
        return model, plain_step(model)
    from toolkit.engine import Engine

    engine = Engine(engine_recipe(args, config))
    print(engine.strategy.describe() if hasattr(engine.strategy, "describe") else "", file=sys.stderr)
    return engine.model, lambda tokens: engine.train_batch([tokens]).loss


def child(args) -> dict:
    """Run one configuration in this process; returns its figures."""
    import torch.distributed as dist

    from toolkit.memory import estimate_model_state_bytes
    from toolkit.memory_monitor import reset_rss_peak, rss_peak_bytes

    torch.cuda.set_device(0)
    if args.config != "plain":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    reset_rss_peak()
    started = time.perf_counter()
    model, step = build(args, args.config)
    n_params = sum(p.numel() for p in model.parameters())
    build_s = time.perf_counter() - started
    batches = [torch.randint(0, VOCAB, (args.micro, SEQ + 1), device="cuda") for _ in range(2)]
    for i in range(args.warmup):
        loss = step(batches[i % 2])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for i in range(args.steps):
        loss = step(batches[i % 2])
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    stage = 0 if args.config == "plain" else int(args.config[5])
    offload = "cpu" if args.config.endswith("offload") else "none"
    estimate = estimate_model_state_bytes(n_params, stage=stage, world_size=1, dtype="bf16", offload=offload,
                                          offload_ratio=args.offload_ratio)
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"config": args.config, "params": n_params, "tokens_per_s": args.micro * SEQ * args.steps / elapsed,
            "ms_per_step": 1e3 * elapsed / args.steps, "loss": float(loss),
            "gpu_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
            "gpu_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            "host_peak_gib": rss_peak_bytes() / 2**30, "build_s": build_s,
            "estimate_gpu_gib": estimate.gpu / 2**30, "estimate_cpu_gib": estimate.cpu_optim / 2**30}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_child(args, config: str) -> dict:
    """One configuration in a child process: its figures, or {"error": last line} when it failed."""
    shape = ["--layers", str(args.layers), "--width", str(args.width), "--heads", str(args.heads)] \
        if args.layers else ["--size", args.size]
    command = [sys.executable, "-m", "toolkit.zero.bench_gpu", "--child", config, *shape, "--micro", str(args.micro),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--port", str(free_port())]
    command += ["--ckpt"] * args.ckpt + ["--kernels-off"] * args.kernels_off + ["--offload-ratio", str(args.offload_ratio)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"config": config, "error": f"timed out after {args.timeout} s"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    sys.stderr.write("\n".join(lines[-30:]) + "\n")
    return {"config": config, "error": (lines[-1] if lines else f"exit {done.returncode}")[:160]}


def table(args, results: list[dict]) -> list[str]:
    shape = f"{args.layers} layers x {args.width}" if args.layers else f"GPT-2 {args.size}"
    plain = next((r for r in results if r["config"] == "plain" and "error" not in r), None)
    ratio = f", offload_ratio {args.offload_ratio}" if args.offload_ratio != 1 else ""
    lines = [f"### {shape}, micro batch {args.micro} x {SEQ}, bf16{', activation checkpointing' if args.ckpt else ''}{ratio}"
             f"; {torch.cuda.get_device_name()} ({os.cpu_count()} CPUs), torch {torch.__version__}, "
             f"{args.steps} timed steps", "",
             "| config | params | tokens/s | ms/step | vs plain | GPU peak alloc / reserved GiB | host peak GiB "
             "| estimate GPU states / CPU GiB | loss |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | | failed: {r['error']} | | | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / plain['tokens_per_s']:.2f}x" if plain else ""
        lines.append(f"| {r['config']} | {r['params'] / 1e9:.2f}B | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.0f} "
                     f"| {ratio} | {r['gpu_alloc_gib']:.1f} / {r['gpu_reserved_gib']:.1f} | {r['host_peak_gib']:.1f} "
                     f"| {r['estimate_gpu_gib']:.1f} / {r['estimate_cpu_gib']:.1f} | {r['loss']:.3f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="124m")
    parser.add_argument("--layers", type=int, default=0, help="custom GPT-2 shape (with --width, --heads)")
    parser.add_argument("--width", type=int, default=0)
    parser.add_argument("--heads", type=int, default=0)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS)
    parser.add_argument("--ckpt", action="store_true", help="activation checkpointing")
    parser.add_argument("--offload-ratio", type=float, default=1.0, help="zero.offload_ratio of the offload configs")
    parser.add_argument("--kernels-off", action="store_true", help="torch everywhere instead of fused kernels")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per configuration")
    parser.add_argument("--markdown", default=None, help="append the table to this file")
    parser.add_argument("--child", dest="config", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.config:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    results = []
    for config in args.configs.split(","):
        results.append(run_child(args, config))
        print(json.dumps(results[-1]), flush=True)
    lines = table(args, results)
    print("\n".join(lines), flush=True)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n".join(lines) + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
