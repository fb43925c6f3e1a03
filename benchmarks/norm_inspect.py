"""Inspection (not a test): how torch.compile and the shipped kernels launch the benchmark's norms.

For each of benchmarks/norm_tune.py's cases, torch.compile's forward (no grad), its forward+backward
and the shipped kernels' forward and backward run under the profiler; the table lists every
kernel with its GPU us per call, grid, block, registers a thread and shared memory (from the
profiler's trace). Inductor's generated code for the forward+backward of each case goes to
--code-dir, so its reduction shapes, warps and cache hints can be read beside ours.

    python -m benchmarks.norm_inspect [--markdown FILE] [--code-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.kernels import table
from benchmarks.norm_tune import CASES, compiled_cases, inputs
from toolkit.ops import loader

ITERS = 20


def launches(fn) -> list[dict]:
    """Per kernel of one call of fn: name, us per call, grid, block, registers, shared memory."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.loads(Path(trace.name).read_text())["traceEvents"]
    total: dict[str, float] = defaultdict(float)
    shape: dict[str, dict] = {}
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memset", "gpu_memcpy"):
            continue
        total[e["name"]] += e.get("dur", 0.0)
        shape.setdefault(e["name"], e.get("args", {}))
    return [{"name": name, "us": us / ITERS, "grid": shape[name].get("grid"), "block": shape[name].get("block"),
             "registers": shape[name].get("registers per thread"), "smem": shape[name].get("shared memory")}
            for name, us in total.items()]


def compiled_with_code(case_index: int, cases_data) -> tuple:
    """torch.compile's (forward, forward+backward) for one case, and Inductor's code for them."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    fns, code = run_and_get_code(lambda: compiled_cases([cases_data[case_index]], [CASES[case_index]]))
    return fns[0], "\n\n# ----- next module -----\n\n".join(code)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.norm_inspect", description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", help="append the table to this file")
    parser.add_argument("--code-dir", help="write Inductor's code per case here")
    args = parser.parse_args()
    module = loader.load_extension("norm")
    cases_data = []
    for _, cols, rms in CASES:
        x, w, b, dy = inputs(cols, rms)
        cases_data.append((x, w, b, dy, 1e-6 if rms else 1e-5, None))
    rows = []
    for i, (label, _, rms) in enumerate(CASES):
        x, w, b, dy, eps, _ = cases_data[i]
        (forward, both), code = compiled_with_code(i, cases_data)
        _, mean, rstd = module.norm_fwd(x, w, b, eps, rms, 1)
        runs = [("torch.compile forward", forward), ("torch.compile forward+backward", both),
                ("toolkit forward", lambda: module.norm_fwd(x, w, b, eps, rms, 1)),
                ("toolkit backward", lambda: module.norm_bwd(dy, x, w, mean, rstd, rms))]
        for what, fn in runs:
            for k in launches(fn):
                rows.append([label, what, k["name"][:90], f"{k['us']:.1f}", k["grid"], k["block"], k["registers"],
                             k["smem"]])
        if args.code_dir:
            Path(args.code_dir).mkdir(parents=True, exist_ok=True)
            name = label.lower().replace(" ", "_")
            Path(args.code_dir, f"inductor_{name}.py").write_text(code)
    text = table(f"Norm launches, 16384 rows, x fp32, y bf16, dy bf16 (GPU {torch.cuda.get_device_name()}, "
                 f"torch {torch.__version__}, {ITERS} calls)",
                 ["case", "run", "kernel", "us/call", "grid", "block", "registers", "shared B"], rows)
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
