"""nbval runs each notebook in a fresh kernel whose working directory is
tutorials/; put the checkout on the kernel's PYTHONPATH so `import toolkit`
finds this source tree even when the package is not installed. The GPU
variants (tutorials/gpu/) are executed on a GPU by benchmarks/gpu_check.sh, not here."""
import os
from pathlib import Path

collect_ignore = ["gpu"]

_ROOT = str(Path(__file__).resolve().parent.parent)
# NOTE: the kernels' idle OpenMP threads sleep, as under the CLI that stored the outputs (`tutorials build
# --execute`): spinning, a kernel's second torch thread starves the other test worker on a 2-core machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [_ROOT, os.environ.get("PYTHONPATH", "")] if p)
