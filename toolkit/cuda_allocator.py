"""The CUDA caching allocator's settings a run uses: expandable segments unless the user chose.

torch's caching allocator by default carves device memory into fixed segments and keeps what it frees; a
segment that held a large tensor is split for smaller ones and seldom whole again. Reserved memory (what the
card is really short of) then runs above the allocated peak: 1.006-1.81x, median 1.10, over the 49 H200
calibration rows (the most at stage 3 with parameters offloaded, 1.35 at stages 0-2). With
`expandable_segments:True` a segment grows in place instead, and reserved follows the allocated peak:
1.002-1.06x (median 1.014) over 35 rows of the GPU matrix, 1.003-1.15x over 18 held-out rows, with the same
tokens/s (H100, 2026-12-07: gpt2-124m 0.998x, gpt2-1.5b-h200 1.001x, alternated runs;
benchmarks/RESULTS.md "Memory model calibration"). torchtitan runs with it too.

So the command line turns it on (`use_expandable_segments_by_default`, before torch is imported) unless
PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF is set; the memory model reads the setting in effect
(`expandable_segments`). An engine built from Python keeps the process's own setting.
"""
from __future__ import annotations

import os

# torch reads either; which one wins where both are set has changed between versions, so set neither if one is.
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
DEFAULT_ALLOC_CONF = "expandable_segments:True"


def use_expandable_segments_by_default(environ: dict | None = None) -> None:
    """Expandable segments for the CUDA allocator, unless the user set its variables (call before torch loads)."""
    environ = os.environ if environ is None else environ
    if not any(environ.get(name) for name in ALLOC_CONF_VARIABLES):
        environ["PYTORCH_CUDA_ALLOC_CONF"] = DEFAULT_ALLOC_CONF


def alloc_conf(environ: dict | None = None) -> str:
    """The allocator settings in effect: the first of the variables that is set ("" for torch's defaults)."""
    environ = os.environ if environ is None else environ
    return next((environ[name] for name in ALLOC_CONF_VARIABLES if environ.get(name)), "")


def expandable_segments(conf: str | None = None) -> bool:
    """Whether allocator settings `conf` (default: those in effect) turn on expandable segments (torch reads
    `expandable_segments:True` or `:False`; the last one given counts)."""
    on = False
    for item in (alloc_conf() if conf is None else conf).split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            on = value.strip() == "True"
    return on


def segments_name(conf: str | None = None) -> str:
    """"expandable segments" or "torch's default segments", for settings `conf` (default: those in effect)."""
    return "expandable segments" if expandable_segments(conf) else "torch's default segments"


def describe() -> str:
    """The start-up table's and doctor's words for the setting in effect (CUDA runs)."""
    conf = alloc_conf()
    return f"CUDA allocator: {segments_name(conf)} ({conf or 'no PYTORCH_CUDA_ALLOC_CONF'})"
