"""nbval runs each notebook in a fresh kernel whose working directory is
tutorials/; put the checkout on the kernel's PYTHONPATH so `import toolkit`
finds this source tree even when the package is not installed. The GPU
variants (tutorials/gpu/) are executed on a GPU by benchmarks/gpu_check.sh, not here."""
import os
from pathlib import Path

collect_ignore = ["gpu"]

_ROOT = str(Path(__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [_ROOT, os.environ.get("PYTHONPATH", "")] if p)
