"""`toolkit run --nproc N`: start N ranks on this machine through torch.distributed's
elastic launcher (what `torchrun --standalone --nproc_per_node N` runs), each
executing `python -m toolkit run ...` with RANK / WORLD_SIZE / MASTER_ADDR set.

The recipe is validated for N ranks before anything starts, so a user mistake is
one line and exit code 2 here, not N copies of it from the ranks.
"""
from __future__ import annotations

import os
import sys
import uuid

from toolkit.errors import UserError


def threads_per_rank(nproc: int) -> int:
    """CPU threads each rank may use: the cores split evenly (torchrun's default is 1)."""
    return max(1, (os.cpu_count() or 1) // nproc)


def launch_ranks(nproc: int, toolkit_args: list[str]) -> int:
    """Run `python -m toolkit *toolkit_args` as `nproc` ranks; the exit code (2 when a rank hit a user error)."""
    if nproc < 1:
        raise UserError(f"--nproc {nproc}: must be at least 1")
    if "WORLD_SIZE" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        raise UserError("--nproc inside a torchrun launch: give one or the other")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # NOTE: each rank gets its share of the cores; torchrun would give each one thread.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1)
    try:
        elastic_launch(config, sys.executable)("-m", "toolkit", *toolkit_args)
    except ChildFailedError as exc:
        codes = sorted({f.exitcode for f in exc.failures.values()})
        ranks = sorted(exc.failures)
        print(f"error: rank(s) {', '.join(map(str, ranks))} of {nproc} exited with code(s) "
              f"{', '.join(map(str, codes))} (their messages are above)", file=sys.stderr, flush=True)
        return 2 if 2 in codes else 1
    return 0
