"""How many CPU threads a run's torch ops use (`training.cpu_threads`), chosen on purpose.

torch's default is one thread per logical CPU, and OpenMP threads busy-wait (spin) at
the end of every parallel region. On a machine shared with other work that is the worst
case: a thread waits for a sibling the scheduler has parked, and the spinning steals the
CPU from the one thread with work. Measured on a 2-core EPYC VM (2026-12-03), 60
quickstart steps' loop beside two busy processes: 2 spinning threads 75-161 s, 1 thread
9-11 s; in ad-hoc runs there, 2 passive threads 11 s, and for a 40-GFLOP-per-micro-batch
model 2 spinning threads 62-71 s, 2 passive 21-29 s, 1 thread 24 s. So:
- the CLI sets OMP_WAIT_POLICY=PASSIVE (idle threads sleep) unless the user set it; it
  must be in the environment before torch loads OpenMP, hence `set_openmp_wait_policy`;
- "auto" respects an explicit OMP_NUM_THREADS, else takes the cores this process may run
  on (os.sched_getaffinity) shared among the ranks on this host, and one thread for a
  model whose micro batch is too little work to split (SMALL_WORK_FLOPS).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from toolkit.observe.estimate import parameter_count, resolve_model_shape
from toolkit.specs import ModelSpec

# NOTE: below about a GFLOP per micro batch (6 x parameters x tokens) a step is tens of
# milliseconds of small ops: on the idle 2-core VM a second thread made the whole quickstart
# run 8% faster (8.8 vs 9.6 s wall, 3 runs each), beside busy neighbours 8-15x slower.
# The quickstart does 0.74.
SMALL_WORK_FLOPS = 1e9


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count for torch's intra-op pool and why."""

    count: int
    reason: str

    def describe(self) -> str:
        return f"{self.count} torch thread{'s' if self.count != 1 else ''} ({self.reason})"


def set_openmp_wait_policy() -> None:
    """Idle OpenMP threads sleep instead of spinning, unless the user chose (call before torch is imported)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def usable_cores() -> int:
    """The logical CPUs this process may run on (its affinity mask, which taskset and cgroups narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def choose_threads(setting: int | str, model: ModelSpec, tokens_per_micro_batch: int) -> ThreadChoice:
    """training.cpu_threads (`setting`) resolved: an integer as given; auto as the module says, sized by the
    model and the tokens of one micro batch."""
    if setting != "auto":
        return ThreadChoice(int(setting), "training.cpu_threads")
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return ThreadChoice(int(given), "OMP_NUM_THREADS")
    ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    cores = usable_cores()
    per_rank = max(cores // ranks, 1)
    shape, tied = resolve_model_shape(model)
    work = 6 * parameter_count(shape, tied_embeddings=tied) * tokens_per_micro_batch
    share = f"{cores} usable cores" + (f" / {ranks} ranks" if ranks > 1 else "")
    if work < SMALL_WORK_FLOPS and per_rank > 1:
        return ThreadChoice(1, f"auto: {work / 1e9:.2f} GFLOP per micro batch is too little to split; {share}")
    return ThreadChoice(per_rank, f"auto: {share}")


def apply_threads(choice: ThreadChoice) -> ThreadChoice:
    """Set torch's intra-op thread count to `choice`; returns it."""
    import torch

    if torch.get_num_threads() != choice.count:
        torch.set_num_threads(choice.count)
    return choice


def doctor_line() -> str:
    """What `training.cpu_threads=auto` starts from here: usable cores, OMP_NUM_THREADS, the wait policy."""
    given = os.environ.get("OMP_NUM_THREADS")
    auto = (f"OMP_NUM_THREADS={given}, so auto uses {given}" if given else
            f"auto: 1 thread under {SMALL_WORK_FLOPS / 1e9:g} GFLOP per micro batch, else {usable_cores()}")
    return (f"cpu threads: {usable_cores()} usable cores (affinity) of {os.cpu_count()}; {auto} (divided among "
            f"local ranks); OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}; "
            f"set per recipe with training.cpu_threads")
