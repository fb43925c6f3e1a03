"""The C++ and CUDA kernels in kernels/: which to build, load, report and choose.

What lives here: the extension table (which sources make which extension, CUDA or
CPU, with which flags), each extension's build plan (its cache key), loading with
per-kernel status (built / loaded / cached / unavailable and why) and `resolve`,
which turns `recipe.kernels` into the kernels a run uses. A build never stops a run:
the caller falls back to torch with one warning that says why and how to fix it; only
recipe.kernels `on` turns a missing kernel into an error. The CUDA kernels and the
CPU Adam kernel of ZeRO-Offload (toolkit/ops/cpu_adam.py) go the same way.

Environment: TOOLKIT_KERNELS_CACHE moves the cache; TOOLKIT_DISABLE_<EXTENSION>
(TOOLKIT_DISABLE_CPU_ADAM, TOOLKIT_DISABLE_ADAMW, ...) makes one extension unavailable.

What does not: the cache folders and the build itself (toolkit/ops/build_cache.py), the
CUDA target architectures and the toolchain checks (toolkit/ops/toolchain.py), the custom
ops and their torch reference implementations (toolkit/ops/custom_ops.py), the model
surgery (toolkit/ops/fused_modules.py), the optimizers (toolkit/ops/fused_adamw.py,
toolkit/ops/cpu_adam.py), and which AdamW a run steps with (toolkit/runtime/optim.py).
Importing this module never needs CUDA.
"""
from __future__ import annotations

import hashlib
import os
import platform
import re
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from toolkit.ops.build_cache import BuildPlan, build_or_import, cpu_features
from toolkit.ops.toolchain import (build_problem, cache_root, gencode_flags, ninja_problem, nvcc_parallel_flags,
                                   nvcc_version, target_archs)
from toolkit.errors import UserError
from toolkit.resources import shipped_dir

KERNELS = ("adamw", "layernorm", "rmsnorm", "bias_gelu", "cross_entropy")  # recipe.kernels: the fused CUDA kernels

NVCC_FLAGS = ("-O3", "-lineinfo")  # the C++ standard is torch's choice (the .cu files need only C++17)
CXX_FLAGS = ("-O3",)  # the CUDA extensions' host code


@dataclass(frozen=True)
class Extension:
    """One extension over kernels/: its sources, whether it is CUDA code, and the host flags to try in turn."""
    sources: tuple[str, ...]
    title: str  # for the build notes: "building the {title}"
    cuda: bool = True
    cxx_flag_sets: tuple[tuple[str, ...], ...] = (CXX_FLAGS,)  # the first that builds wins
    ldflags: tuple[str, ...] = ()
    headers: tuple[str, ...] = ()  # a host extension's own headers (the CUDA ones share HEADERS)


# Extension -> its sources under kernels/. LayerNorm and RMSNorm share one extension.
EXTENSIONS = {
    "adamw": Extension(("fused_adamw.cu", "fused_adamw_binding.cpp"), "fused AdamW kernel"),
    "norm": Extension(("fused_norm.cu", "fused_norm_backward.cu", "fused_norm_binding.cpp"), "fused norm kernels"),
    "bias_gelu": Extension(("fused_bias_gelu.cu", "fused_bias_gelu_binding.cpp"), "fused bias+GELU kernel"),
    "cross_entropy": Extension(("fused_cross_entropy.cu", "fused_cross_entropy_binding.cpp"),
                               "fused cross-entropy kernel"),
    # NOTE: -march=native first (AVX-512 where the CPU has it), dropped if the compiler refuses it. No contraction
    # of a multiply and an add into an FMA: GCC ignores a file's `#pragma GCC optimize("fp-contract=off")` for the
    # vector intrinsics, and the contracted AVX2 build rounded a few bf16 moments an ulp away from the scalar one.
    "cpu_adam": Extension(("cpu_adam.cpp", "cpu_adam_bf16.cpp"), "CPU Adam kernel", cuda=False, ldflags=("-fopenmp",),
                          cxx_flag_sets=(("-O3", "-march=native", "-ffp-contract=off", "-fopenmp"),
                                         ("-O3", "-ffp-contract=off", "-fopenmp")),
                          headers=("cpu_adam_bf16.h",)),
}
HEADERS = ("bulk_copy.cuh", "common.cuh", "launchers.h", "torch_utils.h")  # what the CUDA extensions include
EXTENSION_OF = {"adamw": "adamw", "layernorm": "norm", "rmsnorm": "norm", "bias_gelu": "bias_gelu",
                "cross_entropy": "cross_entropy", "cpu_adam": "cpu_adam"}

