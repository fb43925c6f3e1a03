"""`python -m toolkit` is the `toolkit` command (what torchrun and `toolkit run --nproc` start in each rank)."""
from toolkit.cli.main import main
from toolkit.distributed import exit_process

exit_process(main())
