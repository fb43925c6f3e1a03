"""Does a run's disk need fit this machine? One checkpoint under the run directory (about
`CHECKPOINT_BYTES_PER_PARAMETER` per parameter) and ZeRO-Infinity's swap files under
`zero.nvme_path` (tiers.py's nvme bytes for each rank on this host), held against the free
space of the disks they go on, summed where both go on the same one (swap files reserved
first leave a checkpoint no room). Plus `zero.nvme_path` itself: a folder that exists and
this user may write.

Torch-free: the pre-flight (toolkit/train/preflight.py) and `toolkit validate` call it before
anything slow; the engine's swap folder (toolkit/runtime/zero/swap.py) checks its exact need
with `check_nvme_path`.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from toolkit.errors import UserError
from toolkit.observe.estimate import format_bytes
from toolkit.observe.estimate_input import EstimateInput
from toolkit.observe.tiers import input_tiers
from toolkit.specs import Recipe

# NOTE: measured on quickstart: 12.7 bytes per parameter at stage 0 fp32 (fp32 weights + AdamW's two
# fp32 moments, plus RNG and data state), 12.1 at stage 2 bf16 (fp32 master + moments in the ZeRO shard).
CHECKPOINT_BYTES_PER_PARAMETER = 12


def nearest_existing(path: Path) -> Path:
    """`path`, or its closest ancestor that exists (where a new folder's bytes will land)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def checkpoint_bytes(num_parameters: int) -> int:
    """About how many bytes one checkpoint takes on disk (all ranks' files together)."""
    return num_parameters * CHECKPOINT_BYTES_PER_PARAMETER


def estimated_parameters(recipe: Recipe) -> int | None:
    """The recipe's parameter count as the estimator has it, before any model is built (None: it cannot
    size the model, a pretrained folder it does not know)."""
    try:
        return EstimateInput.from_recipe(recipe).num_params
    except UserError:
        return None


def swap_bytes(recipe: Recipe, num_parameters: int, ranks_on_host: int) -> int:
    """Bytes of swap files the recipe's ranks on this host reserve under zero.nvme_path (0: no nvme tier)."""
    z = recipe.zero
    if "nvme" not in (z.offload_optimizer, z.offload_param):
        return 0
    return input_tiers(EstimateInput.from_recipe(recipe), num_params=num_parameters).nvme * ranks_on_host


def nvme_path_problem(path: str | None) -> str | None:
    """Why zero.nvme_path cannot hold swap files (no such folder, not writable), or None."""
    if not path:
        return "recipe.zero.nvme_path: needed by zero.offload_optimizer / offload_param 'nvme'"
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return f"recipe.zero.nvme_path: {path}: no such folder (make it, on a fast local disk)"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"recipe.zero.nvme_path: {path}: not writable by this user"
    return None


def _swap_room_line(path, need: int, free: int) -> str:
    return (f"recipe.zero.nvme_path: {path}: {free / 2**30:.1f} GiB free, the swap files need "
            f"{need / 2**30:.1f} GiB (this host's ranks; `toolkit estimate` shows the nvme column)")


def checkpoint_room_line(checkpoint_dir: Path, num_parameters: int, free: int) -> str:
    """The refusal for a disk with `free` bytes that one checkpoint of `num_parameters` does not fit."""
    needed = checkpoint_bytes(num_parameters)
    return (f"{checkpoint_dir}: {free / 1e9:.2f} GB free, but a checkpoint of {num_parameters:,} "
            f"parameters takes about {needed / 1e9:.2f} GB ({CHECKPOINT_BYTES_PER_PARAMETER} bytes "
            "each: fp32 weights and AdamW's two moments); free space or choose another --run-dir")


def check_nvme_path(path: str | None, need_bytes: int) -> Path:
    """zero.nvme_path as a folder that exists, is writable and has `need_bytes` free; else one UserError line."""
    problem = nvme_path_problem(path)
    if problem:
        raise UserError(problem)
    folder = Path(path).expanduser()
    free = shutil.disk_usage(folder).free
    if free < need_bytes:
        raise UserError(_swap_room_line(path, need_bytes, free))
    return folder


def disk_fit_problems(recipe: Recipe, checkpoint_dir: Path | None, *, ranks: int) -> list[str]:
    """One line per problem with where the run writes: zero.nvme_path (when a tier is nvme) is no writable
    folder; a disk cannot take what goes on it: one checkpoint in `checkpoint_dir` (None: the run saves none)
    and the swap files of `ranks` ranks on this host, summed where both go on the same disk."""
    z = recipe.zero
    num_parameters = estimated_parameters(recipe)
    lines = []
    folder_problem = nvme_path_problem(z.nvme_path) if "nvme" in (z.offload_optimizer, z.offload_param) else None
    if folder_problem:
        lines.append(folder_problem)
    if num_parameters is None:  # nothing to size: the engine checks its exact need once the model is built
        return lines
    needs = {}  # what -> (where, bytes)
    if checkpoint_dir is not None:
        needs["checkpoint"] = (Path(checkpoint_dir), checkpoint_bytes(num_parameters))
    swap_need = swap_bytes(recipe, num_parameters, ranks)
    if swap_need and not folder_problem:
        needs["swap"] = (Path(z.nvme_path).expanduser(), swap_need)
    disks: dict[int, tuple[int, dict]] = {}  # device -> (free bytes, the needs that go there)
    for what, (where, nbytes) in needs.items():
        existing = nearest_existing(where)
        usage = shutil.disk_usage(existing)
        # NOTE: pseudo filesystems (sysfs, procfs) report a size of 0: nothing to measure; there the run
        # directory cannot be made at all, which claiming it says in its own words.
        if usage.total:
            disks.setdefault(os.stat(existing).st_dev, (usage.free, {}))[1][what] = nbytes
    for free, on_disk in disks.values():
        total = sum(on_disk.values())
        if free >= total:
            continue
        if len(on_disk) == 2:  # the swap files are reserved first: then a checkpoint finds no room
            checkpoint, swap = on_disk["checkpoint"], on_disk["swap"]
            lines.append(f"recipe.zero.nvme_path: {z.nvme_path}: on the same disk as the checkpoints "
                         f"({checkpoint_dir}), {format_bytes(free)} free, but the swap files need {format_bytes(swap)} "
                         f"and one checkpoint about {format_bytes(checkpoint)} ({format_bytes(total)} together); "
                         "free space, or put zero.nvme_path or the run directory (--run-dir) on another disk")
        elif "checkpoint" in on_disk:
            lines.append(checkpoint_room_line(checkpoint_dir, num_parameters, free))
        else:
            lines.append(_swap_room_line(z.nvme_path, swap_need, free))
    return lines
