"""observe/notebook.py: what the tutorial notebooks use to measure and to show.

The notebooks under tutorials/ import these instead of pasting them into a cell, so that a visible cell
tells the lesson (run this, compare that) and the measuring plumbing is tested here once:
a Markdown table of measured values, the Markdown tables of benchmarks/RESULTS.md, the bytes autograd
keeps for backward, a resident set that follows the live tensors, the model states that exist between
steps, the bytes one training step adds, the peak of a run in a process of its own, a script on several ranks
in one launch, and the median time of a call. Nothing in training imports this module.

NOTE: torch and IPython are imported inside the functions that need them: `toolkit tutorials build`
reads `markdown_tables` from here and must stay free of torch.
"""
from __future__ import annotations

import time


def markdown_table(headers, rows) -> str:
    """Headers and rows (each value already formatted as it should read) as the text of a Markdown table."""
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def show_table(headers, rows) -> None:
    """Display measured values as a Markdown table in the notebook (`markdown_table`'s text)."""
    from IPython.display import Markdown, display

    display(Markdown(markdown_table(headers, rows)))


def markdown_tables(text: str) -> list[list[dict[str, str]]]:
    """Every Markdown table in `text`, each a list of {column: cell} rows."""
    tables, lines = [], text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and lines[i + 1].startswith(("|---", "| ---")) and (i == 0 or not lines[i - 1].startswith("|")):
            header = [c.strip() for c in line.strip().strip("|").split("|")]
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(header, (c.strip() for c in row.strip().strip("|").split("|")))))
            tables.append(rows)
    return tables


def saved_activation_bytes(engine, batch, *, train: bool = False) -> int:
    """Bytes autograd keeps for backward during one forward `engine(batch)` (parameters excluded, each storage once);
    `train`: that forward's backward and optimizer step follow (a training step that measures itself)."""
    import torch

    def key(tensor):  # NOTE: with the device: a CPU and a CUDA storage may share an address
        storage = tensor.untyped_storage()
        return storage.data_ptr(), str(storage.device)

    params = {key(p) for p in engine.model.parameters()}
    saved = {}

    def pack(tensor):
        if key(tensor) not in params:
            saved[key(tensor)] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = engine(batch)
    if train:
        engine.backward(loss)
        engine.step()
    return sum(saved.values())


def rss_follows_tensors() -> bool:
    """Make the resident set follow live tensors (glibc: blocks >= 64 KiB mapped and unmapped with their tensor);
    False where that is not glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD; setting it also stops glibc from raising it later
        libc.malloc_trim(0)  # and the heap glibc kept so far goes back to the OS
        return True
    except (OSError, AttributeError):  # not glibc: a CPU peak is then coarser
        return False


def synchronize(device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU, whose work is done when the call returns."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def live_state_bytes(engine) -> int:
    """Model-state bytes that exist now, between steps: the memory monitor's `model_state_bytes`, less the
    gradients a one-process stage-0 engine has freed (its memory line counts them as large as the parameters,
    since they live from backward to the step; a step's own peak counts them again when backward makes them)."""
    from toolkit.observe.memory_monitor import model_state_bytes

    states = model_state_bytes(engine)
    strategy = engine.strategy  # every engine's ZeRO strategy has a stage and a process group (runtime/strategy.py)
    if strategy.stage == 0 and not strategy.info.active:
        grads = sum(p.grad.nbytes for p in engine.model.parameters() if p.grad is not None)
        return states.total - states.grads + grads
    return states.total


def step_peak_bytes(engine, micro_batches) -> int:
    """Peak bytes one `engine.train_batch(micro_batches)` adds above what was live before it (CUDA allocator on
    a GPU; on the CPU the peak resident set, after `rss_follows_tensors`)."""
    import torch

    from toolkit.observe.memory_monitor import PeakMemory, rss_bytes

    peaks = PeakMemory(engine.device)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(engine.device)
    else:
        rss_follows_tensors()
        before = rss_bytes()
    peaks.reset()
    engine.train_batch(micro_batches)
    return peaks.read()["mem_peak_bytes"] - before


def fresh_process_peak_bytes(recipe: str, overrides, run_dir) -> int:
    """The largest `mem_peak_bytes` of `toolkit run recipe *overrides` in a process of its own (nothing an
    earlier run in this process left allocated counts), read from its run directory's metrics.jsonl."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-m", "toolkit", "run", recipe, *overrides, "--run-dir", str(run_dir)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"toolkit run {recipe} failed (exit code {done.returncode}): {done.stderr[-2000:]}")
    lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return max(line.get("mem_peak_bytes", 0) for line in lines)


def launch_ranks(script: str, out_dir, nproc: int):
    """Run `script` on `nproc` ranks in one launch (`python -m torch.distributed.run --standalone`, what `toolkit
    run --nproc` starts), with `out_dir` (where the script is written) as its argument, importing the toolkit this
    process imported; the finished `subprocess.CompletedProcess`, its output captured."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = Path(out_dir) / "ranks.py"
    path.write_text(script)
    package_root = Path(__file__).resolve().parents[2]  # the folder that holds this toolkit package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package_root), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           str(path), str(out_dir)], env=env, capture_output=True, text=True)


def median_ms(fn, device, calls: int = 1, repeats: int = 5) -> float:
    """Median milliseconds per `fn()` over `repeats` rounds of `calls` calls, after one warm-up call (CUDA events
    on a GPU, perf_counter on the CPU)."""
    import statistics

    import torch

    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if torch.device(device).type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append(1e3 * (time.perf_counter() - start) / calls)
    return statistics.median(times)
