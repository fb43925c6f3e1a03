"""Profile (not a test): where the GPU time of one GPT-2 training step goes, per configuration.

Runs the configurations of benchmarks/end_to_end.py, and after 3 warm-up steps records --steps steps
with torch.profiler. Prints, per configuration, wall ms per step, GPU kernel ms per step (busy
time) and the kernels grouped into families (GEMM, attention, norm, GELU, cross-entropy, AdamW,
other elementwise, ...), then the GPU time by the op that launched it (the innermost aten op with its
input shapes, its caller, and the autograd node whose backward ran it): where a family's kernels come
from; then one table of the families side by side, so a gap between two configurations shows up as the
family that holds it.

    python -m benchmarks.profile_e2e --size 1.5b --only "toolkit fused compiled,plain compiled" [--markdown FILE]
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.end_to_end import CONFIGS, MICRO, SEQ

# First match wins: kernel-name patterns (lower case) -> family. Inductor names a fused kernel after
# every op in it, so the order matters (a GELU kernel also holds a `_to_copy`).
FAMILIES = [
    ("attention", r"flash|fmha|attention|sdpa|efficient_attention"),
    ("gemm", r"gemm|sm90_xmma|cutlass|nvjet|cublas|matmul|splitk"),
    ("adamw", r"adam"),
    ("cross-entropy", r"cross_entropy|nll|log_softmax|softmax"),
    ("grad norm / clip", r"grad_norm|grad_sumsq|multi_tensor_apply|foreach|l2norm"),
    ("norm", r"norm|column_sum"),
    ("gelu", r"gelu|tanh"),  # Inductor's GPT-2 GELU: triton_poi_fused__to_copy_add_mul_pow_tanh*
    ("copy / cast", r"copy|cast|convert|memcpy"),
    ("reduce", r"reduce"),
    ("fill", r"fill|zero|memset"),
    ("triton (other)", r"^triton"),
]


def family(name: str) -> str:
    lowered = name.lower()
    for fam, pattern in FAMILIES:
        if re.search(pattern, lowered):
            return fam
    return "other"


def profile(model, step, steps: int) -> dict:
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, (MICRO, SEQ + 1), device="cuda") for _ in range(4)]
    for i in range(3):
        step(batches[i % 4])
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        started = time.perf_counter()
        for i in range(steps):
            step(batches[i % 4])
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    by_name: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_name[event.name] += event.device_time_total / 1e3  # ms
            counts[event.name] += 1
    by_family: dict[str, float] = defaultdict(float)
    for name, ms in by_name.items():
        by_family[family(name)] += ms
    by_op: dict[tuple[str, str], float] = defaultdict(float)
    op_counts: dict[tuple[str, str], int] = defaultdict(int)
    for event in prof.events():
        for kernel in getattr(event, "kernels", ()):  # the kernels this CPU op launched itself
            key = (family(kernel.name), launched_by(event))
            by_op[key] += kernel.duration / 1e3
            op_counts[key] += 1
    return {"wall ms": 1e3 * wall / steps, "gpu ms": sum(by_name.values()) / steps,
            "families": {k: v / steps for k, v in by_family.items()},
            "top": sorted(((ms / steps, counts[n] / steps, n) for n, ms in by_name.items()), reverse=True)[:25],
            "ops": sorted(((ms / steps, op_counts[k] / steps, k) for k, ms in by_op.items()), reverse=True)[:40]}


def launched_by(event) -> str:
    """'aten::add_ [[16, 1024, 1600], [16, 1024, 1600], []] < aten::foo | backward of AddBackward0': the op that
    launched a kernel, with its input shapes, its caller, and the autograd node it ran for (or 'forward')."""
    shapes = [list(s) for s in (event.input_shapes or [])][:3]
    names, parent, node = [], event.cpu_parent, "forward"
    while parent is not None:
        if parent.name.startswith("autograd::engine::evaluate_function: "):
            node = "backward of " + parent.name.split(": ", 1)[1]
            break
        if len(names) < 2 and parent.name != event.name:
            names.append(parent.name)
        parent = parent.cpu_parent
    return " < ".join([f"{event.name} {shapes}"] + names) + f" | {node}"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="124m")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", default="toolkit fused compiled,plain compiled")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    results = {}
    for name in args.only.split(","):
        torch._dynamo.reset()
        model, step, _ = CONFIGS[name](args.size, args.steps)
        results[name] = profile(model, step, args.steps)
        r = results[name]
        print(f"\n## {name}: wall {r['wall ms']:.1f} ms/step, GPU kernels {r['gpu ms']:.1f} ms/step", flush=True)
        for ms, count, kernel in r["top"]:
            print(f"  {ms:8.3f} ms  x{count:5.0f}  [{family(kernel)}] {kernel[:150]}", flush=True)
        print("  by the op that launched it:", flush=True)
        for ms, count, (fam, op) in r["ops"]:
            print(f"  {ms:8.3f} ms  x{count:5.0f}  [{fam}] {op[:240]}", flush=True)
        del model, step
        torch.cuda.empty_cache()
    names = list(results)
    fams = sorted({f for r in results.values() for f in r["families"]},
                  key=lambda f: -max(r["families"].get(f, 0.0) for r in results.values()))
    lines = [f"GPT-2 {args.size}, seq {SEQ}, micro batch {MICRO}, bf16; ms per step ({args.steps} profiled steps); "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}", "",
             "| family | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for f in fams:
        lines.append(f"| {f} | " + " | ".join(f"{results[n]['families'].get(f, 0.0):.2f}" for n in names) + " |")
    lines.append("| all GPU kernels | " + " | ".join(f"{results[n]['gpu ms']:.1f}" for n in names) + " |")
    lines.append("| wall | " + " | ".join(f"{results[n]['wall ms']:.1f}" for n in names) + " |")
    print("\n" + "\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
