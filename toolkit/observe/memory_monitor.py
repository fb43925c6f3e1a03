"""Runtime memory monitor: where a rank's bytes go while it trains.

Two kinds of numbers, one line of metrics per log window:
- model states, counted from the real tensors: parameters, gradients, optimizer
  states and fp32 master weights (`mem_params_bytes`, `mem_grads_bytes`,
  `mem_optim_bytes`, `mem_master_bytes`), each storage counted once;
- measured peaks, reset every window: on CUDA the allocator's max allocated
  (`mem_peak_bytes`) and reserved (`mem_reserved_peak_bytes`) bytes; on the CPU the
  process's peak resident set (`mem_peak_bytes`, the Python runtime and libraries
  included). `rss_bytes` is the process's resident set at the end of the window.
With ZeRO-Offload also `mem_offload_bytes`: the optimizer's part in CPU memory (fp32
master and moments), from the engine's `offload_metrics()`.
At the end: a console summary and <run_dir>/memory.png, the timeline.

The analytic estimator (before a run, ZeRO-paper formulas) is toolkit/observe/estimate.py.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from toolkit.observe.estimate import format_bytes
from toolkit.optional_packages import package

# ===========================================================================
# Model-state bytes, counted from tensors
# ===========================================================================


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes one rank holds; master weights apart from the optimizer states."""

    params: int
    grads: int
    optim: int
    master: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim + self.master

    def max(self, other: StateBytes | None) -> StateBytes:
        """Field by field the larger of two samples (a window keeps its fullest moment)."""
        if other is None:
            return self
        return StateBytes(*(max(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)))


class _StorageCounter:
    """Sums the bytes of distinct storages: tied weights, views into flat buffers and a
    tensor listed twice count once (a flat buffer counts whole)."""

    def __init__(self):
        self._seen: set[tuple[str, int]] = set()

    def add(self, tensors) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in self._seen:
                continue
            self._seen.add(key)
            total += storage.nbytes()
        return total


def count_model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                            master_params=()) -> StateBytes:
    """Bytes of the parameters, gradients, optimizer states and master weights alive now."""
    counter = _StorageCounter()  # one counter: a storage already counted is never counted again
    params = list(model.parameters())
    param_bytes = counter.add(params)
    # NOTE: master weights are a separate fp32 copy only when the model holds 16-bit
    # weights; our engine keeps fp32 weights under autocast, so they are the params (0 here).
    master_bytes = counter.add(master_params)
    grad_bytes = counter.add(p.grad for p in params)
    grad_bytes += counter.add(getattr(m, "grad", None) for m in master_params)
    optim_bytes = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            optim_bytes += counter.add(state.values())
    return StateBytes(params=param_bytes, grads=grad_bytes, optim=optim_bytes, master=master_bytes)


def model_state_bytes(engine) -> StateBytes:
    """This rank's model-state bytes: `engine.model_state_bytes()` when the engine defines it, else counted.

    The protocol: an engine whose states are not plain `model.parameters()` and
    `optimizer.state` (ZeRO's flat, sharded buffers) defines `model_state_bytes()`
    returning a `StateBytes` of what this rank holds. Others are counted from their
    tensors; `engine.master_params` (if any) are the fp32 master weights.
    """
    own = getattr(engine, "model_state_bytes", None)
    if callable(own):
        return own()
    return count_model_state_bytes(engine.model, engine.optimizer, getattr(engine, "master_params", ()))


# ===========================================================================
# Measured peaks: CUDA allocator, process resident set
# ===========================================================================

def _proc_status_bytes(field: str) -> int | None:
    """A `VmRSS`/`VmHWM` line of /proc/self/status in bytes (Linux), else None."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return None


def _rusage_peak_bytes() -> int:
    """The process's lifetime peak resident set from getrusage (kB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_bytes() -> int:
    """The process's resident set now (its lifetime peak where /proc is missing)."""
    rss = _proc_status_bytes("VmRSS")
    return rss if rss is not None else _rusage_peak_bytes()


def reset_rss_peak() -> bool:
    """Reset the process's peak resident set (VmHWM) to its current value; False where Linux refuses."""
    # Linux >= 4.0: writing 5 to clear_refs resets the high-water mark (proc(5)).
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_peak_bytes() -> int:
    """The process's peak resident set since the last reset (VmHWM), or its lifetime peak."""
    peak = _proc_status_bytes("VmHWM")
    return peak if peak is not None else _rusage_peak_bytes()


class PeakMemory:
    """Peaks over a window: CUDA max allocated / reserved on a GPU, peak RSS on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.windowed = True  # False when the CPU peak cannot be reset: it is then the run's peak so far

    def reset(self) -> None:
        """Start a new window."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.windowed = reset_rss_peak()

    def read(self) -> dict:
        """mem_peak_bytes (and mem_reserved_peak_bytes on CUDA) of this window, and rss_bytes now."""
        if self.cuda:
            return {"mem_peak_bytes": torch.cuda.max_memory_allocated(self.device),
                    "mem_reserved_peak_bytes": torch.cuda.max_memory_reserved(self.device),
                    "rss_bytes": rss_bytes()}
        return {"mem_peak_bytes": rss_peak_bytes(), "rss_bytes": rss_bytes()}

    def describe(self) -> str:
        """What mem_peak_bytes measures here."""
        if self.cuda:
            return "CUDA max allocated per window"
        return ("process peak RSS per window (VmHWM)" if self.windowed
                else "process peak RSS so far (this OS cannot reset it per window)")


