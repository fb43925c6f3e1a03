"""The fused CUDA kernels in kernels/: build, load, report and choose.

What lives here: the kernel table (which sources make which extension), the
build cache (one folder per extension, keyed by the sources' hash, torch and
CUDA versions and the target architectures), per-kernel status (loaded / built /
fallback and why) and `resolve`, which turns `recipe.kernels` into the kernels a
run uses. A build never stops a run: `auto` falls back to torch with one warning
that says why and how to fix it; only `on` turns a missing kernel into an error.

What does not: the CUDA target architectures and the toolchain checks
(toolkit/ops/toolchain.py), the custom ops and their torch reference implementations
(toolkit/ops/custom_ops.py), the model surgery (toolkit/ops/fused_modules.py), the
optimizer (toolkit/ops/fused_adamw.py). Importing this module never needs CUDA.
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.ops.toolchain import CudaArch, build_problem, gencode_flags, nvcc_version, target_archs
from toolkit.errors import UserError
from toolkit.resources import shipped_dir

KERNELS = ("adamw", "layernorm", "rmsnorm", "bias_gelu", "cross_entropy")

# Extension -> its sources under kernels/. LayerNorm and RMSNorm share one extension.
EXTENSIONS = {
    "adamw": ("fused_adamw.cu", "fused_adamw_binding.cpp"),
    "norm": ("fused_norm.cu", "fused_norm_backward.cu", "fused_norm_binding.cpp"),
    "bias_gelu": ("fused_bias_gelu.cu", "fused_bias_gelu_binding.cpp"),
    "cross_entropy": ("fused_cross_entropy.cu", "fused_cross_entropy_binding.cpp"),
}
HEADERS = ("bulk_copy.cuh", "common.cuh", "launchers.h", "torch_utils.h")
EXTENSION_OF = {"adamw": "adamw", "layernorm": "norm", "rmsnorm": "norm", "bias_gelu": "bias_gelu",
                "cross_entropy": "cross_entropy"}

# Kernels each model family can use (the optimizer's is added when AdamW is not torch's).
FAMILY_KERNELS = {"gpt2": ("layernorm", "bias_gelu", "cross_entropy"), "llama": ("rmsnorm", "cross_entropy")}

NVCC_FLAGS = ("-O3", "-lineinfo")  # the C++ standard is torch's choice (the .cu files need only C++17)
CXX_FLAGS = ("-O3",)


class KernelFallbackWarning(UserWarning):
    """A fused kernel recipe.kernels asked for with `auto` is not available: torch runs instead."""


# ---------------------------------------------------------------------------
# Cache

def cache_root() -> Path:
    """TOOLKIT_KERNELS_CACHE, else $XDG_CACHE_HOME/toolkit/kernels (~/.cache/toolkit/kernels)."""
    if os.environ.get("TOOLKIT_KERNELS_CACHE"):
        return Path(os.environ["TOOLKIT_KERNELS_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "toolkit" / "kernels"


@dataclass(frozen=True)
class BuildPlan:
    """Everything that decides one extension's binary, and where it is cached."""
    extension: str
    sources: tuple[Path, ...]
    cuda_flags: tuple[str, ...]
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


def build_plan(extension: str) -> BuildPlan:
    """The sources, flags and cache key of one extension for this machine."""
    import torch

    kernels = shipped_dir("kernels")
    sources = tuple(kernels / name for name in EXTENSIONS[extension])
    archs, notes = target_archs()
    flags = (*NVCC_FLAGS, *gencode_flags(archs))
    digest = hashlib.sha256()
    for path in (*sources, *(kernels / h for h in HEADERS)):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for part in (torch.__version__, str(torch.version.cuda), str(nvcc_version()), sys.version.split()[0],
                 " ".join(flags), " ".join(CXX_FLAGS)):
        digest.update(part.encode() + b"\0")
    return BuildPlan(extension, sources, flags, tuple(archs), tuple(notes), digest.hexdigest())


# ---------------------------------------------------------------------------
# Status and loading

