"""zero.offload_update delayed: ZeRO-Offload's one-step delayed parameter update (DPU) for one offloaded part.

The exact offload step (offload.py) makes every step wait for the CPU AdamW. Here the optimizer step of step t
only lands the update of step t-1 and launches step t's on a background thread, then returns; step t+1's forward
and backward run while the CPU steps:

    optimizer step t:  copy the reduced gradients to a host buffer; join step t-1's thread -> its new weights
                       into the model (main thread) -> thread: CPU AdamW (and swap I/O) of step t
    step t+1:          forward + backward on the weights of step t-1   ||   the thread steps t

So the gradient of step t+1 is computed on weights one update old: staleness is exactly one step. The thread runs
the exact mode's pieces (the same kernel, the same settings, frozen at launch), but reads a host copy of the
gradients (the device's are accumulated anew by step t+1's backward) and writes its new weights to a host buffer
(the model's are in use), which the next optimizer step copies in.

Two of each buffer, taken in turn: step t's gradients go to one while step t-1's thread may still read the other,
so their copy starts before that thread is joined, and step t's thread writes its weights into one while step
t-1's are copied into the model from the other, so it need not wait for that copy. An optimizer step:

    gradients of step t -> host buffer t % 2 (a copy stream on CUDA) | join step t-1's thread
    step t-1's weights (buffer (t-1) % 2) -> the model               | thread: CPU AdamW of step t on buffers t % 2

The copy of step t's gradients starts earlier still: each group's, as soon as the last micro-step's backward makes
it final (`ready`, on the copy stream beside the rest of the backward). A clip or an fp16 unscale multiplies the
gradients after the backward; the thread's CPU AdamW then multiplies the copy by the same factors, as the device
did (fp32 gradients: the same float products, bit for bit; the kernel does it a cache-sized block at a time in its
pass) instead of copying the multiplied gradients again, a second device-to-host copy of the whole gradient that
the clipped step waited for. 16-bit gradient shards (zero.grad_dtype bf16) are rounded by the device's multiply, so
those are copied again.

Landing early (weights on the device, `zero.offload_param none`): step t+1's forward and backward read the weights
of step t-1, but once its backward has made a group's gradient final it reads that group's weights no more (the
argument of overlapped_update.py), so each group's new weights are copied into the model as soon as both its pieces
are stepped and step t+1's backward has finished the group: by the thread after its piece, or by the backward's
hook after the group, whichever comes second (`EarlyLanding`; on CUDA on its own stream, after an event recorded
where the backward finished the group). Neither waits for the other, so no thread is left blocked when a run
stops. The optimizer step then only waits for the last groups: the landing's host-to-device copy (3 GiB at 1.5B
parameters in bf16) runs beside the backward instead of before the next forward. A skipped (fp16 overflow) step
lands the rest too (Engine.step), since its backward may have landed some groups. Weights in CPU memory or swap
files (`offload_param`) land in the optimizer step, as above.

Extra CPU memory: 2 x (4 bytes of gradient and a weight in the model dtype) per offloaded element.

What does not live here: when a step is delayed (the warm-up, landing before evaluation and checkpoints:
shard_part.py and sharded.py) and the CPU AdamW itself (offload.py, adamw.py).
"""
from __future__ import annotations

import threading
import time
from collections import deque

import torch

from toolkit.runtime.pinned import pinned_empty
from toolkit.runtime.zero.flat import ShardLayout
from toolkit.runtime.zero.offload import OffloadedStep, SwappedStep
from toolkit.runtime.zero.step_thread import StepThread, event_now


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


