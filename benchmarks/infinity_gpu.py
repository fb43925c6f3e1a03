"""Benchmark (not a test): ZeRO-Infinity on one GPU: GPT-2 shapes trained a few steps at stage 3 with
the optimizer offloaded to CPU memory or to swap files (NVMe), and the largest that fits with NVMe.

    python -m benchmarks.infinity_gpu --swap-dir /tmp/swap [--runs max:nvme,39:nvme,39:cpu,24:nvme,24:cpu]
        [--width 4096 --heads 32 --micro 4] [--state-dtype bf16 [--grad-dtype bf16]] [--budget-s 540] [--markdown FILE] [--device cpu]

A run is LAYERS:TIER[:RATIO[:NVME_RATIO]]: LAYERS a depth or `max` (the deepest model the estimator fits
on this machine with the optimizer in swap files and the parameter shard in CPU memory); TIER cpu or nvme
(zero.offload_optimizer); RATIO zero.offload_ratio, default `auto`: the pair's common ratio, the largest
(at most 1) whose swap files fit 92% of the swap folder's free disk; for `max`, the smallest that
leaves the GPU room, with the largest zero.nvme_ratio (NVME_RATIO, default 1) whose swap files fit the
disk, the rest of the offloaded optimizer in CPU memory. Every run: stage 3, bf16, activation
checkpointing, sequence 1024, random tokens, one process per run (its own CUDA context, peaks, and
failure), --warmup then --steps timed steps.
Rows are written to --markdown as each run ends; a run whose predicted time (model build + swap
writes at --disk-gbps + its steps) exceeds the budget left is skipped, with its prediction.
Reported: tokens/s, host peak RSS (VmHWM), disk peak (swap folder's disk use, sampled), swap MB/s
over the timed steps (bytes read + written / time) against --disk-gbps, GPU peak.
`--device cpu` (gloo, tiny shapes) checks the plumbing without a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import time

SEQ, VOCAB = 1024, 50257
GiB = 2**30


@functools.lru_cache(maxsize=None)
def _base_spec(width: int, heads: int):
    from toolkit.recipe.load import load_recipe

    return load_recipe("gpt2-124m", [f"model.n_embd={width}", f"model.n_head={heads}",
                                     "model.activation_checkpointing=true"]).model


def spec_for(args, layers: int):
    """The recipe's model spec at this depth (torch-free)."""
    return dataclasses.replace(_base_spec(args.width, args.heads), n_layer=layers)


def plan(args, layers: int, tier: str, ratio: float, param: str, nvme_ratio: float = 1.0):
    """(parameters, {gpu, host, disk} bytes, predicted seconds) for one run, from the estimator."""
    from toolkit.observe.estimate import estimate_activation_bytes, parameter_count
    from toolkit.observe.tiers import estimate_tiers

    spec = spec_for(args, layers)
    n = parameter_count(spec)
    t = estimate_tiers(n, stage=3, world_size=1, dtype="bf16", offload_optimizer=tier, offload_param=param,
                       offload_ratio=ratio, nvme_ratio=nvme_ratio, state_dtype=args.state_dtype,
                       grad_dtype=args.grad_dtype)
    act = estimate_activation_bytes(spec, micro_batch=args.micro, seq_len=SEQ, dtype="bf16").checkpointed
    disk_s = (t.read + t.written) * (args.warmup + args.steps) / (args.disk_gbps * 1e9)
    k = 6 if args.state_dtype == "bf16" else 12  # bytes of master and moments per offloaded element
    cpu_s = k * n * ratio / 10e9 * (args.warmup + args.steps)  # NOTE: ~10 GB/s of CPU Adam traffic, 28 B/param
    build_s = 20 + 6 * n / 1e9 + t.nvme / (args.disk_gbps * 1e9)
    return n, {"gpu": t.gpu + act, "host": t.cpu, "disk": t.nvme}, build_s + max(disk_s, cpu_s)


def machine(args) -> dict:
    """What this machine offers: GPU bytes, host bytes, free disk under the swap folder."""
    import torch

    if "gpu" in args.assume or args.device != "cuda":  # NOTE: --dry-run --assume plans on a machine without CUDA
        gpu = args.cpu_gpu_gib * GiB
    else:
        gpu = torch.cuda.get_device_properties(0).total_memory
    with open("/proc/meminfo") as f:
        host = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    have = {"gpu": gpu, "host": host, "disk": shutil.disk_usage(args.swap_dir).free}
    for key in have:  # --assume gpu=141,host=128,disk=60 (GiB): plan for another machine (with --dry-run)
        if key in args.assume:
            have[key] = args.assume[key] * GiB
    return have


