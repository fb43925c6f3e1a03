"""Does a recipe fit this machine's memory? The pre-flight's memory check
(toolkit/train/preflight.py), made before the model, the kernels or the data are
built: the calibrated peak per rank (toolkit/observe/peak.py: model states,
activations and logits, on the CPU also the process and the synthetic token
buffers) against what the device has now
(CUDA: free memory from the driver; the host: MemAvailable, or a cgroup limit when
lower), refused in one line that names the keys that drive the size and the ways
out. `training.memory_check` turns it into a warning, or off.

Also the last resort: `allocation_failure` turns an allocator's out-of-memory error
that still happens into the same kind of line.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

from toolkit import cuda_allocator
from toolkit.errors import UserError
from toolkit.observe.estimate import format_bytes
from toolkit.observe.estimate_input import EstimateInput
from toolkit.observe.peak import CALIBRATION_TOLERANCE, CPU_RSS_BAND, CPU_RUNTIME_BYTES, predict_peak
from toolkit.recipe.checks import gpu_driver_visible
from toolkit.specs import SPECULATED_SHARE, Recipe


@dataclass(frozen=True)
class Term:
    """One part of a rank's memory and the recipe keys (with their values) that size it."""

    what: str
    nbytes: int
    keys: str


def host_available_bytes() -> tuple[int, str]:
    """Bytes the host can still give (MemAvailable; a lower cgroup v2 limit wins) and where that came from."""
    available, source = None, "MemAvailable"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if available is None:  # not Linux: free physical pages
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        source = "free physical memory"
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max" and int(limit) - used < available:
            available, source = int(limit) - used, "the cgroup's memory.max"
    except (OSError, ValueError):
        pass
    return max(available, 0), source


def _vocab_words(recipe: Recipe) -> str:
    """The vocabulary as a message names it: by its recipe key (data.vocab_size, else the model's)."""
    return f"data.vocab_size {recipe.data.vocab_size or recipe.model.vocab_size}"


def size_terms(recipe: Recipe, *, on_cuda: bool) -> tuple[list[Term], list[Term]]:
    """(device terms, host terms) of one rank: the calibrated peak (toolkit/observe/peak.py) term by term."""
    m, d, b, z = recipe.model, recipe.data, recipe.batch, recipe.zero
    peak = predict_peak(recipe, on_cuda=on_cuda)
    shape = "model.pretrained" if m.pretrained else (f"model.n_embd {m.n_embd}, model.n_layer {m.n_layer}, "
                                                     f"{_vocab_words(recipe)}")
    states = Term("model states", peak.states + peak.weight_cache + peak.step_temporaries,
                  f"{shape}, zero.stage {z.stage}, world size {b.world_size}, precision.dtype {recipe.precision.dtype}")
    acts = Term("activations", peak.activations + peak.logits,
                f"batch.micro_batch_per_rank {b.micro_batch_per_rank} x data.seq_len {d.seq_len}, model.n_embd "
                f"{m.n_embd}, model.n_layer {m.n_layer}, model.activation_checkpointing "
                f"{str(m.activation_checkpointing).lower()}, {_vocab_words(recipe)}")
    data = Term("data", EstimateInput.from_recipe(recipe).token_buffer_bytes,
                f"data.num_samples + data.eval_samples {d.num_samples + d.eval_samples} x data.seq_len {d.seq_len}")
    offloaded = Term("offloaded optimizer", peak.host,
                     f"zero.offload_optimizer {z.offload_optimizer}, zero.offload_param {z.offload_param}")
    device = [states, acts]
    process = Term("the process (Python, torch)", CPU_RUNTIME_BYTES, "none: measured on a 2-core VM")
    host = [data, offloaded] if on_cuda else [states, acts, process, data, offloaded]
    return device, [t for t in host if t.nbytes]


def ways_out(recipe: Recipe, biggest: Term, on_cuda: bool) -> str:
    """The recipe changes that shrink the biggest term, then the key that proceeds anyway."""
    m, z, b = recipe.model, recipe.zero, recipe.batch
    ways = []
    if biggest.what == "activations":
        ways.append("a smaller batch.micro_batch_per_rank (raise batch.grad_accum_steps to keep the global batch)")
        if not m.activation_checkpointing:
            ways.append("model.activation_checkpointing=true")
        ways.append("a shorter data.seq_len")
    elif biggest.what in ("model states", "offloaded optimizer"):
        if z.stage < 3:
            ways.append(f"a higher zero.stage (now {z.stage}) over more ranks (--nproc)")
        elif b.world_size == 1:
            ways.append("more ranks (--nproc) to shard the states over")
        if on_cuda and z.offload_optimizer == "none":
            ways.append("zero.offload_optimizer=cpu (zero.stage >= 1)")
        ways.append("a smaller model (model.size, model.n_embd, model.n_layer)")
    else:
        ways.append("fewer data.num_samples / data.eval_samples or a shorter data.seq_len")
    if recipe.training.memory_check == "refuse":
        ways.append("or training.memory_check=warn to try anyway")
    return "; ".join(ways)


