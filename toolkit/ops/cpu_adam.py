"""The CPU Adam kernel (kernels/cpu_adam.cpp) for ZeRO-Offload's optimizer step: load it, or
say once why torch runs instead.

It is built, cached and reported like every other extension (toolkit/ops/loader.py, the
`cpu_adam` entry: `-march=native` first, dropped if the compiler refuses it; the cache and
its notes on stderr: toolkit/ops/build_cache.py). The first build takes about 10 s on a 2-core VM;
later runs, other ranks and other checkouts import the cached library in milliseconds.
Any failure (no compiler, no ninja, a build error, TOOLKIT_DISABLE_CPU_ADAM) means torch's
fused CPU AdamW, with one warning naming the reason; `toolkit doctor` shows the same status.

What does not live here: the AdamW maths (kernels/cpu_adam.cpp, and
toolkit/runtime/zero/adamw.py which chooses between this kernel and torch).
"""
from __future__ import annotations

import sys

from toolkit.ops import loader

_warned = False  # the fallback warning is said once per process


def load_cpu_adam(*, warn: bool = True):
    """The compiled kernel module, or None (torch fallback) after one warning with the reason."""
    global _warned
    module = loader.load_extension("cpu_adam")
    if module is None and warn and not _warned:
        _warned = True
        status = cpu_adam_status()
        print(f"warning: CPU Adam kernel not used: {loader.fallback_detail([status])}; torch's fused CPU AdamW "
              "runs instead (slower offload steps; `toolkit doctor` shows the kernel status)",
              file=sys.stderr, flush=True)
    return module


def cpu_adam_status() -> loader.KernelStatus:
    """The kernel's status in this process (built, loaded, cached, not built or unavailable); never builds."""
    return loader.kernel_status("cpu_adam")