class EarlyLanding:
    """One update's weights into the model group by group, as soon as a group is both stepped (`stepped`, on the
    update's thread) and finished by the next backward (`final`, on the training thread), whichever comes second
    issuing the copy; `rest` copies what is left (the optimizer step, an evaluation)."""

    def __init__(self, pieces, weights, groups: range, source: HostWeightBuffer, stream):
        self.weights, self.groups, self.source, self.stream = weights, groups, source, stream
        self.unstepped: dict[int, int] = {}  # pieces left to step per group (local index)
        for piece in pieces:
            self.unstepped[piece.group] = self.unstepped.get(piece.group, 0) + 1
        self.final: dict[int, object] = {}  # groups the backward has finished, and the event recorded there
        self.landed: set[int] = set()
        self.lock = threading.Lock()

    def stepped(self, piece) -> None:
        with self.lock:
            self.unstepped[piece.group] -= 1
            if self.unstepped[piece.group] == 0 and piece.group in self.final:
                self._copy(piece.group)

    def final_group(self, local: int, event) -> None:
        with self.lock:
            self.final[local] = event
            if self.unstepped.get(local, 0) == 0:
                self._copy(local)

    def rest(self) -> None:
        """Every group not landed yet, after the work queued so far (the update's thread has ended)."""
        with self.lock:
            for local in range(len(self.groups)):
                self.final.setdefault(local, None)
                self._copy(local)

    def _copy(self, local: int) -> None:
        if local in self.landed:
            return
        self.landed.add(local)
        if self.stream is None:
            self.weights.write(self.groups[local], 0, self.source.read(local))
            return
        with torch.cuda.stream(self.stream):
            if self.final[local] is not None:
                self.stream.wait_event(self.final[local])  # the backward has finished reading these weights
            else:
                self.stream.wait_stream(torch.cuda.current_stream())
            self.weights.write(self.groups[local], 0, self.source.read(local))