@dataclass(frozen=True)
class KernelStatus:
    """One kernel's state: 'loaded' (in this process), 'built' (in the cache), 'not built', 'unavailable', 'off'."""
    name: str
    state: str
    reason: str = ""
    fix: str = ""
    where: str = ""

    @property
    def active(self) -> bool:
        return self.state == "loaded"

    def describe(self) -> str:
        """One line for `toolkit doctor` and the start-up table."""
        text = f"{self.name:<14} {self.state}"
        if self.reason:
            text += f": {self.reason}"
        if self.fix:
            text += f" (fix: {self.fix})"
        if self.where and self.state in ("loaded", "built"):
            text += f" [{self.where}]"
        return text


_lock = threading.Lock()
_modules: dict[str, object] = {}                 # extension -> loaded module
_failures: dict[str, tuple[str, str]] = {}       # extension -> (reason, fix) of a failed build/load
_ext_locks = {name: threading.Lock() for name in EXTENSIONS}


def loaded_extension(extension: str):
    """The extension's module when loaded in this process, else None (never builds)."""
    return _modules.get(extension)


def _first_error_line(text: str) -> str:
    for line in text.splitlines():
        if re.search(r"\berror\b", line, re.IGNORECASE) and "Error building extension" not in line:
            return line.strip()[:200]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "unknown error"


def load_extension(extension: str, verbose: bool = False):
    """Build (if not cached) and import one extension; None on failure (the reason is kept for status)."""
    if extension in _modules:
        return _modules[extension]
    with _ext_locks[extension]:
        if extension in _modules:
            return _modules[extension]
        if extension in _failures:
            return None
        problem = build_problem(need_gpu=False)  # building and importing need no GPU, only CUDA torch + nvcc
        if problem is not None:
            _failures[extension] = problem
            return None
        try:
            plan = build_plan(extension)
            plan.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            _failures[extension] = (f"cannot use the kernel cache ({exc})",
                                    "set TOOLKIT_KERNELS_CACHE to a writable folder")
            return None
        try:
            from torch.utils.cpp_extension import load

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's minor-version and compiler notes; the log keeps errors
                module = load(name=plan.module_name, sources=[str(s) for s in plan.sources],
                              extra_cflags=list(CXX_FLAGS), extra_cuda_cflags=list(plan.cuda_flags),
                              extra_include_paths=[str(shipped_dir("kernels"))],
                              build_directory=str(plan.directory), verbose=verbose)
        except Exception as exc:  # a build must never stop a run: keep why, fall back
            text = f"{type(exc).__name__}: {exc}"
            try:
                plan.log.write_text(text)
                where = f"; log: {plan.log}"
            except OSError:
                where = ""
            _failures[extension] = (f"build failed: {_first_error_line(text)}{where}",
                                    "run `toolkit build-kernels --verbose` to see the compiler output")
            return None
        _modules[extension] = module
        return module


def kernel_status(name: str, build: bool = False) -> KernelStatus:
    """The state of one kernel; build=True builds and loads it first when it can."""
    extension = EXTENSION_OF[name]
    if build:
        load_extension(extension)
    if extension in _modules:
        return KernelStatus(name, "loaded", where=str(Path(_modules[extension].__file__).parent))
    if extension in _failures:
        reason, fix = _failures[extension]
        return KernelStatus(name, "unavailable", reason, fix)
    problem = build_problem(need_gpu=False)
    if problem is not None:
        return KernelStatus(name, "unavailable", *problem)
    plan = build_plan(extension)
    if plan.library.is_file():
        return KernelStatus(name, "built", "in the cache, loads on first use", where=str(plan.directory))
    return KernelStatus(name, "not built", "builds on first use (about a minute)",
                        "run `toolkit build-kernels` ahead of time")


def build_all(names=KERNELS, verbose: bool = False) -> list[KernelStatus]:
    """Build and load the extensions behind `names` in parallel; their statuses, in order."""
    extensions = sorted({EXTENSION_OF[n] for n in names})
    with ThreadPoolExecutor(max_workers=len(extensions) or 1) as pool:
        list(pool.map(lambda e: load_extension(e, verbose=verbose), extensions))
    return [kernel_status(n) for n in names]


