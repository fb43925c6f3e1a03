"""Executing notebooks: each one top to bottom in a fresh Jupyter kernel, written back with its outputs
(`toolkit tutorials build --execute`; the rendering is toolkit/cli/tutorials.py)."""
from __future__ import annotations

from pathlib import Path


def execute_notebooks(paths: list[Path], timeout_s: int = 900, root: Path | None = None):
    """Run each notebook top to bottom in a fresh python3 kernel (its folder as the working directory, `root`, the
    folder that holds the toolkit package, first on PYTHONPATH) and write it back with its outputs, a failing one
    too (its error shows where); yields (path, seconds, the error's first line or None) as each one is written."""
    import os
    import time

    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    root = str(root or Path(__file__).resolve().parents[2])
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, old) if p)
    try:
        for path in paths:
            nb = nbformat.read(path, as_version=4)
            rendered_metadata = dict(nb.metadata)
            start, error = time.perf_counter(), None
            # NOTE: no per-cell timing metadata: an executed notebook differs from the last only in its outputs.
            client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3", record_timing=False,
                                    resources={"metadata": {"path": str(path.parent)}})
            try:
                client.execute()
            except CellExecutionError as exc:
                error = f"{exc.ename}: {exc.evalue}".splitlines()[0][:300]
            nb.metadata = rendered_metadata  # the kernel's language_info (its Python version) would make it stale
            path.write_bytes((nbformat.writes(nb, version=4).rstrip("\n") + "\n").encode("utf-8"))
            # NOTE: one by one, so that a run cut short (a device call's time limit) keeps what it finished.
            yield path, time.perf_counter() - start, error
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
