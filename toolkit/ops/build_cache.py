"""The kernel build cache: where a C++ or CUDA extension's binary lives, and the one way
any extension is compiled into it or imported from it (toolkit/ops/loader.py decides what
to build; this module only builds and imports).

One folder per build plan, $TOOLKIT_KERNELS_CACHE/<extension>-<key> (default
~/.cache/toolkit/kernels), the key hashing everything the binary depends on.

NOTE: why a cached build is imported without torch's ninja step: `load` runs ninja on a
build.ninja naming the sources by absolute path, so the same sources under another path
(a second checkout, a `pip install .` beside an editable one) or with a newer mtime (a
reinstall) compiled the cached library again (94 s for the CPU Adam kernel on a 2-core VM).
Here a build compiles copies of the sources kept in its folder, and a finished build
leaves `built.json` there: the library is then imported directly. A build killed midway
left torch's `lock` file, on which every later `load` waited forever; builds hold an
flock instead (released by the kernel when a process dies) and remove that stale file.

What does not live here: the extension table, statuses and fallbacks (loader.py), the
CUDA toolchain (toolchain.py).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import platform
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from toolkit.ops.toolchain import CudaArch, cache_root

DONE_FILE = "built.json"  # written after a build imported successfully: the library in the folder is whole


@dataclass(frozen=True)
class BuildPlan:
    """Everything that decides one extension's binary, and where it is cached."""
    extension: str
    title: str                   # for the build notes: "building the {title}"
    sources: tuple[Path, ...]    # the shipped sources; a build compiles copies of them in `directory`
    headers: tuple[Path, ...]    # copied beside them (the sources include them by name)
    cxx_flags: tuple[str, ...]
    cuda_flags: tuple[str, ...]  # empty for a CPU extension
    ldflags: tuple[str, ...]
    archs: tuple[CudaArch, ...]
    notes: tuple[str, ...]
    key: str

    @property
    def module_name(self) -> str:
        return f"toolkit_{self.extension}_{self.key[:12]}"

    @property
    def directory(self) -> Path:
        return cache_root() / f"{self.extension}-{self.key[:16]}"

    @property
    def library(self) -> Path:
        return self.directory / f"{self.module_name}.so"

    @property
    def log(self) -> Path:
        return self.directory / "build.log"

    @property
    def finished(self) -> bool:
        """True when a build completed here (a library without the marker may be half-written)."""
        return (self.directory / DONE_FILE).is_file() and self.library.is_file()

    def flags_text(self) -> str:
        """The flags that matter to a reader: the CUDA targets, or the host flags."""
        if self.cuda_flags:
            return f"for {', '.join(map(str, self.archs)) or 'the default targets'} + PTX"
        return " ".join(self.cxx_flags)


def cpu_features() -> str:
    """The CPU's instruction-set flags (Linux): a -march=native binary is only valid on such a CPU."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[-1].strip()
    except OSError:
        pass
    return platform.processor()


def _say(line: str) -> None:
    """A progress line on stderr, from the first rank only (the others wait for its build)."""
    from toolkit.distributed import launched_world

    if launched_world()[0] == 0:
        print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _build_lock(directory: Path):
    """One builder per cache folder across processes (ranks, concurrent runs); a dead holder releases it."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's own lock file still serialises builds
        yield
        return
    with open(directory / "build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _import_library(plan: BuildPlan):
    """Import a finished build's library, as torch's `load` does once ninja is done."""
    spec = importlib.util.spec_from_file_location(plan.module_name, plan.library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(plan: BuildPlan, verbose: bool):
    """Compile copies of the sources in the plan's folder (the caller holds the build lock); mark it finished."""
    from torch.utils.cpp_extension import load

    (plan.directory / "lock").unlink(missing_ok=True)  # torch's baton from a killed build: load() would wait forever
    for path in (*plan.sources, *plan.headers):
        copy = plan.directory / path.name
        if not copy.is_file() or copy.read_bytes() != path.read_bytes():
            shutil.copyfile(path, copy)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's minor-version and compiler notes; the log keeps errors
        module = load(name=plan.module_name, sources=[str(plan.directory / s.name) for s in plan.sources],
                      extra_cflags=list(plan.cxx_flags), extra_cuda_cflags=list(plan.cuda_flags),
                      extra_ldflags=list(plan.ldflags), extra_include_paths=[str(plan.directory)],
                      build_directory=str(plan.directory), verbose=verbose)
    seconds = round(time.perf_counter() - start, 1)
    (plan.directory / DONE_FILE).write_text(json.dumps({"flags": [*plan.cxx_flags, *plan.cuda_flags],
                                                        "seconds": seconds}) + "\n")
    return module


def build_or_import(plan: BuildPlan, verbose: bool = False):
    """(module, compiled now?): the cached library when a build finished, else a build under the lock,
    announced on stderr before and after."""
    if plan.finished:
        return _import_library(plan), False
    plan.directory.mkdir(parents=True, exist_ok=True)
    # NOTE: said before the lock: rank 0 may wait while another rank or run compiles.
    # CPU Adam: 9.8 s on the 2-core VM beside other work (gcc -O3, one translation unit; RESULTS.md).
    _say(f"note: building the {plan.title} (kernels/{', '.join(s.name for s in plan.sources)}, {plan.flags_text()}) "
         f"into {plan.directory}: once per machine and torch version (the four CUDA extensions: 17 s on a 16-core "
         "H200 host, longer on fewer cores); later runs load it from there")
    start = time.perf_counter()
    with _build_lock(plan.directory):
        if plan.finished:  # another rank or run built it meanwhile
            module, compiled = _import_library(plan), False
        else:
            module, compiled = _compile(plan, verbose), True
    _say(f"note: {plan.title} ready after {time.perf_counter() - start:.0f} s")
    return module, compiled
