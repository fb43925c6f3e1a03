"""`python -m toolkit` is the `toolkit` command (what torchrun and `toolkit run --nproc` start in each rank)."""
import sys

from toolkit.cli.main import main

code = main()
# NOTE: not imported up here: toolkit.distributed loads torch, which a refusal must not wait for.
distributed = sys.modules.get("toolkit.distributed")
if distributed is not None:  # a process that never loaded it joined no group
    distributed.exit_process(code)
sys.exit(code)
