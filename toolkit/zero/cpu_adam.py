"""The CPU Adam kernel (kernels/cpu_adam.cpp): JIT build, cache, load, status.

Built once per (source, torch version, Python, compiler flags) with
torch.utils.cpp_extension into a cache directory named by a hash of those
($TOOLKIT_CACHE_DIR, else $XDG_CACHE_HOME/toolkit, else ~/.cache/toolkit), so
a second run, or the other ranks of this one, load it in well under a second.
`-march=native` is tried first and dropped if the compiler refuses it. Any
failure (no compiler, no ninja, a build error) means the torch fallback, with
one warning naming the reason; `toolkit doctor` shows the same status.

What does not live here: the AdamW maths (kernels/cpu_adam.cpp, and
toolkit/zero/adamw.py which chooses between this kernel and torch).
"""
from __future__ import annotations

import hashlib
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from toolkit.resources import shipped_dir

SOURCE = "cpu_adam.cpp"
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-fopenmp"])  # first that builds wins
DISABLE_ENV = "TOOLKIT_DISABLE_CPU_ADAM"


@dataclass(frozen=True)
class KernelStatus:
    """Whether a kernel is active, and why (for the start-up table and `toolkit doctor`)."""
    name: str
    state: str   # "built" (compiled now), "loaded" (from the cache), "fallback", "not loaded"
    detail: str  # where it came from, or why it is not used

    @property
    def active(self) -> bool:
        return self.state in ("built", "loaded")

    def line(self) -> str:
        return f"{self.name}: {self.state} ({self.detail})"


_module = None
_status: KernelStatus | None = None


def cache_root() -> Path:
    """Where JIT-built kernels are kept."""
    if os.environ.get("TOOLKIT_CACHE_DIR"):
        return Path(os.environ["TOOLKIT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "toolkit"


def build_key(source: bytes, flags: list[str]) -> str:
    """Hash of everything the binary depends on: source, torch, Python, machine and flags."""
    import torch

    digest = hashlib.sha256(source)
    for part in (torch.__version__, sys.version, platform.machine(), " ".join(flags)):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _build(source_path: Path, flags: list[str]):
    from torch.utils.cpp_extension import load

    key = build_key(source_path.read_bytes(), flags)
    build_dir = cache_root() / "kernels" / f"cpu_adam-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    cached = any(build_dir.glob("*.so")) or any(build_dir.glob("*.pyd"))
    module = load(name=f"toolkit_cpu_adam_{key}", sources=[str(source_path)], extra_cflags=flags,
                  extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    state = "loaded" if cached else "built"
    return module, KernelStatus("cpu_adam", state, f"{module.simd_width()}, {module.omp_threads()} OpenMP threads, "
                                                   f"flags {' '.join(flags)}, {build_dir}")


def load_cpu_adam(*, warn: bool = True):
    """The compiled kernel module, or None (torch fallback) after one warning with the reason."""
    global _module, _status
    if _status is not None:
        return _module
    source_path = shipped_dir("kernels") / SOURCE
    reasons = []
    if os.environ.get(DISABLE_ENV):
        reasons.append(f"disabled by {DISABLE_ENV}")
    elif not source_path.is_file():
        reasons.append(f"{source_path} is missing")
    else:
        for flags in FLAG_SETS:
            try:
                _module, _status = _build(source_path, flags)
                return _module
            except Exception as exc:  # a build failure of any kind means the fallback, never a crash
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                reasons.append(f"{' '.join(flags)}: {type(exc).__name__}: {first[:200]}")
    _status = KernelStatus("cpu_adam", "fallback", "; ".join(reasons) + " -> torch AdamW on the CPU")
    if warn:
        print(f"warning: CPU Adam kernel not used: {_status.detail} (slower offload steps; "
              f"`toolkit doctor` shows the kernel status)", file=sys.stderr, flush=True)
    return None


def cpu_adam_status() -> KernelStatus:
    """The kernel's status in this process (`not loaded` until something asks for it)."""
    return _status if _status is not None else KernelStatus("cpu_adam", "not loaded", "no offload step yet")
