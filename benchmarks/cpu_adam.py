"""Benchmark (not a test): the toolkit's CPU Adam kernel against torch's CPU AdamW.

One AdamW step over a GPT-2 124M-shaped parameter set (the tensors of
transformers' GPT2LMHeadModel, 124,439,808 parameters, wte tied), fp32, on the
CPU, timed as the median of --steps rounds (each round steps every implementation
once, so machine noise hits all alike) after --warmup steps each:

  toolkit cpu_adam   kernels/cpu_adam.cpp on one flat buffer (how ZeRO-Offload holds a shard)
  toolkit per-tensor the same kernel called once per tensor (no flat buffer)
  torch fused        torch.optim.AdamW(fused=True)   (torch's fastest CPU AdamW)
  torch fused (flat) torch._fused_adamw_ on the same one flat buffer (kernel against kernel)
and ZeRO-Offload's whole host step on a flat shard: AdamW, the bf16 copy of the new weights
for the device, the gradient zeroed for the next accumulation:
  toolkit offload step   one kernel pass (param_bf16=..., zero_grad=True)
  torch offload step     _fused_adamw_, then bf16.copy_(p), then g.zero_()
  toolkit bf16 states    optimizer.state_dtype bf16 offloaded: bf16 master and moments, stochastic rounding
                         (16 bytes per parameter move, not 28: its GB/s column still counts 28)
  bf16 states + copy     the same with the device's bf16 copy written in the kernel's pass, against a copy_ after
                         it (what the offloaded step did before), and delayed_extrapolated's copy both ways
  torch foreach      torch.optim.AdamW(foreach=True)
  torch for-loop     torch.optim.AdamW() default on the CPU (single-tensor)

    python -m benchmarks.cpu_adam [--steps 10] [--threads N] [--skip-forloop] [--only bf16,offload]
    python -m benchmarks.cpu_adam --against OTHER.so   this build against another build of the
        kernel (its cached library, e.g. of an older source): first whether the two give bit-identical
        parameters, moments and bf16 copies over 5 steps, then the flat and offload steps of both,
        interleaved, beside torch fused

Prints one table (machine, threads; median and best ms per step, GB/s of optimizer
traffic at 28 bytes per parameter, ratios to torch fused). On a shared machine the
best round is the steadier figure. Current figures: benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

from toolkit.ops.cpu_adam import cpu_adam_status, load_cpu_adam

LR, BETAS, EPS, WD = 6e-4, (0.9, 0.95), 1e-8, 0.1


def gpt2_124m_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of GPT-2 124M (vocab 50257, 1024 positions, 12 x 768), wte counted once."""
    v, t, h, n = 50257, 1024, 768, 12
    shapes = [(v, h), (t, h)]
    for _ in range(n):
        shapes += [(h,), (h,), (h, 3 * h), (3 * h,), (h, h), (h,), (h,), (h,), (h, 4 * h), (4 * h,), (4 * h, h), (h,)]
    return shapes + [(h,), (h,)]


def time_rounds(steps: dict, rounds: int, warmup: int) -> dict[str, float]:
    """Median seconds per step of each implementation, the implementations interleaved round by round."""
    # NOTE: interleaved, so a noisy neighbour or frequency change hits every implementation alike.
    for step in steps.values():
        for _ in range(warmup):
            step()
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def torch_adamw(shapes, **kind):
    params = [torch.randn(s).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kind)
    return opt.step


def toolkit_flat(module, numel: int):
    p, g, m, v = torch.randn(numel), torch.randn(numel), torch.zeros(numel), torch.zeros(numel)
    count = [0]

    def step():
        count[0] += 1
        module.adamw_step(p, g, m, v, count[0], LR, BETAS[0], BETAS[1], EPS, WD)
    return step


def torch_fused_flat(numel: int):
    p, g, m, v = torch.randn(numel), torch.randn(numel), torch.zeros(numel), torch.zeros(numel)
    step = torch.zeros(())

    def run():
        step.add_(1)  # as torch.optim.AdamW does before the kernel (a step of 0 divides by zero)
        torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=LR, beta1=BETAS[0], beta2=BETAS[1],
                            weight_decay=WD, eps=EPS, amsgrad=False, maximize=False)
    return run