def _verdict(recipe: Recipe, terms: list[Term], limit: int, where: str, on_cuda: bool, ranks: int) -> str | None:
    """None when `ranks` ranks' terms fit under `limit`, else the one-line refusal."""
    need = ranks * sum(t.nbytes for t in terms)
    if need <= limit:
        return None
    biggest = max(terms, key=lambda t: t.nbytes)
    parts = ", ".join(f"{t.what} {format_bytes(t.nbytes)} ({t.keys})"
                      for t in sorted(terms, key=lambda t: -t.nbytes) if t.nbytes >= need / ranks / 100)
    per = f" for {ranks} ranks" if ranks > 1 else ""
    return (f"recipe: too big for this machine: needs about {format_bytes(need)}{per} on {where} "
            f"but {format_bytes(limit)} is available: "
            f"{parts}; ways out: {ways_out(recipe, biggest, on_cuda)}")


def certainly_cpu(recipe: Recipe) -> bool:
    """True when the run will train on the CPU, known without importing torch (no GPU driver here)."""
    if recipe.training.device == "cpu":
        return True
    if not sys.platform.startswith("linux"):
        return sys.platform == "darwin"  # no CUDA on macOS; elsewhere ask torch
    return not gpu_driver_visible()


def ranks_on_host(recipe: Recipe) -> int:
    """How many ranks share this host's memory and disk: LOCAL_WORLD_SIZE under a launcher, else all of the
    recipe's (`toolkit run --nproc N` starts them here)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or recipe.world_size)


def memory_fit_lines(recipe: Recipe, device, *, ranks: int, gpu: bool = True) -> list[str]:
    """One refusal line per side (the device, the host) the estimate per rank does not fit (empty: it fits).

    `device` is a torch.device or "cpu" / "cuda"; on CUDA with `gpu` the device's free memory is torch's to
    tell (imported here), with `gpu=False` only the host side of a CUDA run is held (no torch import).
    A UserError when the estimator cannot size the model (a pretrained folder it does not know)."""
    on_cuda = getattr(device, "type", device) == "cuda"
    device_terms, host_terms = size_terms(recipe, on_cuda=on_cuda)
    problems = []
    if on_cuda and gpu:
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        problems.append(_verdict(recipe, device_terms, free, f"{device} ({torch.cuda.get_device_name(device)})",
                                 on_cuda, 1))
    if host_terms:
        available, source = host_available_bytes()
        problems.append(_verdict(recipe, host_terms, available, f"the host ({source})", on_cuda, ranks))
    return [p for p in problems if p]


def memory_findings(recipe: Recipe, device, *, ranks: int, gpu: bool = True) -> tuple[list[str], list[str]]:
    """(refusals, lines to say) of `training.memory_check` for `recipe` on `device` (memory_fit_lines)."""
    mode = recipe.training.memory_check
    if mode == "off":
        return [], []
    try:
        problems = memory_fit_lines(recipe, device, ranks=ranks, gpu=gpu)
    except UserError as exc:  # a pretrained folder the estimator cannot size: no check, said once
        return [], [f"note: no memory check: {exc.lines[0]}"]
    if mode == "refuse":
        return problems, []
    return [], [f"warning: {p}; trying anyway (training.memory_check=warn)" for p in problems]


def is_allocation_failure(exc: BaseException) -> bool:
    """Whether an exception is an allocator's out-of-memory (CUDA or the CPU's DefaultCPUAllocator)."""
    text = str(exc)
    return (isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"  # torch.OutOfMemoryError
            or (isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)))


def allocation_failure(recipe: Recipe, exc: BaseException) -> UserError:
    """The one line for an out-of-memory error the pre-flight check did not foresee."""
    m, d, b = recipe.model, recipe.data, recipe.batch
    tried = re.search(r"[Tt]ried to allocate (\d+) bytes|[Tt]ried to allocate ([\d.]+ \w+)", str(exc))
    amount = "" if tried is None else f" allocating {tried[2] or format_bytes(int(tried[1]))}"
    return UserError(f"recipe: ran out of memory{amount} ({type(exc).__name__}); the size comes from "
                     f"batch.micro_batch_per_rank {b.micro_batch_per_rank}, data.seq_len {d.seq_len}, model.n_embd "
                     f"{m.n_embd}, model.n_layer {m.n_layer}, {_vocab_words(recipe)}, "
                     f"zero.stage {recipe.zero.stage}; "
                     f"lower one of them, or turn on model.activation_checkpointing or zero.offload_optimizer")


def _local_gpu() -> tuple[str, int, int] | None:
    """(name, total bytes, free bytes) of GPU 0 from nvidia-smi, torch-free; None where it cannot say."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits",
                               "--id=0"], capture_output=True, text=True, timeout=10)
        name, total, free = (part.strip() for part in done.stdout.strip().splitlines()[0].split(","))
        return name, int(total) * 2**20, int(free) * 2**20
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def offload_update_note(mode: str, warmup: int, clipped: bool = False) -> str:
    """When the offloaded CPU step runs under `mode` (zero.offload_update) and what buffers it adds (`clipped`:
    training.grad_clip > 0)."""
    if mode == "exact":
        return "the CPU step runs after each backward; no buffers beyond two pieces of staging"
    if mode == "overlapped" and clipped:
        return (f"exact results, each bucket's CPU step started during the last backward as if the clip coefficient "
                f"were 1, redone when it is not; rollback copies of up to {SPECULATED_SHARE:.0%} of the offloaded "
                "states (in the cpu column below)")
    if mode == "overlapped":
        return ("exact results, each bucket's CPU step started during the last backward; no buffers beyond exact "
                "mode's staging")
    ahead = " (the weights extrapolated one update ahead)" if mode == "delayed_extrapolated" else ""
    return (f"one step stale after {warmup} exact steps{ahead}; two 4-byte gradient and two weight copies per "
            "offloaded element in CPU memory (in the cpu column below)")


