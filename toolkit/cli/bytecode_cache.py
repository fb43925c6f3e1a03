"""Where a `toolkit` process keeps the bytecode of what it imports, when the environment keeps none.

Container images often set PYTHONDONTWRITEBYTECODE=1 and install their packages without .pyc files (`pip install
--no-compile`). Then every process compiles torch's and transformers' sources again: on the H200 image that was 6-7 s
of a 13-18 s cached start (benchmarks/RESULTS.md, "Command to first step"), and on every rank and every tuner trial.

So when Python may not write bytecode (`sys.dont_write_bytecode`) and torch has no .pyc beside its sources, the CLI
points `sys.pycache_prefix` at a folder of the toolkit's cache and lets Python write there: the first run fills it
(65-75 MB for torch and transformers), later runs read it. Nothing is written beside the packages, which is what
the setting protects. The processes a command starts (torchrun's launcher, the ranks, `toolkit tune`'s trials) get
the folder through PYTHONPYCACHEPREFIX. Python checks each .pyc against its source's size and time, so an upgraded
package is compiled again, and it writes them atomically, so ranks starting together are safe.

Left alone: an install that keeps .pyc beside its sources (a plain `pip install`; a prefix would make Python ignore
them and compile everything once more), an explicit PYTHONPYCACHEPREFIX, and a Python that writes bytecode anyway.
TOOLKIT_BYTECODE_CACHE: a folder to use instead of $XDG_CACHE_HOME/toolkit/bytecode, or "off".
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from toolkit.resources import user_cache_dir

ENV = "TOOLKIT_BYTECODE_CACHE"
_used: Path | None = None  # the folder use_bytecode_cache chose in this process


def default_folder() -> Path:
    """$XDG_CACHE_HOME/toolkit/bytecode (~/.cache/toolkit/bytecode), beside the kernel cache."""
    return user_cache_dir() / "toolkit" / "bytecode"


def keeps_no_bytecode(probe: str = "torch") -> bool:
    """True when Python may not write bytecode and `probe` (a top-level package, not imported) has none beside its
    sources, so that every process would compile it again."""
    if not sys.dont_write_bytecode or sys.pycache_prefix:
        return False
    spec = importlib.util.find_spec(probe)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    return not os.path.exists(importlib.util.cache_from_source(spec.origin))


def use_bytecode_cache(probe: str = "torch") -> Path | None:
    """Send this process's bytecode to the toolkit's folder when the environment keeps none (module docstring):
    the folder, or None when nothing changed. Call it before torch is imported. Child processes (torchrun's
    launcher, the ranks, `toolkit tune`'s trials) inherit the folder through PYTHONPYCACHEPREFIX; the toolkit's own
    write there too."""
    global _used
    setting = os.environ.get(ENV, "")
    if setting == "off":
        return None
    folder = Path(setting).expanduser() if setting else default_folder()
    inherited = sys.pycache_prefix == str(folder)  # a parent toolkit process chose it
    if not inherited and not keeps_no_bytecode(probe):
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # NOTE: no cache is only slower; a start-up must not fail for it
    if not os.access(folder, os.W_OK):
        return None
    sys.pycache_prefix = str(folder)
    sys.dont_write_bytecode = False
    os.environ["PYTHONPYCACHEPREFIX"] = str(folder)
    _used = folder
    return folder


def bytecode_lines(probe: str = "torch") -> list[str]:
    """`toolkit doctor`'s word on bytecode: kept in the toolkit's folder, or compiled again by every run (and why)."""
    if _used is not None and sys.pycache_prefix == str(_used):
        return [f"python bytecode: kept in {_used} (this environment keeps none beside the packages; {ENV}=off "
                "turns that off)"]
    if keeps_no_bytecode(probe):
        why = f"{ENV}=off" if os.environ.get(ENV) == "off" else "the toolkit's bytecode folder is not writable"
        return [f"python keeps no bytecode here (PYTHONDONTWRITEBYTECODE or -B, no .pyc beside torch, {why}): every "
                "run compiles torch's and transformers' sources again (6-7 s of a 13-18 s cached start on the H200 "
                "image)"]
    return []
