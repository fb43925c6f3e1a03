"""The CUDA toolchain the fused kernels are built with: target architectures and what is missing.

The architectures come from the GPUs present plus TORCH_CUDA_ARCH_LIST in any form users
write ("9.0a", "9.0+PTX", "8.0;9.0", "sm_90", "Hopper"; DeepSpeed 0.19's JIT builder crashes
on "9.0a"), less what this nvcc cannot target. `build_problem` and `ninja_problem` say, as (reason,
fix), why nothing can be built or loaded here. Importing this module never needs CUDA.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from toolkit.resources import user_cache_dir


# ---------------------------------------------------------------------------
# Target architectures

@dataclass(frozen=True, order=True)
class CudaArch:
    """One compute capability: 9.0 -> sm_90; suffix 'a' / 'f' selects the arch-specific variant (sm_90a)."""
    major: int
    minor: int
    suffix: str = ""

    @property
    def sm(self) -> str:
        return f"{self.major}{self.minor}{self.suffix}"

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}{self.suffix}"


# torch's named architectures (torch.utils.cpp_extension), lower-cased.
_NAMED_ARCHES = {
    "kepler": "3.5", "maxwell": "5.0;5.2", "pascal": "6.0;6.1", "volta": "7.0", "turing": "7.5",
    "ampere": "8.0;8.6", "ada": "8.9", "hopper": "9.0", "blackwell": "10.0;12.0",
}
_ARCH_TOKEN = re.compile(r"(?:sm_?|compute_?)?(\d+)(?:\.(\d+))?([af]?)(\+ptx)?", re.IGNORECASE)


def parse_arch_list(text: str) -> tuple[list[CudaArch], list[str]]:
    """TORCH_CUDA_ARCH_LIST as users write it -> (architectures, tokens that are not one).

    Separators may be ';', ',' or spaces; "+PTX" is accepted and ignored here (the
    build always embeds PTX of its highest architecture); "native" / "all" mean
    "the GPU present" and add nothing.
    """
    archs: list[CudaArch] = []
    bad: list[str] = []
    for token in (t for t in re.split(r"[;,\s]+", text.strip()) if t):
        lowered = token.lower().removesuffix("+ptx")
        if lowered in ("native", "all", "auto"):
            continue
        if lowered in _NAMED_ARCHES:
            archs += parse_arch_list(_NAMED_ARCHES[lowered])[0]
            continue
        match = _ARCH_TOKEN.fullmatch(token)
        if match is None:
            bad.append(token)
            continue
        digits, minor, suffix = match.group(1), match.group(2), match.group(3).lower()
        if minor is not None:
            major, minor_value = int(digits), int(minor)
        elif len(digits) >= 2:
            major, minor_value = int(digits[:-1]), int(digits[-1])
        else:
            major, minor_value = int(digits), 0
        if major < 1 or minor_value > 9:
            bad.append(token)
            continue
        archs.append(CudaArch(major, minor_value, suffix))
    return archs, bad


@lru_cache(maxsize=None)
def _nvcc_supported_sms() -> frozenset[str] | None:
    """The sm_XX codes this nvcc can target, or None when it cannot say."""
    out = _nvcc_output("--list-gpu-code")
    if out is None:
        return None
    codes = frozenset(c.removeprefix("sm_") for c in out.split() if c.startswith("sm_"))
    return codes or None


def _present_archs() -> list[CudaArch]:
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        return sorted({CudaArch(*torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())})
    except Exception:  # a broken driver must not stop anything here
        return []


def target_archs(env: str | None = None) -> tuple[list[CudaArch], list[str]]:
    """The architectures to build for and notes about what was dropped.

    The GPUs present always get native code; TORCH_CUDA_ARCH_LIST adds more; with
    neither (building ahead on a machine without a GPU) the default is 9.0 (H100/H200).
    Architectures this nvcc cannot target are dropped (the PTX still covers newer GPUs).
    """
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "") if env is None else env
    requested, bad = parse_arch_list(env)
    notes = [f"TORCH_CUDA_ARCH_LIST entry {token!r} is not an architecture; ignored" for token in bad]
    present = _present_archs()
    archs = set(present) | set(requested)
    # An arch-specific variant (9.0a) replaces the plain one for the same GPU.
    archs = {a for a in archs if a.suffix or CudaArch(a.major, a.minor, "a") not in archs}
    if not archs:
        archs = {CudaArch(9, 0)}
    supported = _nvcc_supported_sms()
    if supported is not None:
        # NOTE: --list-gpu-code lists plain codes only (sm_90, not sm_90a): check the base arch.
        dropped = sorted(a for a in archs if a.sm.rstrip("af") not in supported)
        if dropped:
            notes.append(f"nvcc cannot target {', '.join(map(str, dropped))}; built for the others "
                         "(the embedded PTX runs on newer GPUs)")
        archs = {a for a in archs if a.sm.rstrip("af") in supported}
        if not archs:
            plain = sorted(CudaArch(int(s[:-1]), int(s[-1])) for s in supported if s.isdigit())
            archs = {plain[-1]} if plain else set()
    return sorted(archs), notes


def gencode_flags(archs: list[CudaArch]) -> list[str]:
    """nvcc -gencode flags: machine code for each arch, PTX of the highest plain one (for newer GPUs)."""
    flags = [f"-gencode=arch=compute_{a.sm},code=sm_{a.sm}" for a in archs]
    plain = [a for a in archs if not a.suffix] or [CudaArch(a.major, a.minor) for a in archs]
    if plain:
        top = max(plain)
        flags.append(f"-gencode=arch=compute_{top.sm},code=compute_{top.sm}")
    return flags


# ---------------------------------------------------------------------------
# Environment

def cache_root() -> Path:
    """TOOLKIT_KERNELS_CACHE, else $XDG_CACHE_HOME/toolkit/kernels (~/.cache/toolkit/kernels)."""
    if os.environ.get("TOOLKIT_KERNELS_CACHE"):
        return Path(os.environ["TOOLKIT_KERNELS_CACHE"]).expanduser()
    return user_cache_dir() / "toolkit" / "kernels"


def find_nvcc() -> str | None:
    """The nvcc torch's extension builder will use: $CUDA_HOME (or $CUDA_PATH)/bin/nvcc, else the one on PATH, else
    /usr/local/cuda's (torch.utils.cpp_extension's guesses for CUDA_HOME, in its order).

    NOTE: not by importing cpp_extension, which imports setuptools: a cached start only loads finished
    builds, and that import was a second of it on the GPU image (benchmarks/RESULTS.md, "Command to first step")."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    on_path = shutil.which("nvcc")
    if on_path is not None:
        return on_path
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if not home and default.is_file() else None


