"""zero.offload_update delayed: ZeRO-Offload's one-step delayed parameter update (DPU) for one offloaded part.

The exact offload step (offload.py) makes every step wait for the CPU AdamW. Here the optimizer step of step t
only lands the update of step t-1 and launches step t's on a background thread, then returns; step t+1's forward
and backward run while the CPU steps:

    optimizer step t:  join step t-1's thread -> its new weights into the model (main thread)
                       copy the reduced gradients to a host buffer -> thread: CPU AdamW (and swap I/O) of step t
    step t+1:          forward + backward on the weights of step t-1   ||   the thread steps t

So the gradient of step t+1 is computed on weights one update old: staleness is exactly one step. The thread runs
the exact mode's pieces (the same kernel, the same settings, frozen at launch), but reads a host copy of the
gradients (the device's are accumulated anew by step t+1's backward) and writes its new weights to a host buffer
(the model's are in use), which the next optimizer step copies in. Extra CPU memory: 4 bytes of gradient and a
weight in the model dtype per offloaded element.

What does not live here: when a step is delayed (the warm-up, landing before evaluation and checkpoints:
shard_part.py and sharded.py) and the CPU AdamW itself (offload.py, adamw.py).
"""
from __future__ import annotations

import time
from collections import deque

import torch

from toolkit.runtime.pinned import pinned_empty
from toolkit.runtime.zero.flat import ShardLayout
from toolkit.runtime.zero.offload import OffloadedStep, SwappedStep
from toolkit.runtime.zero.step_thread import StepThread


class HostWeightBuffer:
    """Where the thread's step writes new weights: one CPU tensor in the model dtype, chunked like the part
    (the weights interface of param_offload.py, as far as offload.py uses it)."""

    on_device = False

    def __init__(self, layout: ShardLayout, dtype: torch.dtype, pinned: bool):
        self.shard = pinned_empty(layout.numel, dtype, pinned)
        self.chunks = [layout.chunk_of(self.shard, g) for g in range(len(layout.groups))]

    def read(self, g: int) -> torch.Tensor:
        """Group g's chunk (a view)."""
        return self.chunks[g]

    def write(self, g: int, start: int, values: torch.Tensor) -> None:
        """New weights into group g's chunk from element `start` (synchronous)."""
        self.chunks[g][start:start + values.numel()].copy_(values)


class DelayedUpdate(StepThread):
    """One offloaded part's CPU step, run on a background thread between two optimizer steps."""

    def __init__(self, layout: ShardLayout, optimizer, master: torch.Tensor | None, swap, grad_chunks: list[torch.Tensor],
                 weights, groups: range, device: torch.device, dtype: torch.dtype, extrapolate: bool = False):
        super().__init__("toolkit-delayed-update")
        self.optimizer, self.grad_chunks, self.weights, self.groups = optimizer, grad_chunks, weights, groups
        self.cuda = device.type == "cuda"
        self.grad_host = pinned_empty(layout.numel, torch.float32, self.cuda)
        self.grad_views = [layout.chunk_of(self.grad_host, g) for g in range(len(groups))]
        self.new_weights = HostWeightBuffer(layout, dtype, pinned=self.cuda)
        local = range(len(groups))
        cpu = torch.device("cpu")  # the thread touches host memory (and swap files) only
        self.cpu_step = (SwappedStep(layout, optimizer, swap, self.grad_views, self.new_weights, local, cpu, in_place=True)
                         if swap is not None else
                         OffloadedStep(layout, optimizer, master, self.grad_views, self.new_weights, local, cpu,
                                       in_place=True))
        # delayed_extrapolated: the landed weights are 2 M_t - M_{t-1}, a guess at the weights the next gradient
        # meets; evaluation and checkpoints then publish the master itself (shard_part.py ShardPart.land)
        self.extrapolate = self.cpu_step.extrapolate = extrapolate
        self.copied = torch.cuda.Event() if self.cuda else None   # the gradients reached grad_host
        self.landed = torch.cuda.Event() if self.cuda else None   # the new weights left new_weights
        # perf_counter (start, end) of the thread's last updates, for timelines (tutorials/18; landing's waits:
        # StepThread.wait_spans)
        self.cpu_spans: deque[tuple[float, float]] = deque(maxlen=256)

    @torch.no_grad()
    def launch(self) -> None:
        """Start this step's update: copy the reduced gradients to the host, then AdamW on a thread."""
        for host, chunk in zip(self.grad_views, self.grad_chunks):
            host.copy_(chunk, non_blocking=self.cuda)  # stream-ordered before zero_grad clears `chunk`
        if self.cuda:
            self.copied.record()
        self.optimizer.begin_step()  # the step count and this step's lr and betas, before the schedule moves on
        self.start(self._run)

    def _run(self) -> None:
        if self.cuda:
            self.copied.synchronize()
            self.landed.synchronize()  # the last landing's copies out of new_weights are done
        start = time.perf_counter()
        self.cpu_step.run_pieces()
        self.cpu_spans.append((start, time.perf_counter()))

    @torch.no_grad()
    def land(self) -> bool:
        """Wait for the update in flight and copy its weights into the model's; False when none was in flight."""
        if not self.in_flight:
            return False
        self.join()
        for local, g in enumerate(self.groups):
            self.weights.write(g, 0, self.new_weights.read(local))
        if self.cuda:
            self.landed.record()
        return True

    def host_tensors(self) -> list[torch.Tensor]:
        """The CPU buffers this mode adds: the gradient copy and the new weights."""
        return [self.grad_host, self.new_weights.shard]
