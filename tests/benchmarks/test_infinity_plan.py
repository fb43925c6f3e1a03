"""benchmarks/infinity_gpu.py's run list and plan (torch-free, no GPU): what the H200 calls ran."""
import argparse

import pytest

from benchmarks import infinity_gpu

GiB = 2**30
H200 = {"gpu": 140 * GiB, "host": 126 * GiB, "disk": 64 * GiB}  # what the device reported (RESULTS.md)


def _args(**over):
    return argparse.Namespace(**{"width": 4096, "heads": 32, "micro": 4, "steps": 1, "warmup": 1, "disk_gbps": 1.5,
                                 "gpu_margin_gib": 24, "state_dtype": "fp32", "grad_dtype": "fp32", **over})


def test_runs_parse_with_an_optional_nvme_ratio_and_bad_items_are_named():
    assert infinity_gpu.parse_runs("max:nvme,39:cpu:0.3,24:nvme:0.6:0.5") == [
        ("max", "nvme", "auto", 1.0), ("39", "cpu", "0.3", 1.0), ("24", "nvme", "0.6", 0.5)]
    for bad in ("24:cpu:0.5:0.5", "24:nvme:0.5:0", "x:nvme", "24:disk", "24:nvme:1.5"):
        with pytest.raises(ValueError, match="--runs item"):
            infinity_gpu.parse_runs(bad)


def test_the_h200_plan_needs_the_cpu_memory_tier_for_13b():
    """Every offloaded state on the 64 GiB disk stops the model below 13B; splitting the offloaded optimizer
    with CPU memory (nvme_ratio < 1) fits past it, within each tier's room."""
    args = _args()
    layers, ratio, nvme_ratio = infinity_gpu.largest(args, H200)
    assert nvme_ratio < 1 and layers >= 64  # 64 layers of width 4096: 13.10B
    params, need, _ = infinity_gpu.plan(args, layers, "nvme", ratio, "cpu", nvme_ratio)
    assert params >= 13e9 and infinity_gpu.fits(args, H200, need)
    disk_only = [n for n in range(40, 80)
                 if any(infinity_gpu.fits(args, H200, infinity_gpu.plan(args, n, "nvme", r / 20, "cpu")[1])
                        for r in range(1, 21))]
    assert max(disk_only) < 64


def test_on_the_h200_25b_fits_only_with_bf16_states_and_a_bf16_gradient_shard():
    """Issue 35's goal by the same planner and margins: bf16 states alone stop short of 25B (the fp32 gradient
    shard, 4 bytes a parameter on the GPU, leaves too little of the optimizer there); with the bf16 shard the
    deepest fit passes 25B (RESULTS.md: 23.97B and 28.20B)."""
    bf16 = infinity_gpu.largest(_args(state_dtype="bf16"), H200)
    both = infinity_gpu.largest(_args(state_dtype="bf16", grad_dtype="bf16"), H200)
    size = {name: infinity_gpu.plan(_args(), fit[0], "nvme", fit[1], "cpu", fit[2])[0]
            for name, fit in (("bf16", bf16), ("both", both))}
    assert 20e9 < size["bf16"] < 25e9 < size["both"], size