# ===========================================================================
# The monitor the training loop drives
# ===========================================================================

class MemoryMonitor:
    """Model-state bytes and measured peaks per log window; a summary and memory.png at the end.

    Gradients exist only between backward and the optimizer step (the engine frees them
    after), so model states are also sampled by an optimizer step pre-hook; a window
    reports, field by field, its fullest sample.
    """

    def __init__(self, engine):
        self.engine = engine
        self.peaks = PeakMemory(engine.device)
        self.timeline: list[dict] = []  # {"step", metric fields} per window
        self._window_states: StateBytes | None = None
        self._hook = None
        optimizer = getattr(engine, "optimizer", None)
        if isinstance(optimizer, torch.optim.Optimizer):
            self._hook = optimizer.register_step_pre_hook(self._before_optimizer_step)
        self.peaks.reset()

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._window_states is None or self._window_states.grads == 0:
            self._sample()

    def _sample(self) -> None:
        self._window_states = model_state_bytes(self.engine).max(self._window_states)

    def window_metrics(self, step: int) -> dict:
        """The memory fields of the log line closing this window; starts the next window."""
        self._sample()
        states = self._window_states
        offload = getattr(self.engine, "offload_metrics", None)
        metrics = {"mem_params_bytes": states.params, "mem_grads_bytes": states.grads,
                   "mem_optim_bytes": states.optim, "mem_master_bytes": states.master,
                   **(offload() if callable(offload) else {}), **self.peaks.read()}
        self.timeline.append({"step": step, **metrics})
        self._window_states = None
        self.peaks.reset()
        return metrics

    def close(self) -> None:
        """Remove the optimizer hook."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def summary(self) -> str:
        """Console lines: model states at their largest, the peak window, RSS at the end."""
        if not self.timeline:
            return "memory | nothing measured (no step was logged)"
        last = self.timeline[-1]
        states = StateBytes(*(max(m[f"mem_{f.name}_bytes"] for m in self.timeline) for f in fields(StateBytes)))
        top = max(self.timeline, key=lambda m: m["mem_peak_bytes"])
        lines = [f"memory | model states per rank: params {format_bytes(states.params)} + grads "
                 f"{format_bytes(states.grads)} + optimizer {format_bytes(states.optim)} + master "
                 f"{format_bytes(states.master)} = {format_bytes(states.total)}"]
        if "mem_offload_bytes" in last:
            offloaded = max(m["mem_offload_bytes"] for m in self.timeline)
            lines.append(f"memory | offloaded to CPU memory per rank: {format_bytes(offloaded)} (fp32 master + "
                         "Adam moments, + the parameter shard under offload_param cpu; the step's pinned staging "
                         "not counted)")
        peak = f"memory | peak {format_bytes(top['mem_peak_bytes'])} at step {top['step']} ({self.peaks.describe()}"
        if "mem_reserved_peak_bytes" in top:
            peak += f"; reserved {format_bytes(max(m['mem_reserved_peak_bytes'] for m in self.timeline))}"
        lines.append(peak + f"); process RSS at the end {format_bytes(last['rss_bytes'])}")
        return "\n".join(lines)

    def write_timeline(self, path: Path) -> str:
        """Plot the timeline to `path` (matplotlib's Agg renderer); returns a one-line note of what happened."""
        if not self.timeline:
            return "memory | no timeline: no step was logged"
        try:
            # NOTE: the Figure API, not pyplot: no global backend switch (a notebook that
            # calls toolkit.run keeps its inline plots), and Figure.savefig renders with Agg.
            from matplotlib.figure import Figure
        except ImportError:  # a default-on plot: a base install gets a note, not an error
            return f"memory | no memory.png: matplotlib is not installed; {package('matplotlib').install}"
        plot_timeline(Figure, self.timeline, self.peaks.describe(), path)
        return f"memory | timeline -> {path}"


def plot_timeline(figure_class, timeline: list[dict], peak_label: str, path: Path) -> None:
    """Two panels over steps: stacked model states; measured peak and RSS."""
    mib = 2**20
    steps = [m["step"] for m in timeline]
    fig = figure_class(figsize=(10, 6))
    states_ax, measured_ax = fig.subplots(2, 1, sharex=True)
    names = ["params", "grads", "optim", "master"]
    labels = ["parameters", "gradients", "optimizer states", "master weights"]
    if "mem_offload_bytes" in timeline[0]:  # ZeRO-Offload: the optimizer's part in CPU memory, on top
        names, labels = [*names, "offload"], [*labels, "offloaded optimizer (CPU memory)"]
    states_ax.stackplot(steps, *[[m[f"mem_{n}_bytes"] / mib for m in timeline] for n in names], labels=labels)
    states_ax.set_ylabel("MiB per rank")
    states_ax.set_title("model states (counted from tensors)")
    states_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    measured_ax.plot(steps, [m["mem_peak_bytes"] / mib for m in timeline], marker=".", label=f"peak: {peak_label}")
    if "mem_reserved_peak_bytes" in timeline[0]:
        measured_ax.plot(steps, [m["mem_reserved_peak_bytes"] / mib for m in timeline], marker=".",
                         label="CUDA max reserved per window")
    measured_ax.plot(steps, [m["rss_bytes"] / mib for m in timeline], linestyle="--", label="process RSS")
    measured_ax.set_ylabel("MiB")
    measured_ax.set_xlabel("optimizer step")
    measured_ax.set_title("measured")
    measured_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
