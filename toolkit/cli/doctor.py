"""`toolkit doctor`: what this machine offers a run, and which fast paths are on.

Here: the distributed section (torch.distributed backends gloo, NCCL with its
version, MPI; how to launch; the CPU's cores and SIMD). The environment comes from
toolkit/cli/main.py; every kernel's line, the CPU Adam kernel of ZeRO-Offload
included, from toolkit/ops/loader.py (doctor_lines).
"""
from __future__ import annotations

import os
import platform

from toolkit.runtime.cpu_threads import doctor_line as cpu_threads_line


def cpu_name() -> str:
    """The CPU's model name (Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return ", ".join(x for x in ("avx512f", "avx512_bf16", "avx2", "fma") if x in flags) or "none"
    except OSError:
        pass
    return "unknown"


def distributed_lines() -> list[str]:
    """torch.distributed backends (gloo, NCCL with its version, MPI), how to launch, and the CPU."""
    import torch
    import torch.distributed as dist

    from toolkit.runtime.cpu_matmul import describe_bf16_matmuls

    lines = []
    if not dist.is_available():
        lines.append("torch.distributed unavailable in this build: one process only")
    else:
        nccl = dist.is_nccl_available()
        version = ""
        if nccl:
            try:
                version = " " + ".".join(map(str, torch.cuda.nccl.version()))
            except Exception:  # a CUDA build without a usable NCCL library
                version = " (version unknown)"
        lines.append(f"gloo {'yes' if dist.is_gloo_available() else 'no'} (CPU ranks), "
                     f"nccl {'yes' + version if nccl else 'no'} (GPU ranks), "
                     f"mpi {'yes' if dist.is_mpi_available() else 'no'}")
        lines.append("launch: toolkit run --nproc N RECIPE, or torchrun --nproc_per_node N -m toolkit run RECIPE")
    lines.append(f"cpu {cpu_name()}: {os.cpu_count()} logical CPUs, {torch.get_num_threads()} torch threads, "
                 f"SIMD {_cpu_flags()}; bf16 matmuls: {describe_bf16_matmuls()}")
    lines.append(cpu_threads_line())
    return lines

