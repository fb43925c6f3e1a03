"""Benchmark (not a test): ZeRO stages and offload on one or several GPUs against plain
PyTorch (DDP on several) and FSDP2.

    python -m benchmarks.zero_gpu [--size 124m | --layers L --width D --heads H] [--micro 16]
        [--configs plain,stage0,stage1,stage2,stage3,stage2-offload,fsdp2] [--ckpt] [--steps 10]
        [--gpus N [--scaling]] [--offload-ratio R] [--markdown FILE]

Each configuration runs in its own child processes (their own CUDA contexts, so the peaks are
their own and running out of memory ends one row, not the table): one process on one GPU, in
an NCCL process group of world size 1 so the stages' collectives go through NCCL as they would
on many; with --gpus N, N ranks launched by torchrun (NCCL_NVLS_ENABLE=0), micro batch per GPU:

  plain           benchmarks/plain_baseline.py: bf16 autocast, fp32 weights, torch AdamW(fused=True);
                  wrapped in DDP on several GPUs
  stageN          toolkit.Engine, zero.stage N, bf16 (stages >= 1: bf16 weights, fp32 master), kernels auto
  stageN-offload  the same with zero.offload_optimizer cpu (master and moments in CPU memory)
  fsdp2           torch FSDP2 `fully_shard` per block and root, bf16 compute, fp32 reduce and
                  master, torch AdamW (foreach): ZeRO-3's torch peer
  tpT, ppP, ppP-tpT  toolkit.Engine with recipe.parallel (stage 0, bf16): tensor T and/or pipeline P ranks per
                  replica (1F1B over the largest divisor of --micro up to 4P micro-batches), data parallel
                  over the rest of --gpus; tokens/s counts each replica's batch once. stage0 is their
                  tensor 1, pipeline 1 row. E.g. --gpus 8 --configs stage0,tp2,tp4,pp2,pp4,pp2-tp2 --scaling

GPT-2 shapes (transformers), vocabulary 50257, sequence 1024, random tokens, clip 1.0.
After --warmup steps, tokens/s over --steps steps (and per GPU; --scaling also runs each config
on one GPU and reports per-GPU efficiency); peak GPU memory of the busiest rank (allocated and
reserved), its peak resident host memory, and `toolkit estimate`'s model states per rank.
`--device cpu` runs the same plumbing on gloo ranks, to check it without a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import torch

SEQ, VOCAB = 1024, 50257
DEFAULT_CONFIGS = "plain,stage0,stage1,stage2,stage3,stage2-offload"


def model_overrides(args) -> list[str]:
    """Recipe overrides for the model shape the arguments name."""
    if args.layers:
        return ["model.size=124m", f"model.n_layer={args.layers}", f"model.n_embd={args.width}",
                f"model.n_head={args.heads}"]
    return [f"model.size={args.size}"]


def layout_of(config: str) -> tuple[int, int]:
    """(tensor, pipeline) ranks per replica of a config name: tp2 -> (2, 1), pp2-tp2 -> (2, 2), stage1 -> (1, 1)."""
    tp = pp = 1
    if config.startswith(("tp", "pp")):
        for part in config.split("-"):
            if part[:2] not in ("tp", "pp") or not part[2:].isdigit() or int(part[2:]) < 1:
                raise SystemExit(f"--configs: {config!r} is not tpT, ppP or ppP-tpT (e.g. tp2, pp4, pp2-tp2)")
            tp, pp = (int(part[2:]), pp) if part.startswith("tp") else (tp, int(part[2:]))
    return tp, pp


def parallel_overrides(args, config: str) -> list[str]:
    """recipe.parallel overrides of a tpT / ppP / ppP-tpT config (empty for the others)."""
    tp, pp = layout_of(config)
    if tp == pp == 1:
        return []
    microbatches = max(m for m in range(1, min(args.micro, 4 * pp) + 1) if args.micro % m == 0)
    return [f"parallel.tensor={tp}", f"parallel.pipeline={pp}", "parallel.pipeline_schedule=1f1b",
            f"parallel.pipeline_microbatches={microbatches}"]


def engine_recipe(args, config: str, world_size: int | None = None):
    from toolkit.recipe.load import load_recipe

    stage = int(config[5]) if config.startswith("stage") else 0
    overrides = [*model_overrides(args), *parallel_overrides(args, config), f"zero.stage={stage}",
                 f"zero.offload_optimizer={'cpu' if config.endswith('offload') else 'none'}",
                 *([f"zero.offload_ratio={args.offload_ratio}"] if config.endswith("offload") else []),
                 f"batch.micro_batch_per_rank={args.micro}", "batch.grad_accum_steps=1", "precision.dtype=bf16",
                 f"optimizer.state_dtype={args.state_dtype}",
                 f"training.device={args.device}", "training.max_steps=1000", "checkpoint.save_final=false",
                 f"model.activation_checkpointing={'true' if args.ckpt else 'false'}",
                 "logging.tensorboard=false"]
    if args.kernels_off:
        overrides += [f"kernels.{k}=off" for k in ("adamw", "layernorm", "rmsnorm", "bias_gelu", "cross_entropy")]
    return load_recipe("gpt2-124m", overrides, world_size=world_size)


def build(args, config: str, device: torch.device):
    """(model, step(tokens) -> loss) for one configuration on this rank."""
    if config in ("plain", "fsdp2"):
        import torch.distributed as dist

        from toolkit.models.build import build_model
        from benchmarks.plain_baseline import plain_step

        spec = engine_recipe(args, "stage0").model  # the spec carries activation checkpointing
        model = build_model(spec, seed=0, device=device).train()
        if config == "fsdp2":  # ZeRO-3's torch peer: bf16 compute, fp32 sharded master, fp32 reduce
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.transformer.h:
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            return model, plain_step(model, fused=False)
        if dist.is_initialized() and dist.get_world_size() > 1:  # plain data parallel: DDP
            from torch.nn.parallel import DistributedDataParallel

            ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
            return model, plain_step(model, forward=ddp)
        return model, plain_step(model)
    from toolkit.runtime.engine import Engine

    engine = Engine(engine_recipe(args, config))
    print(engine.strategy.describe() if hasattr(engine.strategy, "describe") else "", file=sys.stderr)
    return engine.model, lambda tokens: engine.train_batch([tokens]).loss_tensor


def child(args) -> dict | None:
    """Run one configuration on this rank (torchrun's environment, else one process); rank 0 returns the figures."""
    import torch.distributed as dist

    from toolkit.observe.estimate import estimate_model_state_bytes
    from toolkit.observe.memory_monitor import reset_rss_peak, rss_peak_bytes

    rank, world, local = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    cuda = args.device == "cuda"
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world == 1 and args.config != "plain":  # the stages' collectives still go through a (one-rank) group
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    if world > 1 or args.config != "plain":
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                device_id=device if cuda else None)
    reset_rss_peak()
    started = time.perf_counter()
    model, step = build(args, args.config, device)
    n_params = sum(p.numel() for p in model.parameters())  # FSDP2's DTensors count their global size
    build_s = time.perf_counter() - started
    tp, pp = layout_of(args.config)
    dp = world // (tp * pp)
    generator = torch.Generator().manual_seed(rank // tp % dp)  # a replica's tensor/pipeline ranks share its data
    batches = [torch.randint(0, VOCAB, (args.micro, SEQ + 1), generator=generator).to(device) for _ in range(2)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for i in range(args.warmup):
        loss = step(batches[i % 2])
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if dist.is_initialized():
        dist.barrier()
    started = time.perf_counter()
    for i in range(args.steps):
        loss = step(batches[i % 2])
    sync()
    elapsed = time.perf_counter() - started
    peaks = {"gpu_alloc_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
             "gpu_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
             "host_peak_gib": rss_peak_bytes() / 2**30}
    per_rank = [peaks]
    if dist.is_initialized():
        per_rank = [None] * world
        dist.all_gather_object(per_rank, peaks)
        dist.destroy_process_group()
    if rank != 0:
        return None
    stage = int(args.config[5]) if args.config.startswith("stage") else 0
    offload = "cpu" if args.config.endswith("offload") else "none"
    estimate = None if args.config == "fsdp2" else estimate_model_state_bytes(
        n_params, stage=stage, world_size=world, dtype="bf16", offload=offload, offload_ratio=args.offload_ratio,
        state_dtype=args.state_dtype)
    if tp * pp > 1:  # the busiest rank's share (toolkit estimate's formula); the whole model's parameter count
        from toolkit.observe.estimate import parameter_count
        from toolkit.observe.parallel_estimate import estimate_parallel_memory

        recipe = engine_recipe(args, args.config, world_size=world)
        n_params = parameter_count(recipe.model)
        estimate = estimate_parallel_memory(recipe.model, recipe.parallel, micro_batch=args.micro, seq_len=SEQ,
                                            dtype="bf16", dp=dp, stage=0).states
    tokens_per_s = args.micro * SEQ * args.steps * dp / elapsed  # each replica's batch once
    return {"config": args.config, "gpus": world, "params": n_params, "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_gpu": tokens_per_s / world, "ms_per_step": 1e3 * elapsed / args.steps,
            "loss": float(loss), "build_s": build_s,
            **{key: max(r[key] for r in per_rank) for key in peaks},  # the busiest rank's peaks
            "estimate_gpu_gib": estimate.gpu / 2**30 if estimate else None,
            "estimate_cpu_gib": estimate.cpu_optim / 2**30 if estimate else None}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_child(args, config: str, gpus: int) -> dict:
    """One configuration in child processes (`gpus` ranks): its figures, or {"error": last line} when it failed."""
    shape = ["--layers", str(args.layers), "--width", str(args.width), "--heads", str(args.heads)] \
        if args.layers else ["--size", args.size]
    launcher = [sys.executable] if gpus == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    command = [*launcher, "-m", "benchmarks.zero_gpu", "--child", config, *shape, "--micro", str(args.micro),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--port", str(free_port()),
               "--device", args.device]
    command += ["--ckpt"] * args.ckpt + ["--kernels-off"] * args.kernels_off + ["--offload-ratio", str(args.offload_ratio)]
    command += ["--state-dtype", args.state_dtype]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0",  # NVLink multicast off (the lent machines need it)
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // gpus))}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"config": config, "gpus": gpus, "error": f"timed out after {args.timeout} s"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    sys.stderr.write("\n".join(lines[-30:]) + "\n")
    return {"config": config, "gpus": gpus, "error": (lines[-1] if lines else f"exit {done.returncode}")[:160]}


def table(args, results: list[dict]) -> list[str]:
    shape = f"{args.layers} layers x {args.width}" if args.layers else f"GPT-2 {args.size}"
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    ratio = f", offload_ratio {args.offload_ratio}" if args.offload_ratio != 1 else ""
    ratio += f", optimizer.state_dtype {args.state_dtype}" if args.state_dtype != "fp32" else ""
    lines = [f"### {shape}, micro batch {args.micro} x {SEQ} per GPU, bf16"
             f"{', activation checkpointing' if args.ckpt else ''}{ratio}; {device} ({os.cpu_count()} CPUs), "
             f"torch {torch.__version__}, {args.steps} timed steps", "",
             "| config | GPUs | params | tokens/s | per GPU | scaling | ms/step | vs plain | GPU peak alloc / reserved "
             "GiB (busiest rank) | host peak GiB | estimate GPU states / CPU GiB | loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['gpus']} | | failed: {r['error']} | | | | | | | | |")
            continue
        plain = next((q for q in results if q["config"] == "plain" and q["gpus"] == r["gpus"] and "error" not in q), None)
        baseline = "stage0" if layout_of(r["config"]) != (1, 1) else r["config"]  # tp/pp: against one GPU's stage 0
        one = next((q for q in results if q["config"] == baseline and q["gpus"] == 1 and "error" not in q), None)
        vs_plain = f"{r['tokens_per_s'] / plain['tokens_per_s']:.2f}x" if plain else ""
        scaling = f"{r['tokens_per_s_per_gpu'] / one['tokens_per_s']:.0%}" if one and r["gpus"] > 1 else ""
        estimate = (f"{r['estimate_gpu_gib']:.1f} / {r['estimate_cpu_gib']:.1f}"
                    if r.get("estimate_gpu_gib") is not None else "")
        lines.append(f"| {r['config']} | {r['gpus']} | {r['params'] / 1e9:.2f}B | {r['tokens_per_s']:,.0f} "
                     f"| {r['tokens_per_s_per_gpu']:,.0f} | {scaling} | {r['ms_per_step']:.0f} | {vs_plain} "
                     f"| {r['gpu_alloc_gib']:.1f} / {r['gpu_reserved_gib']:.1f} | {r['host_peak_gib']:.1f} "
                     f"| {estimate} | {r['loss']:.3f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.zero_gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="124m")
    parser.add_argument("--layers", type=int, default=0, help="custom GPT-2 shape (with --width, --heads)")
    parser.add_argument("--width", type=int, default=0)
    parser.add_argument("--heads", type=int, default=0)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS)
    parser.add_argument("--ckpt", action="store_true", help="activation checkpointing")
    parser.add_argument("--offload-ratio", type=float, default=1.0, help="zero.offload_ratio of the offload configs")
    parser.add_argument("--state-dtype", choices=["fp32", "bf16", "int8"], default="fp32",
                        help="optimizer.state_dtype (bf16 states: 6 bytes per offloaded parameter, not 12)")
    parser.add_argument("--kernels-off", action="store_true", help="torch everywhere instead of fused kernels")
    parser.add_argument("--gpus", type=int, default=1, help="ranks, one GPU each (NCCL; torchrun launches them)")
    parser.add_argument("--scaling", action="store_true", help="with --gpus N > 1: each config on 1 GPU too")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: gloo ranks on the CPU, to check the plumbing without a GPU")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per configuration")
    parser.add_argument("--markdown", default=None, help="append the table to this file")
    parser.add_argument("--child", dest="config", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.config:
        result = child(args)
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
        return 0
    results = []
    counts = [1, args.gpus] if args.scaling and args.gpus > 1 else [args.gpus]
    configs = args.configs.split(",")
    for config in configs:  # a wrong name or a layout that does not divide --gpus: before anything runs
        tp, pp = layout_of(config)
        if args.gpus % (tp * pp):
            raise SystemExit(f"--configs {config}: {tp * pp} ranks per replica do not divide --gpus {args.gpus}")
    for gpus in counts:
        for config in configs:
            if gpus % (layout_of(config)[0] * layout_of(config)[1]):
                continue  # --scaling's one-GPU pass: a layout of several ranks has no one-GPU row
            results.append(run_child(args, config, gpus))
            print(json.dumps(results[-1]), flush=True)
    lines = table(args, results)
    print("\n".join(lines), flush=True)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n".join(lines) + "\n\n")
    failed = [f"{r['config']} on {r['gpus']} GPU(s)" for r in results if "error" in r]
    if failed:  # the table keeps its rows; the exit status says the call is not all good (gpu_check.sh's summary)
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