# Kernels each model family can use (the optimizer's is added when stage 0's AdamW can use it).
FAMILY_KERNELS = {"gpt2": ("layernorm", "bias_gelu", "cross_entropy"), "llama": ("rmsnorm", "cross_entropy")}


class KernelFallbackWarning(UserWarning):
    """A fused kernel recipe.kernels asked for with `auto` is not available: torch runs instead."""


# ---------------------------------------------------------------------------
# Build plans (the cache itself: toolkit/ops/build_cache.py)

def disable_env(extension: str) -> str:
    """The environment variable that makes `extension` unavailable: TOOLKIT_DISABLE_<EXTENSION>."""
    return f"TOOLKIT_DISABLE_{extension.upper()}"


def build_plan(extension: str, variant: int = 0) -> BuildPlan:
    """The sources, flags and cache key of one extension for this machine (`variant`: which host flag set)."""
    import torch

    spec = EXTENSIONS[extension]
    kernels = shipped_dir("kernels")
    sources = tuple(kernels / name for name in spec.sources)
    headers = tuple(kernels / name for name in (HEADERS if spec.cuda else spec.headers))
    cxx_flags = spec.cxx_flag_sets[variant]
    archs, notes = target_archs() if spec.cuda else ([], [])
    nvcc = nvcc_version() if spec.cuda else None
    cuda_flags = (*NVCC_FLAGS, *nvcc_parallel_flags(nvcc), *gencode_flags(archs)) if spec.cuda else ()
    digest = hashlib.sha256()
    for path in (*sources, *headers):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    parts = [torch.__version__, str(torch.version.cuda), sys.version, platform.machine(),
             os.environ.get("CXX", "c++"), " ".join(cxx_flags), " ".join(spec.ldflags), " ".join(cuda_flags)]
    if spec.cuda:
        parts.append(str(nvcc))
    if "-march=native" in cxx_flags:
        parts.append(cpu_features())
    for part in parts:
        digest.update(part.encode() + b"\0")
    return BuildPlan(extension, spec.title, sources, headers, cxx_flags, cuda_flags, spec.ldflags, tuple(archs),
                     tuple(notes), digest.hexdigest())


# ---------------------------------------------------------------------------
# Status and loading

@dataclass(frozen=True)
class KernelStatus:
    """One kernel's state: 'built' (compiled by this process) or 'loaded' (from the cache), both in use;
    'cached' (in the cache, loads on first use), 'not built', 'unavailable' (torch runs instead), 'off'."""
    name: str
    state: str
    reason: str = ""  # why it is not in use; for one in use, what it is (SIMD width, flags)
    fix: str = ""
    where: str = ""

    @property
    def active(self) -> bool:
        return self.state in ("built", "loaded")

    def describe(self) -> str:
        """One line for `toolkit doctor` and the start-up table."""
        text = f"{self.name:<14} {self.state}"
        if self.reason:
            text += f": {self.reason}"
        if self.fix:
            text += f" (fix: {self.fix})"
        if self.where and self.state in ("built", "loaded", "cached"):
            text += f" [{self.where}]"
        return text


_modules: dict[str, object] = {}                 # extension -> loaded module
_loaded: dict[str, tuple[BuildPlan, bool]] = {}  # extension -> (its plan, compiled by this process)
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


def _problem(extension: str) -> tuple[str, str] | None:
    """Why a finished build of `extension` cannot be found or imported here, as (reason, fix); None when nothing
    is missing. Checks TOOLKIT_DISABLE_<EXTENSION> and, for a CUDA extension, what its cache key names (CUDA torch
    and nvcc). A build also needs ninja: callers ask ninja_problem only when there is no finished build."""
    env = disable_env(extension)
    if os.environ.get(env):
        return f"disabled by {env}", f"unset {env}"
    if EXTENSIONS[extension].cuda:  # importing needs no GPU, only CUDA torch + nvcc
        return build_problem()
    return None


def _build_failure(extension: str, errors: list[tuple[BuildPlan, str]]) -> tuple[str, str]:
    """(reason, fix) after every flag set failed; each failure's text goes to its plan's build.log."""
    lines, where = [], ""
    for plan, text in errors:
        first = _first_error_line(text)
        lines.append(f"{' '.join(plan.cxx_flags)}: {first}" if len(errors) > 1 else first)
        try:
            plan.log.write_text(text)
            where = f"; log: {plan.log}"
        except OSError:
            pass
    fix = ("run `toolkit build-kernels --verbose` to see the compiler output" if EXTENSIONS[extension].cuda
           else "install a C++ compiler with OpenMP (g++); the log has its output")
    return f"build failed: {'; '.join(lines)}{where}", fix


