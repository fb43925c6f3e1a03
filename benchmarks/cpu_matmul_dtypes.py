"""Benchmark (not a test): CPU matmuls and a CPU training step in fp32 against bf16, on this machine.

Backs the warning of toolkit/runtime/cpu_matmul.py: where torch has no oneDNN bf16 matmul (an AVX2-only CPU),
bf16 takes torch's generic kernel. Prints torch's answer, the CPU capability, the ms of square matmuls per dtype
(best of --repeats) and the ms of a quickstart training step with precision.dtype fp32 and bf16 (best of 5 after 3
warm-up steps), as one markdown table:

    python -m benchmarks.cpu_matmul_dtypes [--sides 64,256,1024] [--markdown FILE]
"""
from __future__ import annotations

import argparse
import math
import platform
import time

import torch

import toolkit
from toolkit.data.batches import BatchStream, Dataset
from toolkit.runtime.cpu_matmul import has_onednn_bf16, matmul_ms


def step_ms(dtype: str, steps: int = 5) -> float:
    """Best ms of one quickstart optimizer step on the CPU in `dtype` (3 warm-up steps first)."""
    recipe = toolkit.load_recipe("quickstart", ["training.device=cpu", f"precision.dtype={dtype}"])
    engine = toolkit.initialize(recipe)
    stream = BatchStream(Dataset(recipe.data).train, recipe.batch, rank=0, seed=recipe.training.seed)
    for _ in range(3):
        engine.train_batch(stream.next_step())
    best = math.inf
    for _ in range(steps):
        started = time.perf_counter()
        engine.train_batch(stream.next_step())
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_matmul_dtypes", description=__doc__.splitlines()[0])
    parser.add_argument("--sides", default="64,256,1024")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    print(f"cpu {platform.processor() or platform.machine()}, capability "
          f"{torch.backends.cpu.get_cpu_capability()}, oneDNN bf16 {has_onednn_bf16()}, "
          f"{torch.get_num_threads()} torch threads, torch {torch.__version__}")
    rows = []
    for side in (int(s) for s in args.sides.split(",")):
        fp32, bf16 = (matmul_ms(d, side, args.repeats) for d in (torch.float32, torch.bfloat16))
        rows.append((f"matmul {side}x{side} @ {side}x{side}", fp32, bf16))
    rows.append(("quickstart optimizer step (toolkit.initialize, train_batch)", step_ms("fp32"), step_ms("bf16")))
    lines = ["| case | fp32 ms | bf16 ms | bf16 / fp32 |", "| --- | --- | --- | --- |"]
    lines += [f"| {case} | {a:.3f} | {b:.3f} | {b / a:.1f}x |" for case, a, b in rows]
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
