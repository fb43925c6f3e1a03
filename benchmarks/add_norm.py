"""Benchmark (not a test): the residual add fused into the norm (kernels/fused_norm*.cu's residual path, issue 33)
against its parts, GPU time of the kernels alone (benchmarks.kernels.gpu_ms, the profiler's kernel durations).

At the recipes' shapes, bf16 (the residual stream at ZeRO stage 1): forward, torch's add then the toolkit's norm
against add_norm_fwd; backward, the norm's backward then torch's add of the other gradient against norm_bwd with
that gradient. Also the bytes each moves and the bandwidth that implies (the bound it should meet).

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
        eps, code = 1e-5, 1
        s, y, mean, rstd = module.add_norm_fwd(x, r, w, b, eps, rms, code)
        parts_fwd = gpu_ms(lambda: module.norm_fwd(x + r, w, b, eps, rms, code), iters=20)
        fused_fwd = gpu_ms(lambda: module.add_norm_fwd(x, r, w, b, eps, rms, code), iters=20)
        parts_bwd = gpu_ms(lambda: module.norm_bwd(dy, s, w, mean, rstd, rms)[0] + ds, iters=20)
        fused_bwd = gpu_ms(lambda: module.norm_bwd(dy, s, w, mean, rstd, rms, ds), iters=20)
        unit = n * cols * 2  # one pass over a bf16 [rows, cols] tensor
        # bytes: forward reads x, r and writes s, y (parts: the add's 3 passes, the norm's 2); backward reads dy,
        # s, ds and writes dx (parts: the norm's 3, the add's 3)
        fused_bytes = (4 * unit, 4 * unit)
        out.append([name, f"{parts_fwd:.3f}", f"{fused_fwd:.3f}", f"{parts_fwd / fused_fwd:.2f}x",
                    f"{fused_bytes[0] / fused_fwd / 1e6:.0f}",
                    f"{parts_bwd:.3f}", f"{fused_bwd:.3f}", f"{parts_bwd / fused_bwd:.2f}x",
                    f"{fused_bytes[1] / fused_bwd / 1e6:.0f}"])
        del x, r, dy, ds, s, y
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    module = loader.load_extension("norm")
    text = table(f"Residual add + norm, {torch.cuda.get_device_name()}, GPU ms per call (kernels only)",
                 ["shape", "add, then norm", "fused", "speed-up", "fused GB/s", "norm bwd, then add", "fused bwd",
                  "speed-up", "fused bwd GB/s"], rows(module))
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
