"""The process group: set up from torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT), gloo on the CPU and NCCL on CUDA; one process
needs no launcher and no group at all. Plus the few small collectives the
engine needs whatever the ZeRO stage (a flag, a sum of floats). On the ground
floor because every layer above may ask where it runs (data deals batches by
rank, ops builds a kernel once per node, the engine joins the group).

What does not live here: bucketed gradient and parameter collectives (the
strategies in toolkit/runtime/zero/), launching processes (toolkit/train/launch.py).
"""
from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from toolkit.errors import UserError

_owned_group = False  # True when this module created the default process group (and so may destroy it)
_joined_group = False  # True once this process has been a rank of a group (it leaves by exit_process)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the data-parallel world."""
    rank: int
    world_size: int
    local_rank: int
    backend: str | None  # None: one process, no group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        """True when collectives must run (a group with more than one rank)."""
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{name}: {value!r} is not an integer (set by torchrun)") from None


def launched_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; (0, 1, 0) without a launcher."""
    return _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)


def select_cuda_device(device_choice: str) -> None:
    """Under torchrun, make cuda:LOCAL_RANK the current device before anything touches CUDA."""
    if device_choice != "cpu" and torch.cuda.is_available():
        _, world, local_rank = launched_world()
        if world > 1:
            torch.cuda.set_device(local_rank % torch.cuda.device_count())


def init_distributed(recipe_world_size: int, device: torch.device) -> DistInfo:
    """Join (or create) the process group torchrun describes; checks it matches the recipe's world size."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        _check_world(recipe_world_size, world)
        return DistInfo(rank, world, _env_int("LOCAL_RANK", rank), dist.get_backend())
    rank, world, local_rank = launched_world()
    _check_world(recipe_world_size, world)
    if world == 1:
        return DistInfo(0, 1, 0, None)
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise UserError(f"WORLD_SIZE={world} but MASTER_ADDR/MASTER_PORT are not set; launch with "
                        "`toolkit run --nproc N RECIPE` or `torchrun --nproc_per_node N -m toolkit run RECIPE`")
    # NOTE: gloo for CPU tensors, NCCL for CUDA ones; a group serves one device type here.
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, rank=rank, world_size=world,
                            device_id=device if device.type == "cuda" else None)
    global _owned_group, _joined_group
    _owned_group = _joined_group = True
    return DistInfo(rank, world, local_rank, backend)


def start_process_group(recipe_world_size: int, device_choice: str) -> DistInfo:
    """Join the group before anything rank dependent happens (the engine later finds it joined)."""
    select_cuda_device(device_choice)
    cuda = device_choice != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return init_distributed(recipe_world_size, device)


def broadcast_object(obj, info: DistInfo):
    """Rank 0's `obj` (picklable) on every rank."""
    if not info.active:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _check_world(recipe_world_size: int, world: int) -> None:
    if recipe_world_size != world:
        raise UserError(f"world size: the recipe's batch was resolved for {recipe_world_size} rank(s) but "
                        f"{world} process(es) run; load the recipe under the launcher (WORLD_SIZE) "
                        f"or pass world_size={world}")


# NOTE: torch 2.13 renamed the flat collectives (the old names warn); torch >= 2.4 has the old ones.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_flat(output: torch.Tensor, source: torch.Tensor, *, async_op: bool = True):
    """Sum `source` over the ranks; rank r receives chunk r of the sum in `output` (a work handle)."""
    return _reduce_scatter(output, source, async_op=async_op)


def all_gather_flat(output: torch.Tensor, chunk: torch.Tensor, *, async_op: bool = True):
    """Every rank's `chunk` laid end to end in `output` (a work handle)."""
    return _all_gather(output, chunk, async_op=async_op)


def any_true(flag: bool, info: DistInfo, device: torch.device, all_reduce=dist.all_reduce) -> bool:
    """True when `flag` is true on any rank (every rank gets the same answer); `all_reduce` issues the
    collective (the engine's counted one: toolkit/runtime/communicator.py)."""
    if not info.active:
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def sum_floats(values: list[float], info: DistInfo, device: torch.device, all_reduce=dist.all_reduce) -> list[float]:
    """Element-wise sum of a few floats over the ranks (float64 on the wire; `all_reduce` as for any_true)."""
    if not info.active:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    all_reduce(t)
    return t.tolist()


def barrier(info: DistInfo) -> None:
    """Wait for every rank (a no-op for one process)."""
    if info.active:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    """Leave the process group cleanly at the end of a run (one a caller created stays theirs)."""
    global _owned_group
    if info.active and _owned_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        _owned_group = False


def exit_process(code: int) -> None:
    """End the process with `code`. A rank that joined a group leaves without the interpreter's teardown."""
    if not _joined_group:
        sys.exit(code)
    # NOTE: gloo's worker threads can abort the interpreter's teardown ("terminate called without an active
    # exception": torch issues 190489, 109478; PR 179291 tried an atexit fix and was abandoned), turning a run
    # that finished into a SIGABRT its launcher reports as failed. By now the run's files are closed and the
    # group destroyed (shutdown); what is left is the exit handlers (swap folders: runtime/zero/swap.py) and
    # the streams.
    _exit_without_teardown(code)


def end_rank(code: int = 0) -> None:
    """The end of a rank script that joined a process group itself (a tutorial's, launched by torchrun), once its
    results are written: wait for the other ranks, leave the group, then end the process without the interpreter's
    teardown, where gloo's threads can abort it (exit_process says why). Not for a multiprocessing child: it runs
    its parent's exit handlers, and multiprocessing ends its children with os._exit already."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _exit_without_teardown(code)


def _exit_without_teardown(code: int) -> None:
    """Exit handlers (swap folders: runtime/zero/swap.py), the streams, then os._exit."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
