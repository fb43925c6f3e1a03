"""Pre-flight: every check that can refuse a run, made once the recipe is loaded and the run
directory decided, before anything slow (kernel builds, swap-file reservation, model
construction, data) and before the run directory is made, so a refused run leaves nothing
behind. In this order, every problem reported at once (one UserError, a line each, exit 2):

1. optional packages the recipe's keys need (toolkit/optional_packages.py);
2. memory: the estimate per rank against the device's free memory and the host's available
   memory (toolkit/observe/memory_fit.py; `training.memory_check` may make it a warning);
3. disk: `zero.nvme_path` is a writable folder; one checkpoint and the swap files fit the free
   space of the disks they go on, summed where they share one (toolkit/observe/disk_fit.py).

Torch-free itself. `toolkit run` calls it before torch is loaded (`gpu=False`: a CUDA device's
free memory is torch's to tell, so the host's side only), and `toolkit.run` again with the
device on every rank (loop.py: any rank's refusal stops them all). `toolkit validate` says the
memory and disk lines as warnings (`machine_fit_warnings`).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import UserError
from toolkit.observe.disk_fit import disk_fit_problems, estimated_parameters
from toolkit.observe.memory_fit import certainly_cpu, memory_findings, memory_fit_lines, ranks_on_host
from toolkit.optional_packages import missing_for_recipe
from toolkit.specs import Recipe
from toolkit.train.run_dir import default_run_dir


@dataclass(frozen=True)
class Preflight:
    """What the pre-flight found: the lines that refuse the run, the lines to say anyway (warnings,
    notes) and the estimator's parameter count (None: it cannot size the model before it is built)."""

    refusals: list[str]
    said: list[str]
    num_parameters: int | None

    def say(self) -> None:
        """Print the warnings and notes to stderr (rank 0 only: every rank finds the same)."""
        for line in self.said if os.environ.get("RANK", "0") == "0" else ():
            print(line, file=sys.stderr, flush=True)


def checkpoint_dir_of(recipe: Recipe, run_dir: Path) -> Path | None:
    """Where the run's checkpoints go (None: it saves none)."""
    saves = recipe.checkpoint.interval > 0 or recipe.checkpoint.save_final
    return Path(run_dir) / recipe.checkpoint.dir if saves else None


def preflight(recipe: Recipe, run_dir: Path, device, *, gpu: bool = True) -> Preflight:
    """Every check that can refuse `recipe` in `run_dir` on `device` ("cpu", "cuda" or a torch.device), in
    the order of the module's list; it writes nothing. `gpu=False`: the host's side of a CUDA run only."""
    ranks = ranks_on_host(recipe)
    packages, _ = missing_for_recipe(recipe)  # a missing optional feature (matplotlib) is noted at the end
    memory, said = memory_findings(recipe, device, ranks=ranks, gpu=gpu)
    disk = disk_fit_problems(recipe, checkpoint_dir_of(recipe, run_dir), ranks=ranks)
    return Preflight([*packages, *memory, *disk], said, estimated_parameters(recipe))


def check_before_torch(recipe: Recipe, run_dir: str | Path | None) -> None:
    """`toolkit run`'s pre-flight before torch is imported: refuses (UserError) in a second what this machine
    cannot run; says nothing else (the run's own pre-flight says the warnings)."""
    device = "cpu" if certainly_cpu(recipe) else "cuda"
    found = preflight(recipe, Path(run_dir or default_run_dir(recipe)), device, gpu=False)
    if found.refusals:
        raise UserError(*found.refusals)


def machine_fit_warnings(recipe: Recipe) -> list[str]:
    """`toolkit validate`'s lines for a recipe this machine cannot hold: memory, against the host (where a GPU
    driver shows, only the host's side of the run: the GPU's free memory needs torch, which validate does
    not import), and disk, for a run under ./runs (`toolkit run`'s default) and zero.nvme_path."""
    ranks = ranks_on_host(recipe)  # validate --world-size N: N ranks, all on this host
    lines = []
    if recipe.training.memory_check != "off":
        try:
            lines += memory_fit_lines(recipe, "cpu" if certainly_cpu(recipe) else "cuda", ranks=ranks, gpu=False)
        except UserError:  # a pretrained folder the estimator cannot size: nothing to say
            pass
    run_dir = Path("runs") / f"{recipe.name}-<timestamp>"  # default_run_dir's, as a run started now names it
    return lines + disk_fit_problems(recipe, checkpoint_dir_of(recipe, run_dir), ranks=ranks)
