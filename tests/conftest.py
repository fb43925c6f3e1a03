"""Shared test set-up: GPU tests carry the `cuda` marker and are skipped without CUDA."""
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300):
    """Run `python -m toolkit ARGS` in a subprocess; returns CompletedProcess (text)."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "toolkit", *args], cwd=cwd or REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
