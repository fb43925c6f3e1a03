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


def wait_for_step(out_file: Path, step: int, proc, timeout: float = 180) -> None:
    """Wait until a run's console output (`out_file`) shows `step`; fails if `proc` ends first."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        if f"step {step:>6}/" in out_file.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"no step {step} within {timeout}s")
