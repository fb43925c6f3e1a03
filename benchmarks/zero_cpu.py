"""Benchmark (not a test): ZeRO stages 0-3 (and offload) against torch's own data
parallelism on the same model, batches and settings: DDP, DDP +
ZeroRedundancyOptimizer (ZeRO-1's torch version) and FSDP2 `fully_shard` per
block (ZeRO-3's), each with torch AdamW, global-norm clipping at 1.0, fp32.

    python -m benchmarks.zero_cpu [--world 2] [--layers 4] [--width 256] [--steps 20]

Launches --world ranks (gloo on the CPU, NCCL on GPUs) with torch.multiprocessing;
every rank trains every implementation for --warmup + --steps optimizer steps,
implementations interleaved round by round so machine noise hits all alike. Rank 0
prints one table: median ms per step, tokens/s, ratio to DDP, and each rank's
model-state bytes where the implementation reports them.
"""
from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

TOOLKIT = ["stage0", "stage1", "stage2", "stage3", "stage2-offload", "stage3-offload"]
TORCH = ["ddp", "ddp+zero-redundancy", "fsdp2"]


def recipe_dict(args, stage: int, offload: bool) -> dict:
    """The benchmark recipe: a GPT-2 of --layers x --width on synthetic tokens, fp32, constant lr."""
    return {
        "model": {"family": "gpt2", "size": "tiny", "n_layer": args.layers, "n_embd": args.width,
                  "n_head": max(1, args.width // 64)},
        "data": {"kind": "synthetic", "seq_len": args.seq, "vocab_size": args.vocab, "branching": 4,
                 "num_samples": args.micro * args.world * (args.steps + args.warmup + 1), "eval_samples": 8},
        "batch": {"micro_batch_per_rank": args.micro, "grad_accum_steps": 1},
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1, "implementation": "torch"},
        "scheduler": {"type": "constant"},
        "training": {"max_steps": args.steps + args.warmup, "seed": 0, "grad_clip": 1.0, "eval_interval": 0},
        "zero": {"stage": stage, "offload_optimizer": "cpu" if offload else "none"},
        "logging": {"console": False, "tensorboard": False, "wandb": {"mode": "disabled"}},
        "checkpoint": {"save_final": False},
    }


def toolkit_stepper(args, name: str):
    """(step(batch), memory()) for one toolkit ZeRO configuration."""
    from toolkit.runtime.engine import Engine
    from toolkit.recipe.load import recipe_from_dict

    stage = int(name[5])
    engine = Engine(recipe_from_dict(recipe_dict(args, stage, name.endswith("offload")), world_size=args.world))
    return (lambda batch: engine.train_batch([batch])), engine.strategy.memory_bytes


def torch_stepper(args, name: str, device: torch.device):
    """(step(batch), memory()) for DDP, DDP + ZeroRedundancyOptimizer or FSDP2 over the same model."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from toolkit.models.build import build_model
    from toolkit.runtime.optim import param_groups
    from toolkit.recipe.load import recipe_from_dict

    recipe = recipe_from_dict(recipe_dict(args, 0, False), world_size=args.world)
    model = build_model(recipe.model, 0).to(device)
    kwargs = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        wrapped = model
        opt = torch.optim.AdamW(param_groups(model, 0.1), **kwargs)
    else:
        wrapped = DistributedDataParallel(model, bucket_cap_mb=25)
        if name == "ddp":
            opt = torch.optim.AdamW(param_groups(model, 0.1), **kwargs)
        else:
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, weight_decay=0.1,
                                          **kwargs)

    def step(batch):
        tokens = batch.to(device)
        logits = wrapped(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, (lambda: {})


def _rank_main(rank: int, args) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(args.threads)
    from toolkit.data.batches import BatchStream, Dataset
    from toolkit.recipe.load import recipe_from_dict

    names = [n for n in TOOLKIT + TORCH if not args.only or n in args.only]
    steppers, memory = {}, {}
    for name in names:  # toolkit first: its engine joins the process group the torch baselines then use
        if name in TOOLKIT:
            steppers[name], memory[name] = toolkit_stepper(args, name)
        else:
            device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
            if not dist.is_initialized():
                dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            steppers[name], memory[name] = torch_stepper(args, name, device)
    recipe = recipe_from_dict(recipe_dict(args, 0, False), world_size=args.world)
    stream = BatchStream(Dataset(recipe.data).train, recipe.batch, rank=rank, seed=0)
    batches = [stream.next_step()[0] for _ in range(args.steps + args.warmup)]
    times = {name: [] for name in names}
    for i, batch in enumerate(batches):
        for name in names:
            dist.barrier()
            start = time.perf_counter()
            steppers[name](batch)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        report(args, names, times, memory)
    dist.barrier()
    dist.destroy_process_group()


def report(args, names, times, memory) -> None:
    """Rank 0's table."""
    tokens = args.micro * args.world * args.seq
    base = statistics.median(times["ddp"]) if "ddp" in times else None
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else (platform.processor() or "CPU")
    print(f"world {args.world} ({'NCCL' if torch.cuda.is_available() else 'gloo'}), {device}, "
          f"{os.cpu_count()} CPUs, {args.threads} thread(s)/rank; GPT-2 {args.layers} x {args.width}, vocab "
          f"{args.vocab}, seq {args.seq}, micro {args.micro}/rank, fp32, AdamW, clip 1.0; median of {args.steps} "
          f"steps after {args.warmup}")
    print(f"{'implementation':<22} {'ms/step':>9} {'tokens/s':>10} {'vs DDP':>8}  model-state bytes/rank (p+g+o)")
    for name in names:
        ms = statistics.median(times[name]) * 1e3
        mem = memory[name]()
        states = (f"{mem['mem_params_bytes']:,}+{mem['mem_grads_bytes']:,}+"
                  f"{mem['mem_optim_bytes'] + mem['mem_master_bytes'] + mem['mem_offload_bytes']:,}") if mem else ""
        ratio = f"{base * 1e3 / ms:7.2f}x" if base else ""
        print(f"{name:<22} {ms:9.1f} {tokens / ms * 1e3:10.0f} {ratio:>8}  {states}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.zero_cpu", description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // 2), help="torch threads/rank")
    parser.add_argument("--only", nargs="*", help=f"a subset of {TOOLKIT + TORCH}")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        args.port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(args,), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
