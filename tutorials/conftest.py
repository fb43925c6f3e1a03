"""nbval runs each notebook in a fresh kernel whose working directory is
tutorials/; put the checkout on the kernel's PYTHONPATH so `import toolkit`
finds this source tree even when the package is not installed."""
import os
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [_ROOT, os.environ.get("PYTHONPATH", "")] if p)