def fits(args, have: dict, need: dict) -> bool:
    """The estimate under this machine's room (the GPU leaves --gpu-margin-gib for what the estimate omits)."""
    return (need["gpu"] <= have["gpu"] - args.gpu_margin_gib * GiB and need["host"] <= 0.7 * have["host"]
            and need["disk"] <= 0.92 * have["disk"])


def choose_ratio(args, have: dict, layers: int, tier: str, param: str, smallest: bool) -> tuple[float, float] | None:
    """(offload_ratio, nvme_ratio) in steps of 0.05 that fit: the smallest offload_ratio (most on the GPU) or the
    largest, with the largest nvme_ratio (least in CPU memory; 1 unless tier is nvme); None when none does."""
    ratios = [round(0.05 * k, 2) for k in range(1, 21)]
    for ratio in (ratios if smallest else ratios[::-1]):
        for nvme_ratio in (ratios[::-1] if tier == "nvme" else [1.0]):
            if fits(args, have, plan(args, layers, tier, ratio, param, nvme_ratio)[1]):
                return ratio, nvme_ratio
    return None


def largest(args, have: dict) -> tuple[int, float, float] | None:
    """The deepest model (and its two ratios) that fits with the optimizer in swap files, parameters in CPU memory."""
    best = None
    for layers in range(8, 201, 1):
        ratios = choose_ratio(args, have, layers, "nvme", "cpu", smallest=True)
        if ratios is None:
            break
        best = (layers, *ratios)
    return best