# ---------------------------------------------------------------------------
# Choosing kernels for a run

@dataclass(frozen=True)
class ActiveKernels:
    """Which fused kernels a run uses; `statuses` holds every kernel the run considered."""
    statuses: dict = field(default_factory=dict)  # name -> KernelStatus

    def active(self, name: str) -> bool:
        status = self.statuses.get(name)
        return status is not None and status.active

    def describe(self) -> str:
        """'fused a, b; torch c (why)' for the start-up table, kernels with the same reason named together."""
        fused = [n for n, s in self.statuses.items() if s.active]
        why: dict[str, list[str]] = {}
        for n, s in self.statuses.items():
            if not s.active:
                why.setdefault("off" if s.state == "off" else s.reason, []).append(n)
        other = [f"{', '.join(names)} ({reason})" for reason, names in why.items()]
        parts = ([f"fused {', '.join(fused)}"] if fused else []) + ([f"torch {'; '.join(other)}"] if other else [])
        return "; ".join(parts) or "none used"


def needed_kernels(family: str, optimizer_implementation: str) -> tuple[str, ...]:
    """The kernels a model family and AdamW implementation can use."""
    names = FAMILY_KERNELS.get(family, ("cross_entropy",))
    return (*names, "adamw") if optimizer_implementation != "torch" else names


def resolve(modes, device_type: str, needed) -> ActiveKernels:
    """recipe.kernels (auto | on | off per kernel) -> the kernels this run uses.

    `on` that cannot be honoured is a UserError naming recipe.kernels.<name>; `auto`
    falls back to torch, with one warning on a CUDA device (on the CPU the fused
    kernels simply do not apply).
    """
    statuses, errors, fallbacks = {}, [], []
    for name in needed:
        mode = getattr(modes, name)
        if mode == "off":
            statuses[name] = KernelStatus(name, "off", "recipe.kernels says off")
            continue
        if device_type != "cuda":
            status = KernelStatus(name, "unavailable", "training runs on the CPU; the fused kernels are CUDA-only",
                                  "train on a CUDA device (recipe.training.device)")
        else:
            status = kernel_status(name, build=True)
        statuses[name] = status
        if status.active:
            continue
        if mode == "on":
            errors.append(f"recipe.kernels.{name}: 'on' but the fused kernel is unavailable: {status.reason}; "
                          f"fix: {status.fix}, or set it to 'auto'")
        elif device_type == "cuda":
            fallbacks.append(status)
    if errors:
        raise UserError(*errors)
    global _run_kernels
    _run_kernels = ActiveKernels(statuses)
    if fallbacks:
        reasons = {(s.reason, s.fix) for s in fallbacks}
        names = ", ".join(s.name for s in fallbacks)
        if len(reasons) == 1:
            (reason, fix), = reasons
            detail = f"{reason}; fix: {fix}"
        else:
            detail = "; ".join(f"{s.name}: {s.reason} (fix: {s.fix})" for s in fallbacks)
        warnings.warn(f"fused kernels {names} fall back to torch: {detail}; "
                      "set recipe.kernels.<name> to 'off' to use torch without this warning",
                      KernelFallbackWarning, stacklevel=2)
    return _run_kernels


_run_kernels = ActiveKernels()  # the last resolve(): what this process's run uses


def kernel_enabled(name: str) -> bool:
    """True when the run being set up (the last `resolve`) uses the fused `name` kernel."""
    return _run_kernels.active(name)


def doctor_lines() -> list[str]:
    """`toolkit doctor`'s kernels block: the build environment, then one line per kernel (nothing is built)."""
    import torch

    archs, notes = target_archs()
    lines = [f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), nvcc {nvcc_version() or 'not found'}, "
             f"targets {', '.join(map(str, archs)) or 'none'} + PTX, cache {cache_root()}"]
    lines += [f"note: {n}" for n in notes]
    lines += [kernel_status(name).describe() for name in KERNELS]
    return lines
