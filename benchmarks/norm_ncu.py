"""Nsight Compute target (not a test): RMSNorm 2048's forward+backward, torch.compile's and ours, once
each inside a profiler range, everything compiled and warmed up before it.

    ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats ... \\
        python -m benchmarks.norm_ncu            (gpu_check.sh stage `ncu`)
"""
from __future__ import annotations

import sys

import torch

from benchmarks.norm_tune import CASES, compiled_cases, inputs
from toolkit.ops import loader


def main() -> int:
    case = next(c for c in CASES if c[2])  # the RMSNorm case
    _, cols, rms = case
    x, w, b, dy = inputs(cols, rms)
    eps = 1e-6
    (_, both), = compiled_cases([(x, w, b, dy, eps, None)], [case])
    module = loader.load_extension("norm")

    def ours():
        _, mean, rstd = module.norm_fwd(x, w, b, eps, rms, 1)
        module.norm_bwd(dy, x, w, mean, rstd, rms)

    for _ in range(3):
        both()
        ours()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    both()
    ours()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