def load_extension(extension: str, verbose: bool = False, build: bool = True):
    """Build (if not cached) and import one extension; None on failure (the reason is kept for status).
    build=False only imports a finished build from the cache (None, and no failure kept, when there is none)."""
    if extension in _modules:
        return _modules[extension]
    with _ext_locks[extension]:
        if extension in _modules:
            return _modules[extension]
        if extension in _failures:
            return None
        # NOTE: a CUDA extension's cache key names nvcc, so nvcc is checked first; a finished build is imported
        # without looking for ninja (asking it costs a process, and torch's builder imports setuptools).
        problem = _problem(extension)
        if problem is None:
            try:
                plans = [build_plan(extension, v) for v in range(len(EXTENSIONS[extension].cxx_flag_sets))]
                plans = [p for p in plans if p.finished][:1] or plans  # a finished build of any flag set first
                if not build and not plans[0].finished:
                    return None
                plans[0].directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                problem = (f"cannot use the kernel cache ({exc})", "set TOOLKIT_KERNELS_CACHE to a writable folder")
        if problem is None and not plans[0].finished:
            problem = ninja_problem()  # the rest a build needs was checked above
        if problem is not None:
            _failures[extension] = problem
            return None
        errors = []
        for plan in plans:
            try:
                module, compiled = build_or_import(plan, verbose)
            except Exception as exc:  # a build must never stop a run: keep why, try the next flags, fall back
                errors.append((plan, f"{type(exc).__name__}: {exc}"))
                continue
            _modules[extension], _loaded[extension] = module, (plan, compiled)
            return module
        _failures[extension] = _build_failure(extension, errors)
        return None


def _in_use(name: str, extension: str) -> KernelStatus:
    plan, compiled = _loaded[extension]
    module = _modules[extension]
    about = [] if EXTENSIONS[extension].cuda else [f"flags {' '.join(plan.cxx_flags)}"]
    if hasattr(module, "simd_width"):  # the CPU Adam kernel says what it was compiled for
        about[:0] = [module.simd_width(), f"{module.omp_threads()} OpenMP threads"]
    return KernelStatus(name, "built" if compiled else "loaded", ", ".join(about), where=str(plan.directory))


def build_command(name: str) -> str:
    """The command that builds the kernel `name` ahead of time."""
    return "toolkit build-kernels" if name in KERNELS else f"toolkit build-kernels {name}"


def kernel_status(name: str, build: bool = False) -> KernelStatus:
    """The state of one kernel; build=True builds and loads it first when it can."""
    extension = EXTENSION_OF[name]
    if build:
        load_extension(extension)
    if extension in _modules:
        return _in_use(name, extension)
    if extension in _failures:
        return KernelStatus(name, "unavailable", *_failures[extension])
    # NOTE: the order of load_extension: a CUDA extension's toolchain first (its cache key names nvcc),
    # a CPU extension's cache first (a cached build imports without ninja).
    problem = _problem(extension)
    if problem is not None:
        return KernelStatus(name, "unavailable", *problem)
    plans = [build_plan(extension, v) for v in range(len(EXTENSIONS[extension].cxx_flag_sets))]
    for plan in plans:
        if plan.finished:
            return KernelStatus(name, "cached", "in the cache, loads on first use", where=str(plan.directory))
    problem = ninja_problem()  # as in load_extension: only a build needs it
    if problem is not None:
        return KernelStatus(name, "unavailable", *problem)
    logs = [plan.log for plan in plans if plan.log.is_file()]  # written when every flag set failed to build
    if logs:
        return KernelStatus(name, "not built", f"the last build here failed (log: {logs[0]}); a run tries again",
                            f"run `{build_command(name)} --verbose` to see the compiler output")
    return KernelStatus(name, "not built", "a run builds it on first use and caches it",
                        f"run `{build_command(name)}` ahead of time")


def fallback_detail(statuses) -> str:
    """'reason; fix: fix' for kernels that fall back to torch, one clause per distinct reason."""
    reasons = {(s.reason, s.fix) for s in statuses}
    if len(reasons) == 1:
        (reason, fix), = reasons
        return f"{reason}; fix: {fix}" if fix else reason
    return "; ".join(f"{s.name}: {s.reason}" + (f" (fix: {s.fix})" if s.fix else "") for s in statuses)