def child(args) -> dict:
    """One run in this process: build, warm up, time; the figures."""
    import torch

    from toolkit.observe.memory_monitor import reset_rss_peak, rss_peak_bytes
    from toolkit.recipe.load import load_recipe
    from toolkit.runtime.engine import Engine

    cuda = args.device == "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch.distributed as dist

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1, device_id=device if cuda else None)
    baseline = shutil.disk_usage(args.swap_dir).used
    disk_peak, done = [0], []

    def sample():
        while not done:
            disk_peak[0] = max(disk_peak[0], shutil.disk_usage(args.swap_dir).used - baseline)
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    reset_rss_peak()
    started = time.perf_counter()
    recipe = load_recipe("gpt2-124m", [
        f"model.n_layer={args.layers}", f"model.n_embd={args.width}", f"model.n_head={args.heads}",
        "model.activation_checkpointing=true", "zero.stage=3", f"zero.offload_optimizer={args.tier}",
        f"zero.offload_ratio={args.ratio}", f"zero.nvme_ratio={args.nvme_ratio}", f"zero.offload_param={args.param}",
        f"zero.nvme_path={args.swap_dir}",
        f"batch.micro_batch_per_rank={args.micro}", "batch.grad_accum_steps=1", "precision.dtype=bf16",
        f"data.seq_len={SEQ}", f"training.device={args.device}", "training.max_steps=1000",
        f"optimizer.state_dtype={args.state_dtype}", f"zero.grad_dtype={args.grad_dtype}",
        "training.memory_check=warn", "checkpoint.save_final=false", "logging.tensorboard=false"])
    engine = Engine(recipe)
    print(engine.strategy.describe_tiers(), file=sys.stderr, flush=True)
    build_s = time.perf_counter() - started
    files = engine.strategy.swap_dir.files if engine.strategy.swap_dir is not None else []
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, recipe.data.vocab_size, (args.micro, SEQ + 1), generator=gen).to(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(args.warmup):
        loss = engine.train_batch([tokens]).loss
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    moved = sum(f.bytes_read + f.bytes_written for f in files)
    started = time.perf_counter()
    for _ in range(args.steps):
        loss = engine.train_batch([tokens]).loss
    sync()
    elapsed = time.perf_counter() - started
    moved = sum(f.bytes_read + f.bytes_written for f in files) - moved
    done.append(1)
    sampler.join()
    result = {"layers": args.layers, "tier": args.tier, "ratio": args.ratio, "nvme_ratio": args.nvme_ratio,
              "params": engine.num_parameters,
              "tokens_per_s": args.micro * SEQ * args.steps / elapsed, "s_per_step": elapsed / args.steps,
              "build_s": build_s, "host_peak_gib": rss_peak_bytes() / GiB, "disk_peak_gib": disk_peak[0] / GiB,
              "swap_mb_s": moved / elapsed / 1e6, "loss": float(loss),
              "gpu_peak_gib": torch.cuda.max_memory_allocated() / GiB if cuda else 0.0}
    if engine.strategy.swap_dir is not None:
        engine.strategy.swap_dir.remove()
    dist.destroy_process_group()
    return result


def run_child(args, layers: int, tier: str, ratio: float, nvme_ratio: float, param: str, timeout: float) -> dict:
    """One run in a child process: its figures, or {"error": ...}."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "benchmarks.infinity_gpu", "--child", "--layers", str(layers), "--tier", tier,
               "--ratio", str(ratio), "--nvme-ratio", str(nvme_ratio), "--param", param, "--port", str(port),
               "--swap-dir", args.swap_dir,
               "--width", str(args.width), "--heads", str(args.heads), "--micro", str(args.micro),
               "--state-dtype", args.state_dtype, "--grad-dtype", args.grad_dtype,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "NCCL_NVLS_ENABLE": "0"})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    sys.stderr.write("\n".join(lines[-20:]) + "\n")
    return {"error": (lines[-1] if lines else f"exit {done.returncode}")[:160]}


def parse_runs(text: str) -> list[tuple[str, str, str, float]]:
    """'max:nvme,39:cpu:0.5,24:nvme:0.6:0.5' -> [('max', 'nvme', 'auto', 1.0), ('39', 'cpu', '0.5', 1.0),
    ('24', 'nvme', '0.6', 0.5)]; a ValueError names a bad item."""
    runs = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if (len(parts) not in (2, 3, 4) or not (parts[0] == "max" or parts[0].isdigit())
                or parts[1] not in ("cpu", "nvme")):
            raise ValueError(f"--runs item {item!r}: LAYERS:TIER[:RATIO[:NVME_RATIO]], LAYERS a number or max, "
                             "TIER cpu or nvme")
        ratio = parts[2] if len(parts) >= 3 else "auto"
        nvme_ratio = float(parts[3]) if len(parts) == 4 else 1.0
        if ratio != "auto" and not 0 < float(ratio) <= 1 or not 0 < nvme_ratio <= 1:
            raise ValueError(f"--runs item {item!r}: RATIO in (0, 1] or auto, NVME_RATIO in (0, 1]")
        if nvme_ratio != 1 and parts[1] != "nvme":
            raise ValueError(f"--runs item {item!r}: NVME_RATIO needs TIER nvme")
        runs.append((parts[0], parts[1], ratio, nvme_ratio))
    return runs


def row(args, run: dict, predicted: float, note: str = "") -> str:
    """One markdown row."""
    from toolkit.observe.estimate import format_count

    ratio = f"{run['ratio']}" + (f" (nvme {run['nvme_ratio']})" if run.get("nvme_ratio", 1) != 1 else "")
    head = f"| {run['layers']} x {args.width} | {format_count(run.get('params', 0))} | {run['tier']} | {ratio} "
    if "error" in run or "skipped" in run:
        return head + f"| {run.get('error') or run['skipped']} | | | | | | predicted {predicted:.0f} s |"
    return (head + f"| {run['tokens_per_s']:,.0f} | {run['s_per_step']:.1f} | {run['host_peak_gib']:.1f} "
            f"| {run['disk_peak_gib']:.1f} | {run['swap_mb_s']:,.0f} ({run['swap_mb_s'] / (10 * args.disk_gbps):.0f}% of "
            f"{args.disk_gbps} GB/s) | {run['gpu_peak_gib']:.1f} | build {run['build_s']:.0f} s, predicted "
            f"{predicted:.0f} s{note} |")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.infinity_gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="max:nvme,39:nvme:0.3,39:cpu:0.3,24:nvme:0.3,24:cpu:0.3")
    parser.add_argument("--swap-dir", default="/tmp/toolkit-swap-bench")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--state-dtype", choices=["fp32", "bf16"], default="fp32",
                        help="optimizer.state_dtype: bf16 master and moments (6 bytes an offloaded element, not 12)")
    parser.add_argument("--grad-dtype", choices=["fp32", "bf16"], default="fp32",
                        help="zero.grad_dtype (bf16 needs --state-dtype bf16): a 2-byte gradient shard on the GPU")
    parser.add_argument("--budget-s", type=float, default=540, help="seconds for every run together")
    parser.add_argument("--disk-gbps", type=float, default=1.5, help="the disk's sequential GB/s (dd), for the "
                        "prediction and the comparison")
    parser.add_argument("--gpu-margin-gib", type=float, default=24, help="GPU room the estimate leaves for what it "
                        "omits (gathered units, staging, fragmentation)")
    parser.add_argument("--cpu-gpu-gib", type=float, default=4, help=argparse.SUPPRESS)  # --device cpu: the 'GPU'
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--markdown", default=None, help="append the table here, a row as each run ends")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (and predicted seconds), run nothing")
    parser.add_argument("--assume", default="", help="gpu=GiB,host=GiB,disk=GiB: plan for that machine instead")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for name, kind in (("--layers", int), ("--tier", str), ("--ratio", float), ("--nvme-ratio", float),
                       ("--param", str), ("--port", int)):
        parser.add_argument(name, type=kind, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    try:
        args.assume = {k: float(v) for k, v in (item.split("=") for item in args.assume.split(",") if item)}
    except ValueError:
        parser.error(f"--assume {args.assume!r}: gpu=GiB,host=GiB,disk=GiB")
    os.makedirs(args.swap_dir, exist_ok=True)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    try:
        runs = parse_runs(args.runs)
    except ValueError as exc:
        parser.error(str(exc))
    have = machine(args)
    print(f"machine: GPU {have['gpu'] / GiB:.0f} GiB, host {have['host'] / GiB:.0f} GiB, "
          f"{have['disk'] / GiB:.0f} GiB free under {args.swap_dir}", flush=True)
    top = largest(args, have)
    from toolkit.observe.estimate import parameter_count

    goal = 25e9 if args.state_dtype == "bf16" else 13e9  # issue 35's goal with bf16 states; issue 21's before
    g_layers = next((n for n in range(8, 400) if parameter_count(spec_for(args, n)) >= goal), None)
    if g_layers is not None:
        g_ratios = choose_ratio(args, have, g_layers, "nvme", "cpu", smallest=True)
        print(f"{goal / 1e9:.0f}B goal: {g_layers} layers ({parameter_count(spec_for(args, g_layers)) / 1e9:.2f}B) "
              + (f"fits (offload_ratio {g_ratios[0]}, nvme_ratio {g_ratios[1]})" if g_ratios else
                 f"does not fit this machine by the estimate (GPU: grads {2 if args.grad_dtype == 'bf16' else 4} B/param + "
                 "the optimizer not offloaded; "
                 f"host and disk: {6 if args.state_dtype == 'bf16' else 12} B/param of the offloaded optimizer between them)"), flush=True)
    if top:
        print(f"largest that fits: {top[0]} layers, {parameter_count(spec_for(args, top[0])) / 1e9:.2f}B, "
              f"offload_ratio {top[1]}, nvme_ratio {top[2]}, parameters in CPU memory; estimate "
              f"{plan(args, top[0], 'nvme', top[1], 'cpu', top[2])[1]}", flush=True)
    lines = [f"### ZeRO-Infinity, width {args.width}, micro batch {args.micro} x {SEQ}, bf16, activation "
             f"checkpointing, stage 3, optimizer.state_dtype {args.state_dtype}, zero.grad_dtype {args.grad_dtype}; "
             f"{args.warmup} warm-up + "
             f"{args.steps} timed step(s)", "",
             "| model | params | optimizer | ratio | tokens/s | s/step | host peak GiB | disk peak GiB "
             "| swap MB/s | GPU peak GiB | notes |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n".join(lines) + "\n")
    started, failed = time.perf_counter(), False
    for layers_text, tier, ratio_text, nvme_ratio in runs:
        if layers_text == "max":
            if top is None:
                continue
            layers, ratio, nvme_ratio, param = *top, "cpu"
        else:
            layers, param = int(layers_text), "none"
            if ratio_text == "auto":  # the pair's common ratio: as much as the disk takes
                ratio = (choose_ratio(args, have, layers, "nvme", "none", smallest=False) or (0.05,))[0]
            else:
                ratio = float(ratio_text)
        params, need, predicted = plan(args, layers, tier, ratio, param, nvme_ratio)
        left = args.budget_s - (time.perf_counter() - started)
        run = {"layers": layers, "tier": tier + (" (params cpu)" if param == "cpu" else ""), "ratio": ratio,
               "nvme_ratio": nvme_ratio, "params": params}
        if args.dry_run:
            run["skipped"] = f"dry run: gpu {need['gpu'] / GiB:.0f}, host {need['host'] / GiB:.1f}, disk " \
                             f"{need['disk'] / GiB:.0f} GiB" + ("" if fits(args, have, need) else ", does not fit")
            started -= predicted  # NOTE: as if it had run, so the budget column shows what a real call would skip
        elif predicted > left:
            run["skipped"] = f"skipped: {left:.0f} s left"
        elif not fits(args, have, need):
            run["skipped"] = "skipped: does not fit by the estimate"
        else:
            got = run_child(args, layers, tier, ratio, nvme_ratio, param, timeout=left)
            run.update(got)
            failed |= "error" in got
        run["tier"] = tier + (" (params cpu)" if param == "cpu" else "")
        line = row(args, run, predicted)
        print(line, flush=True)
        lines.append(line)
        if args.markdown:
            with open(args.markdown, "a") as f:
                f.write(line + "\n")
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