def offload_step(numel: int, module=None):
    p, g, m, v = torch.randn(numel), torch.randn(numel), torch.zeros(numel), torch.zeros(numel)
    out, step, count = torch.empty(numel, dtype=torch.bfloat16), torch.zeros(()), [0]

    def toolkit():
        count[0] += 1
        module.adamw_step(p, g, m, v, count[0], LR, BETAS[0], BETAS[1], EPS, WD, out, True)

    def torch_steps():
        step.add_(1)
        torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=LR, beta1=BETAS[0], beta2=BETAS[1],
                            weight_decay=WD, eps=EPS, amsgrad=False, maximize=False)
        out.copy_(p)
        g.zero_()
    return toolkit if module is not None else torch_steps


def bf16_states_step(numel: int, module, copy: str | None = None):
    """optimizer.state_dtype bf16 offloaded: the kernel's bf16 master and moments, fp32 gradient, in place; `copy`:
    the new weights also written to a send buffer in the kernel's pass ("kernel") or by a copy after it ("torch")."""
    p, g = torch.randn(numel).bfloat16(), torch.randn(numel) * 1e-3
    m, v, count = torch.zeros(numel, dtype=torch.bfloat16), torch.zeros(numel, dtype=torch.bfloat16), [0]
    out = torch.empty(numel, dtype=torch.bfloat16)

    def step():
        count[0] += 1
        module.adamw_step_bf16(p, g, m, v, count[0], LR, BETAS[0], BETAS[1], EPS, WD, 1234, 0,
                               out if copy == "kernel" else None)
        if copy == "torch":
            out.copy_(p)
    return step


def extrapolated_step(numel: int, kernel: bool, state_dtype: str = "fp32"):
    """delayed_extrapolated's offload step of one piece through ShardedAdamW.update: the bf16 copy is the weights
    one update ahead, written by the kernel in its pass (kernel) or by torch ops through a scratch (not)."""
    from toolkit.recipe.load import load_recipe
    from toolkit.runtime.zero.adamw import ShardedAdamW

    precision = "bf16" if state_dtype == "bf16" else "fp32"
    spec = load_recipe("quickstart", [f"optimizer.state_dtype={state_dtype}", f"precision.dtype={precision}"]).optimizer
    optimizer = ShardedAdamW(spec, numel, torch.device("cpu"), offload=True)
    if not kernel:
        optimizer.mode = "fused"  # ShardedAdamW.update: the scratch path (bf16 states still step in the kernel)
        if state_dtype == "fp32":
            optimizer.kernel = None
    p, g = torch.randn(numel), torch.randn(numel)
    if state_dtype == "bf16":
        p, g = p.bfloat16(), g * 1e-3
    out = torch.empty(numel, dtype=torch.bfloat16)

    def step():
        optimizer.begin_step()
        optimizer.update(True, p, g, optimizer.exp_avg, optimizer.exp_avg_sq, out, extrapolate=True)
    return step


def toolkit_per_tensor(module, shapes):
    tensors = [(torch.randn(s), torch.randn(s), torch.zeros(s), torch.zeros(s)) for s in shapes]
    count = [0]

    def step():
        count[0] += 1
        for p, g, m, v in tensors:
            module.adamw_step(p, g, m, v, count[0], LR, BETAS[0], BETAS[1], EPS, WD)
    return step