class DelayedUpdate(StepThread):
    """One offloaded part's CPU step, run on a background thread between two optimizer steps."""

    def __init__(self, layout: ShardLayout, optimizer, master: torch.Tensor | None, swap, grad_chunks: list[torch.Tensor],
                 weights, groups: range, device: torch.device, dtype: torch.dtype, extrapolate: bool = False):
        super().__init__("toolkit-delayed-update")
        self.optimizer, self.grad_chunks, self.weights, self.groups = optimizer, grad_chunks, weights, groups
        self.cuda = device.type == "cuda"
        local = range(len(groups))
        # buffer i: host gradients (as views per group) and new weights; the next update uses buffer `turn`, the
        # one in flight (if any) the other
        self.grad_hosts = [pinned_empty(layout.numel, torch.float32, self.cuda) for _ in range(2)]
        self.grad_views = [[layout.chunk_of(host, g) for g in local] for host in self.grad_hosts]
        self.new_weights = [HostWeightBuffer(layout, dtype, pinned=self.cuda) for _ in range(2)]
        self.turn = 0
        self.staged = False  # `stage` copied this step's gradients to buffer `turn`; `launch` starts from them
        # the groups copied during the last micro-step's backward (`ready`), None when not collecting; `scales`:
        # what multiplied the gradients since (a clip, an unscale), for the thread to apply to the copy; None: copy
        # them again (a 16-bit shard, whose multiply the device rounds to 16 bits)
        self.early: int | None = None
        self.scales: list[float] | None = []
        self.scale_on_host = all(c.dtype == torch.float32 for c in grad_chunks)
        cpu = torch.device("cpu")  # the thread touches host memory (and swap files) only
        # NOTE: one step object, pointed at buffer i before each update (a SwappedStep's slots are 576 MiB)
        self.cpu_step = (SwappedStep(layout, optimizer, swap, self.grad_views[0], self.new_weights[0], local, cpu,
                                     in_place=True)
                         if swap is not None else
                         OffloadedStep(layout, optimizer, master, self.grad_views[0], self.new_weights[0], local, cpu,
                                       in_place=True))
        # delayed_extrapolated: the landed weights are 2 M_t - M_{t-1}, a guess at the weights the next gradient
        # meets; evaluation and checkpoints then publish the master itself (shard_part.py ShardPart.land)
        self.extrapolate = self.cpu_step.extrapolate = extrapolate
        self.device = device
        # landing early (module docstring): weights on the device; None: the update lands in the optimizer step
        self.early_landing = weights.on_device
        self.landing: EarlyLanding | None = None
        if self.cuda:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)  # the early landing's copies
        self.copied = [torch.cuda.Event() if self.cuda else None for _ in range(2)]  # gradients reached buffer i
        self.landed = [torch.cuda.Event() if self.cuda else None for _ in range(2)]  # new weights left buffer i
        # perf_counter (start, end) of the thread's last updates, for timelines (tutorials/18; landing's waits:
        # StepThread.wait_spans)
        self.cpu_spans: deque[tuple[float, float]] = deque(maxlen=256)

    def begin(self) -> None:
        """The last micro-step of a step that will launch an update starts: copy each group as it becomes final."""
        self.early, self.scales = 0, []

    @torch.no_grad()
    def ready(self, local: int) -> None:
        """Group `local`'s reduced gradient is final: copy it to the next update's host buffer now, on CUDA on the
        copy stream, beside the rest of the backward. The update in flight reads the other buffer, and may now land
        the group's new weights (backward reads them no more)."""
        if self.early is None:
            return
        if self.landing is not None:
            self.landing.final_group(local, event_now(self.cuda))
        self._copy([local])
        self.early += 1

    def scaling(self, factor: float) -> None:
        """The gradients are about to be multiplied by `factor` after their early copies (clipped, unscaled): the
        thread multiplies the copy too (or, 16-bit gradients, `stage` copies them again)."""
        if self.scales is not None:
            self.scales = self.scales + [factor] if self.scale_on_host else None
        if self.cuda and self.early:  # the multiply, next on the compute stream, writes what the copies read
            torch.cuda.current_stream().wait_stream(self.d2h)

    @torch.no_grad()
    def stage(self) -> None:
        """Copy this step's reduced gradients to the host buffer the next update uses (on CUDA on a copy stream,
        beside the landing's copies on the compute stream), unless backward's early copies (`ready`) hold them as
        they are. The update in flight reads the other buffer, so this may run before it is landed."""
        early, self.early = self.early, None
        if early == len(self.grad_chunks) and self.scales is not None:
            self.staged_scales = tuple(self.scales)  # each multiply since the copies, for the thread to repeat
        else:
            self._copy(range(len(self.grad_chunks)))
            self.staged_scales = ()
        self.scales = []
        self.staged = True

    def _copy(self, groups) -> None:
        """The gradients of `groups` (local indices) into buffer `turn`: on CUDA on the copy stream, after what the
        compute stream has queued (the work that made them final), `copied[turn]` recorded after them."""
        views = self.grad_views[self.turn]
        if not self.cuda:
            for local in groups:
                views[local].copy_(self.grad_chunks[local])
            return
        self.d2h.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.d2h):
            for local in groups:
                views[local].copy_(self.grad_chunks[local], non_blocking=True)
            self.copied[self.turn].record()

    @torch.no_grad()
    def launch(self) -> None:
        """Start this step's update on a thread, from the gradients `stage` copied (landed the last one first)."""
        if self.in_flight or not self.staged:
            raise RuntimeError("zero.offload_update delayed: launch() needs stage() and the last update landed first")
        i, self.staged, self.turn = self.turn, False, 1 - self.turn
        if self.cuda:  # zero_grad, next on the compute stream, clears what the copy reads
            torch.cuda.current_stream().wait_stream(self.d2h)
        self.cpu_step.grad_chunks, self.cpu_step.weights = self.grad_views[i], self.new_weights[i]
        self.cpu_step.grad_scales = self.staged_scales
        self.optimizer.begin_step()  # the step count and this step's lr and betas, before the schedule moves on
        if self.early_landing:
            self.landing = EarlyLanding(self.cpu_step.pieces, self.weights, self.groups, self.new_weights[i],
                                        self.h2d if self.cuda else None)
        self.cpu_step.piece_done = self.landing.stepped if self.landing is not None else None
        self.start(lambda: self._run(i))

    def _run(self, i: int) -> None:
        if self.cuda:  # a new thread's current device is the first GPU, not necessarily this rank's
            torch.cuda.set_device(self.device)
            self.copied[i].synchronize()
            self.landed[i].synchronize()  # buffer i's last landing (two steps ago) has left it
        start = time.perf_counter()
        self.cpu_step.run_pieces()
        self.cpu_spans.append((start, time.perf_counter()))

    @torch.no_grad()
    def land(self) -> bool:
        """Wait for the update in flight and copy its weights into the model's (landing early: the groups not landed
        yet, those the next backward has not finished included, e.g. before an evaluation); False when none was in
        flight."""
        if not self.in_flight:
            return False
        i = 1 - self.turn  # the buffer `launch` gave the update in flight
        if self.landing is not None:
            self.join()
            self.landing.rest()
            self.landing = None
            if self.cuda:  # the next forward reads what the copies wrote; buffer i is free once they are done
                self.landed[i].record(self.h2d)
                torch.cuda.current_stream().wait_stream(self.h2d)
            return True
        self.join()
        for local, g in enumerate(self.groups):
            self.weights.write(g, 0, self.new_weights[i].read(local))
        if self.cuda:
            self.landed[i].record()
        return True

    def host_tensors(self) -> list[torch.Tensor]:
        """The CPU buffers this mode adds: two gradient copies and two of the new weights."""
        return [*self.grad_hosts, *(buffer.shard for buffer in self.new_weights)]