@lru_cache(maxsize=None)
def nvcc_version() -> str | None:
    """'13.0' for the nvcc found, or None."""
    out = _nvcc_output("--version")
    match = re.search(r"release (\d+\.\d+)", out) if out is not None else None
    return match.group(1) if match else None


def nvcc_parallel_flags(version: str | None) -> tuple[str, ...]:
    """nvcc's own parallelism, for an nvcc that has it (12.1 and later): the two compilations of a file (machine
    code for the GPU's arch and the PTX for newer ones) side by side, and each one's optimisation passes
    over the file's kernels on all cores. Same code out; the norm forward's nvcc took 20.5 s wall alone,
    12.1 s with both on the 2-core VM (benchmarks/RESULTS.md, "Command to first step on a fresh H200")."""
    if version is None or tuple(int(p) for p in version.split(".")[:2]) < (12, 1):
        return ()
    return ("--threads=0", "--split-compile=0")


def _nvcc_output(flag: str) -> str | None:
    """What `nvcc <flag>` prints, or None when there is no nvcc or it cannot run.

    Remembered in the kernel cache per nvcc binary (path, size, mtime): a run's cache key asks nvcc twice,
    1.1 s of a cached start on the H200 machines, for answers that change only with the binary.
    """
    nvcc = find_nvcc()
    if nvcc is None:
        return None
    try:
        stat = os.stat(nvcc)
    except OSError:
        return None
    key = f"{os.path.realpath(nvcc)}|{stat.st_size}|{stat.st_mtime_ns}|{flag}"
    memo = cache_root() / "nvcc-answers.json"
    try:
        answers = json.loads(memo.read_text())
    except (OSError, ValueError):
        answers = {}
    if isinstance(answers, dict) and isinstance(answers.get(key), str):
        return answers[key]
    try:
        result = subprocess.run([nvcc, flag], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    out = result.stdout
    if result.returncode != 0:  # answered, but not remembered: the next run asks again
        return out
    try:  # a cache that cannot take the file only costs the next run the same question
        memo.parent.mkdir(parents=True, exist_ok=True)
        partial = memo.with_name(f"{memo.name}.{os.getpid()}")
        partial.write_text(json.dumps({**(answers if isinstance(answers, dict) else {}), key: out}))
        partial.replace(memo)
    except OSError:
        pass
    return out


def build_problem() -> tuple[str, str] | None:
    """Why no kernel can be built or loaded here, as (reason, fix); None when nothing is missing: CUDA torch and an
    nvcc of its CUDA major (a finished build's cache key names nvcc's version). No GPU is needed to build or import;
    a build also needs ninja, which ninja_problem asks only when there is no finished build."""
    try:
        import torch
    except Exception as exc:  # pragma: no cover - torch is a dependency
        return f"torch cannot be imported ({exc})", "install torch"
    if torch.version.cuda is None:
        return (f"this torch build has no CUDA (torch {torch.__version__})",
                "install a CUDA build of torch (https://pytorch.org/get-started)")
    if find_nvcc() is None:
        return ("no CUDA compiler: nvcc not found (CUDA_HOME unset, none on PATH)",
                f"install the CUDA {torch.version.cuda} toolkit (nvcc) or set CUDA_HOME to it")
    version = nvcc_version()
    if version is not None and version.split(".")[0] != torch.version.cuda.split(".")[0]:
        return (f"nvcc is CUDA {version} but torch was built with CUDA {torch.version.cuda}",
                f"point CUDA_HOME at a CUDA {torch.version.cuda.split('.')[0]}.x toolkit")
    return None


def ninja_problem() -> tuple[str, str] | None:
    """(reason, fix) when torch's extension builder cannot find ninja, else None."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (torch's extension builder needs it)", "pip install ninja"
    return None