def load_library(path: str):
    """Another build of kernels/cpu_adam.cpp, imported from its library file (the module is named by its stem)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(Path(path).name.split(".")[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bit_identical(a, b, numel: int = 1_000_003) -> bool:
    """Whether two builds leave the same bits in parameters, moments, bf16 copies and gradients over 5 steps."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(numel, generator=gen)
    states = [(start.clone(), torch.zeros(numel), torch.zeros(numel), torch.empty(numel, dtype=torch.bfloat16),
               torch.empty(numel)) for _ in (a, b)]
    for step in range(1, 6):
        grad = torch.randn(numel, generator=gen) * 10.0 ** (step - 3)
        for module, (p, m, v, out, g) in zip((a, b), states):
            g.copy_(grad)
            module.adamw_step(p, g, m, v, step, LR, BETAS[0], BETAS[1], EPS, WD, out, step % 2 == 0)
    return all(torch.equal(x, y) for x, y in zip(*states))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_adam", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    parser.add_argument("--skip-forloop", action="store_true", help="skip torch's slow single-tensor AdamW")
    parser.add_argument("--against", metavar="OTHER.so", help="time this build against another build's library")
    parser.add_argument("--only", metavar="WORDS", type=lambda text: text.split(","),
                        help="only the rows whose name contains one of these comma-separated words (and torch "
                             "fused, the baseline): all rows at once need more than 23 GB")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    module = load_cpu_adam()
    if module is None:
        sys.exit(f"the kernel did not build: {cpu_adam_status().reason}")
    shapes = gpt2_124m_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    torch.manual_seed(0)
    runs = [("toolkit cpu_adam (flat)", lambda: toolkit_flat(module, numel)),
            ("toolkit cpu_adam (per tensor)", lambda: toolkit_per_tensor(module, shapes)),
            ("torch AdamW fused=True", lambda: torch_adamw(shapes, fused=True)),
            ("torch _fused_adamw_ (flat)", lambda: torch_fused_flat(numel)),
            ("toolkit offload step (1 pass)", lambda: offload_step(numel, module)),
            ("torch offload step (3 passes)", lambda: offload_step(numel)),
            ("toolkit bf16 states step", lambda: bf16_states_step(numel, module)),
            ("extrapolated, kernel (1 pass)", lambda: extrapolated_step(numel, kernel=True)),
            ("extrapolated, torch ops", lambda: extrapolated_step(numel, kernel=False)),
            ("bf16 states + copy (1 pass)", lambda: bf16_states_step(numel, module, copy="kernel")),
            ("bf16 states, then copy_", lambda: bf16_states_step(numel, module, copy="torch")),
            ("bf16 extrapolated (1 pass)", lambda: extrapolated_step(numel, kernel=True, state_dtype="bf16")),
            ("bf16 extrapolated, torch ops", lambda: extrapolated_step(numel, kernel=False, state_dtype="bf16")),
            ("torch AdamW foreach=True", lambda: torch_adamw(shapes, foreach=True))]
    if not args.skip_forloop:
        runs.append(("torch AdamW for-loop", lambda: torch_adamw(shapes, foreach=False)))
    if args.against:  # NOTE: only the flat runs of both builds, beside torch fused: all runs at once need ~20 GB
        other = load_library(args.against)
        print(f"against {args.against}: bit-identical results over 5 steps: "
              f"{'yes' if bit_identical(module, other) else 'NO'}")
        runs = [runs[0], ("other build (flat)", lambda: toolkit_flat(other, numel)), runs[2], runs[4],
                ("other build offload step", lambda: offload_step(numel, other)), runs[6],
                ("other build bf16 states step", lambda: bf16_states_step(numel, other))]
    if args.only:
        runs = [(name, make) for name, make in runs
                if name == "torch AdamW fused=True" or any(word in name for word in args.only)]
    steps = {name: make() for name, make in runs}
    results = time_rounds(steps, args.steps, args.warmup)
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"machine: {cpu}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} torch threads; {cpu_adam_status().describe()}")
    print(f"parameters: {numel:,} fp32 (GPT-2 124M shapes, {len(shapes)} tensors); "
          f"median of {args.steps} interleaved rounds after {args.warmup} warm-up steps")
    base, base_min = results["torch AdamW fused=True"]
    print(f"{'implementation':<32} {'median ms':>9} {'GB/s':>6} {'vs fused':>9} {'best ms':>8} {'vs fused':>9}")
    for name, (seconds, best) in results.items():
        gbs = 28 * numel / seconds / 1e9  # read p, g, m, v (16 B), write p, m, v (12 B)
        print(f"{name:<32} {seconds * 1e3:9.1f} {gbs:6.1f} {base / seconds:8.2f}x {best * 1e3:8.1f} "
              f"{base_min / best:8.2f}x")


if __name__ == "__main__":
    main()