def format_peak_summary(recipe: Recipe, device_key: str | None = None) -> str:
    """What `toolkit estimate` says first: the recipe's predicted peak per rank in the run's memory-line terms,
    and the headroom on the device it is checked against (--device, this machine's GPU, or this host)."""
    from toolkit.observe.estimate import DEVICE_MEMORY

    on_cuda = device_key is not None or not certainly_cpu(recipe)
    p = predict_peak(recipe, on_cuda=on_cuda)
    z = recipe.zero
    where = "CUDA max allocated" if on_cuda else "the process's peak RSS"
    parts = [f"model states {format_bytes(p.states)}"]
    parts += [f"autocast weight copies {format_bytes(p.weight_cache)}"] if p.weight_cache else []
    if p.step_temporaries:  # the optimizer step is the peak moment: activations are gone by then
        parts += [f"the bf16 optimizer step's fp32 temporaries {format_bytes(p.step_temporaries)} (the step is the "
                  "peak moment: the activations are gone by then)"]
    else:
        parts += [f"activations {format_bytes(p.activations)}", f"logits and loss {format_bytes(p.logits)}"]
    parts += [f"the process and token buffers {format_bytes(p.runtime)}"] if p.runtime else []
    parts += [f"offloaded states {format_bytes(p.host)}"] if p.host and not on_cuda else []
    lines = [f"recipe {recipe.name}: {recipe.model.label}, zero.stage {z.stage}, {recipe.precision.dtype}, micro batch "
             f"{recipe.batch.micro_batch_per_rank} x {recipe.data.seq_len} x accumulation {recipe.batch.grad_accum_steps}",
             f"predicted peak per rank ({where}, as the run's `memory | peak` line shows it): "
             f"{format_bytes(p.allocated)} = " + " + ".join(parts)]
    if z.offload_optimizer != "none":
        lines.append(f"  zero.offload_update {z.offload_update}: " + offload_update_note(
            z.offload_update, z.offload_update_warmup, clipped=recipe.training.grad_clip > 0))
    if recipe.parallel.active:  # NOTE: the model is of one data-parallel rank holding the whole model
        lines.append("  (tensor / pipeline parallelism not counted here: the busiest mesh rank is in the table below)")
    if on_cuda:
        segments = cuda_allocator.segments_name()
        lines.append(f"  reserved by the allocator ({segments}): about {format_bytes(p.reserved)}"
                     + (f"; in CPU memory besides: {format_bytes(p.host)} offloaded" if p.host else ""))
    lines.append("  calibrated against measured runs (benchmarks/memory_calibration): within "
                 + (f"±{CALIBRATION_TOLERANCE:.0%} on an H200" if on_cuda else
                    f"{CPU_RSS_BAND[0]:.2f}-{CPU_RSS_BAND[1]:.1f}x measured/predicted on a CPU: a lower bound"))
    if device_key is not None:
        capacity, what = DEVICE_MEMORY[device_key], f"{device_key} ({format_bytes(DEVICE_MEMORY[device_key])})"
    elif on_cuda:
        gpu = _local_gpu()
        if gpu is None:
            lines.append("  headroom: unknown (nvidia-smi did not answer; pass --device NAME)")
            return "\n".join(lines)
        capacity, what = gpu[2], f"this machine's {gpu[0]} ({format_bytes(gpu[2])} free now)"
    else:
        capacity, source = host_available_bytes()
        what = f"this host ({format_bytes(capacity)} available, {source})"
    need = p.reserved if on_cuda else p.allocated
    left = capacity - need
    lines.append(f"  headroom on {what}: " + (f"{format_bytes(left)} left after the peak" if left >= 0 else
                                              f"short by {format_bytes(-left)}: it will not fit"))
    return "\n".join(lines)
