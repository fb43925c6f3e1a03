"""The CPU Adam kernel (kernels/cpu_adam.cpp): JIT build, cache, load, status.

Built once per (source, torch version, Python, machine, compiler and flags) with
torch.utils.cpp_extension into the kernel cache ($TOOLKIT_KERNELS_CACHE, else
~/.cache/toolkit/kernels, as for the CUDA kernels: toolkit/ops/loader.py), in a folder named
by a hash of those. The first build takes about a minute on a few cores and says so
on stderr before it starts and when it is done; afterwards a run, or the other ranks
of this one, import the cached library directly in well under a second.
`-march=native` is tried first and dropped if the compiler refuses it. Any failure
(no compiler, no ninja, a build error) means the torch fallback, with one warning
naming the reason; `toolkit doctor` shows the same status.

NOTE: why a cached build used to compile again: torch's `load` runs ninja on a
build.ninja naming the source by its absolute path, so the same source under another
path (a second checkout, a `pip install .` beside an editable one) or with a newer
mtime (a reinstall) rebuilt the cached library. Here the build compiles a copy of the
source kept in the cache folder, and a finished build leaves `built.json` there: its
library is then imported without ninja. A build killed midway left torch's `lock` file,
on which every later `load` waited forever; builds now hold an flock instead (released
by the kernel when a process dies) and remove that stale file.

What does not live here: the AdamW maths (kernels/cpu_adam.cpp, and
toolkit/runtime/zero/adamw.py which chooses between this kernel and torch).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from toolkit.ops.loader import cache_root
from toolkit.resources import shipped_dir

SOURCE = "cpu_adam.cpp"
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-fopenmp"])  # first that builds wins
DISABLE_ENV = "TOOLKIT_DISABLE_CPU_ADAM"
DONE_FILE = "built.json"  # written after a build imported successfully: the library in the folder is whole


@dataclass(frozen=True)
class KernelStatus:
    """Whether a kernel is active, and why (for the start-up table and `toolkit doctor`)."""
    name: str
    state: str   # "built" (compiled now), "loaded" (from the cache), "fallback", "not loaded"
    detail: str  # where it came from, or why it is not used
    build_dir: Path | None = None  # the cache folder of the library in use

    @property
    def active(self) -> bool:
        return self.state in ("built", "loaded")

    def line(self) -> str:
        return f"{self.name}: {self.state} ({self.detail})"


_module = None
_status: KernelStatus | None = None


def _cpu_features() -> str:
    """The CPU's instruction-set flags (Linux): a -march=native binary is only valid on such a CPU."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[-1].strip()
    except OSError:
        pass
    return platform.processor()


def build_key(source: bytes, flags: list[str]) -> str:
    """Hash of everything the binary depends on: source, torch, Python, CPU, compiler and flags."""
    import torch

    digest = hashlib.sha256(source)
    for part in (torch.__version__, sys.version, platform.machine(), _cpu_features(),
                 os.environ.get("CXX", "c++"), " ".join(flags)):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def _say(line: str) -> None:
    """A progress line on stderr, from the first rank only (the others wait for its build)."""
    from toolkit.distributed import launched_world

    if launched_world()[0] == 0:
        print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """One builder per cache folder across processes (ranks, concurrent runs); a dead holder releases it."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's own lock file still serialises builds
        yield
        return
    with open(build_dir / "build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _import_library(name: str, library: Path):
    """Import a built extension module from its file, as torch's `load` does once ninja is done."""
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(source_path: Path, flags: list[str]):
    source = source_path.read_bytes()
    key = build_key(source, flags)
    name = f"toolkit_cpu_adam_{key}"
    build_dir = cache_root() / f"cpu_adam-{key}"
    library = build_dir / f"{name}.so"
    state = "loaded"
    if (build_dir / DONE_FILE).is_file() and library.is_file():
        module = _import_library(name, library)
    else:
        build_dir.mkdir(parents=True, exist_ok=True)
        # NOTE: said before the lock: rank 0 may wait while another rank or run compiles.
        # 56 s on an idle 2-core VM, 94 s beside other work (gcc -O3, one translation unit).
        _say(f"note: building the CPU Adam kernel for ZeRO-Offload (kernels/{SOURCE}, {' '.join(flags)}) into "
             f"{build_dir}: once per machine and torch version, about 1-2 minutes; later runs load it from there")
        start = time.perf_counter()
        with _build_lock(build_dir):
            if (build_dir / DONE_FILE).is_file() and library.is_file():  # another rank built it meanwhile
                module = _import_library(name, library)
            else:
                module, state = _compile(source, name, build_dir, flags), "built"
        _say(f"note: CPU Adam kernel ready after {time.perf_counter() - start:.0f} s")
    return module, KernelStatus("cpu_adam", state, f"{module.simd_width()}, {module.omp_threads()} OpenMP threads, "
                                                   f"flags {' '.join(flags)}, {build_dir}", build_dir)


def _compile(source: bytes, name: str, build_dir: Path, flags: list[str]):
    """Compile the kernel into `build_dir` (the caller holds the build lock) and mark the build finished."""
    from torch.utils.cpp_extension import load

    (build_dir / "lock").unlink(missing_ok=True)  # torch's baton from a killed build: load() would wait forever
    copy = build_dir / SOURCE
    if not copy.is_file() or copy.read_bytes() != source:
        copy.write_bytes(source)
    start = time.perf_counter()
    module = load(name=name, sources=[str(copy)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                  build_directory=str(build_dir), verbose=False)
    seconds = round(time.perf_counter() - start, 1)
    (build_dir / DONE_FILE).write_text(json.dumps({"flags": flags, "seconds": seconds}) + "\n")
    return module


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