def build_all(names=KERNELS, verbose: bool = False) -> list[KernelStatus]:
    """Build and load the extensions behind `names` in parallel; their statuses, in order."""
    extensions = sorted({EXTENSION_OF[n] for n in names})
    with ThreadPoolExecutor(max_workers=len(extensions) or 1) as pool:
        list(pool.map(lambda e: load_extension(e, verbose=verbose), extensions))
    return [kernel_status(n) for n in names]


def build_in_background(names) -> None:
    """Start building (or importing) the extensions behind `names` on daemon threads, and return at once.

    A run calls it before it makes its model and data, so nvcc works meanwhile (19.5 s of set-up before the
    builds began on a fresh H200); `resolve` then waits on the same per-extension lock and takes the module.
    NOTE: not daemon threads: a run that stops early (a user error in its data, say) waits for the build at exit,
    so no compiler is left writing into the cache after the process, and its lock, are gone.
    """
    for extension in sorted({EXTENSION_OF[n] for n in names}):
        if extension not in _modules:
            threading.Thread(target=load_extension, args=(extension,), name=f"toolkit-build-{extension}").start()


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


def needed_kernels(family: str, fused_adamw: bool) -> tuple[str, ...]:
    """The kernels a model family can use, and the AdamW kernel when the run's optimizer can step with it."""
    names = FAMILY_KERNELS.get(family, ("cross_entropy",))
    return (*names, "adamw") if fused_adamw else names


def resolve(modes, device_type: str, needed) -> ActiveKernels:
    """recipe.kernels (auto | on | off per kernel) -> the kernels this run uses (only those in `needed`
    are built or loaded).

    `on` that cannot be honoured is a UserError naming recipe.kernels.<name>; `auto`
    falls back to torch, with one warning on a CUDA device (on the CPU the fused
    kernels simply do not apply).
    """
    statuses, errors, fallbacks = {}, [], []
    wanted = [name for name in needed if getattr(modes, name) != "off"] if device_type == "cuda" else []
    # NOTE: the kernels a run needs build together, not one after the other (88 s of four nvcc builds in a
    # row on a fresh H200): one thread each, each extension under its own lock, so LayerNorm and RMSNorm
    # share one build of `norm`.
    with ThreadPoolExecutor(max_workers=len(wanted) or 1) as pool:
        loaded = dict(zip(wanted, pool.map(lambda name: kernel_status(name, build=True), wanted)))
    for name in needed:
        mode = getattr(modes, name)
        if mode == "off":
            statuses[name] = KernelStatus(name, "off", "recipe.kernels says off")
            continue
        if device_type != "cuda":
            status = KernelStatus(name, "unavailable", "training runs on the CPU; the fused kernels are CUDA-only",
                                  "train on a CUDA device (recipe.training.device)")
        else:
            status = loaded[name]
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
    if fallbacks:
        warnings.warn(f"fused kernels {', '.join(s.name for s in fallbacks)} fall back to torch: "
                      f"{fallback_detail(fallbacks)}; "
                      "set recipe.kernels.<name> to 'off' to use torch without this warning",
                      KernelFallbackWarning, stacklevel=2)
    return ActiveKernels(statuses)


def doctor_lines() -> list[str]:
    """`toolkit doctor`'s kernels block: the build environment and one line per kernel. It compiles nothing:
    a cached build is imported (the proof that a run loads it without a build), a missing one named with
    the command that builds it."""
    import torch

    archs, notes = target_archs()
    lines = [f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), nvcc {nvcc_version() or 'not found'}, "
             f"targets {', '.join(map(str, archs)) or 'none'} + PTX, cache {cache_root()}"]
    lines += [f"note: {n}" for n in notes]
    if torch.version.cuda and not torch.cuda.is_available():
        lines.append("note: no CUDA device is visible: runs use torch's kernels; the fused ones can still be built")
    lines.append("states: loaded (built, in the cache), not built (a run builds it; the command builds it now), "
                 "unavailable (why); doctor builds nothing")
    for extension in sorted({EXTENSION_OF[n] for n in (*KERNELS, "cpu_adam")}):
        load_extension(extension, build=False)
    lines += [kernel_status(name).describe() for name in KERNELS]
    lines.append(f"{kernel_status('cpu_adam').describe()} (ZeRO-Offload's optimizer step)")
    return lines
