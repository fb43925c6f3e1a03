"""Benchmark (not a test): the residual add's gradient fused into the norm's backward (kernels/fused_norm_backward.cu's
residual variant, issue 33) against its parts, GPU time of the kernels alone (benchmarks.kernels.gpu_ms, the
profiler's kernel durations).

At the recipes' shapes, bf16 (the residual stream at ZeRO stage 1): the norm's backward and then torch's add of the
sum's other gradient, against norm_bwd given that gradient; the bytes the fused one moves (reads dy, x and the
gradient, writes dx) and the bandwidth that implies.

    python -m benchmarks.add_norm [--markdown FILE]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.kernels import gpu_ms, table
from toolkit.ops import loader

SHAPES = (("gpt2-124m micro 32, LayerNorm", 32 * 1024, 768, False),
          ("gpt2-1.5b micro 16, LayerNorm", 16 * 1024, 1600, False),
          ("llama-1b micro 16, RMSNorm", 16 * 1024, 2048, True))


def rows(module) -> list[list]:
    out = []
    for name, n, cols, rms in SHAPES:
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        x, r, dy, ds = (torch.randn(n, cols, **bf16) for _ in range(4))
        w, b = torch.randn(cols, device="cuda"), None if rms else torch.randn(cols, device="cuda")
        eps, code = 1e-5, -1
        s = x + r
        _, mean, rstd = module.norm_fwd(s, w, b, eps, rms, code)
        parts_bwd = gpu_ms(lambda: module.norm_bwd(dy, s, w, mean, rstd, rms)[0] + ds, iters=20)
        fused_bwd = gpu_ms(lambda: module.norm_bwd(dy, s, w, mean, rstd, rms, ds), iters=20)
        moved = 4 * n * cols * 2  # bf16 [rows, cols]: dy, x and ds read, dx written
        out.append([name, f"{parts_bwd:.3f}", f"{fused_bwd:.3f}", f"{parts_bwd / fused_bwd:.2f}x",
                    f"{moved / fused_bwd / 1e6:.0f}"])
        del x, r, dy, ds, s
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    module = loader.load_extension("norm")
    text = table(f"Norm backward with the residual gradient, {torch.cuda.get_device_name()}, GPU ms per call (kernels)",
                 ["shape", "norm bwd, then add", "fused", "speed-up", "fused GB/s"], rows(module))
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
