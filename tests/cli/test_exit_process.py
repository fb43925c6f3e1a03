"""How a `python -m toolkit` process ends: one that was a rank of a group leaves by os._exit after running the
exit handlers (gloo's threads may abort the interpreter's teardown: toolkit/distributed.py exit_process); any
other process exits normally."""
import subprocess
import sys

import pytest

SCRIPT = """
import atexit, sys
import toolkit.distributed as d
d._joined_group = {joined}
atexit.register(lambda: open(sys.argv[1], "w").write("handlers ran"))
print("printed, not yet flushed", end="")
d.exit_process(3)
print("not reached")
"""


@pytest.mark.parametrize("joined", [True, False])
def test_exit_process_runs_the_exit_handlers_flushes_and_keeps_the_code(tmp_path, joined):
    marker = tmp_path / "marker"
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(joined=joined), str(marker)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "printed, not yet flushed"
    assert marker.read_text() == "handlers ran"


END_RANK = """
import atexit, sys
import torch.distributed as dist
from toolkit.distributed import end_rank
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
atexit.register(lambda: open(sys.argv[1], "w").write("handlers ran, group left: " + str(not dist.is_initialized())))
print("printed, not yet flushed", end="")
end_rank(3)
print("not reached")
"""


def test_end_rank_leaves_the_group_and_the_process_by_os_exit(tmp_path):
    """A tutorial's torchrun rank script ends by end_rank: the group destroyed, the exit handlers run, the streams
    flushed, the code kept, and no interpreter teardown (where gloo's threads may abort it)."""
    marker = tmp_path / "marker"
    done = subprocess.run([sys.executable, "-c", END_RANK, str(marker), str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "printed, not yet flushed"
    assert marker.read_text() == "handlers ran, group left: True"
