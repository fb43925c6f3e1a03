"""zero.offload_update overlapped: the exact offload step, started during the last micro-step's backward.

The exact step (offload.py) waits for backward to end, then streams the gradient shard to the CPU piece by piece.
Here a thread takes each group (reduce bucket, or stage-3 unit) as soon as backward has made its reduced gradient
final, so the CPU AdamW of the groups backward finished first runs while backward computes the rest:

    last micro-step:  forward | backward: group 0 final, group 1 final, ...  | optimizer step: join the thread
    thread:                   |           CPU AdamW group 0, group 1, ... (same pieces, same kernel)

The maths, the pieces and the kernel are exact mode's; only the time each piece starts moves, so results are bit
for bit exact mode's. A group's update then depends on the group's own gradient, but for global-norm clipping
(training.grad_clip > 0), whose coefficient the pieces speculate on (speculation.py: stepped as if it were 1, redone
from saved states when it is not), and fp16 loss scaling (its overflow check reads every gradient), which the
recipe checks refuse (toolkit/recipe/checks.py). Without clipping no buffer is added: the pieces go through exact
mode's staging.

Why a group's new weights may go to the device during backward: a group is final when every parameter in it has
had its gradient accumulated (post-accumulate-grad hooks), which autograd does after the last backward node that
reads the parameter; the copies wait for an event recorded after that point (CUDA), and nothing reads the weights
again before the next forward.
"""
from __future__ import annotations

import threading
from collections import deque

import torch

from toolkit.runtime.zero.speculation import ClipSpeculation
from toolkit.runtime.zero.step_thread import StepThread, event_now


class GroupArrivals:
    """Groups whose gradients are final, handed from backward (`put`) to the step's thread (`take`): in arrival order,
    or in shard order (`in_order`: int8 moments open their blocks in shard order, adamw.py `_open_window`). Only
    `wanted` groups count (those holding pieces: a unit without parameters is never reduced)."""

    def __init__(self, wanted: list[int], in_order: bool):
        self.wanted, self.in_order = wanted, in_order
        self.arrived: dict[int, object] = {}
        self.order: deque[int] = deque()
        self.taken = 0
        self.cancelled = False
        self.lock = threading.Condition()

    def put(self, local: int, event) -> None:
        """Group `local` is final (`event`: a CUDA event after the work that made it so, or None)."""
        with self.lock:
            self.arrived[local] = event
            self.order.append(local)
            self.lock.notify_all()

    def missing(self) -> list[int]:
        """Wanted groups that have not arrived."""
        with self.lock:
            return [g for g in self.wanted if g not in self.arrived]

    def cancel(self) -> None:
        """Wake a waiting thread for good (the round will never finish)."""
        with self.lock:
            self.cancelled = True
            self.lock.notify_all()

    def take(self, block: bool) -> tuple[int, object] | None:
        """(group, event) of the next final group; None when all have been taken, or (block False) none is ready."""
        with self.lock:
            while True:
                if self.taken == len(self.wanted) or self.cancelled:
                    return None
                if self.in_order:
                    local = self.wanted[self.taken] if self.wanted[self.taken] in self.arrived else None
                else:
                    while self.order and self.order[0] not in self.wanted:
                        self.order.popleft()  # a group without pieces
                    local = self.order.popleft() if self.order else None
                if local is not None:
                    self.taken += 1
                    return local, self.arrived[local]
                if not block:
                    return None
                self.lock.wait()


class OverlappedUpdate(StepThread):
    """One offloaded part's exact step run on a thread from the start of the last micro-step: `begin`, then `ready`
    for each group as backward finishes it, then `finish` in the optimizer step."""

    def __init__(self, step, in_order: bool, device: torch.device, speculate: bool = False):
        super().__init__("toolkit-overlapped-update")
        self.step, self.in_order = step, in_order
        # speculate (training.grad_clip > 0): the pieces run before the clip coefficient, which `clip` delivers
        self.speculation = (ClipSpeculation([step.master, step.optimizer.exp_avg, step.optimizer.exp_avg_sq])
                            if speculate else None)
        self.wanted = sorted({piece.group for piece in step.pieces})  # the groups holding elements of this rank
        self.device, self.cuda = device, device.type == "cuda"
        self.arrivals: GroupArrivals | None = None

    def begin(self) -> None:
        """The last micro-step starts: count the step (its lr and betas are final: the schedule moved on after the
        last step) and start the thread, which waits for the first group."""
        if self.in_flight:
            raise RuntimeError("zero.offload_update overlapped: a backward at the accumulation boundary ran again "
                               "before engine.step(); the CPU update of that step has begun, so call engine.step() "
                               "after each boundary's backward")
        self.step.optimizer.begin_step()
        self.arrivals = GroupArrivals(self.wanted, self.in_order)
        if self.speculation is not None:
            self.speculation.reset()
        self.start(self._run)

    def ready(self, local: int) -> None:
        """Backward has made group `local`'s reduced gradient final (called where it was accepted)."""
        self.arrivals.put(local, event_now(self.cuda))

    def _run(self) -> None:
        if self.cuda:  # a new thread's current device is the first GPU, not necessarily this rank's
            torch.cuda.set_device(self.device)
        if self.speculation is None:  # the pieces' spans: OffloadedStep.piece_spans
            self.step.run_pieces(self.arrivals)
        else:  # NOTE: OffloadedStep only (the recipe checks refuse clipping with swap files: SwappedStep)
            self.step.run_pieces(self.arrivals, self.speculation)

    def clip(self, coef: float, chunks: list[torch.Tensor]) -> None:
        """The step's clip coefficient (strategy.clip_grad_norm) for the pieces stepped before it and after; this part's
        gradient `chunks` are clipped in place as exact mode does, after the thread's fetches so far (CUDA: the
        compute stream waits for the copy stream) and before its later ones (the copy stream waits for the clip)."""
        def scale() -> None:
            if self.cuda:
                torch.cuda.current_stream().wait_stream(self.step.d2h)
            torch._foreach_mul_(chunks, coef)
            if self.cuda:
                self.step.d2h.wait_stream(torch.cuda.current_stream())

        self.speculation.deliver(coef, scale)

    def failed(self) -> None:
        self.arrivals.cancel()
        if self.speculation is not None:
            self.speculation.cancel()

    @torch.no_grad()
    def finish(self) -> None:
        """The optimizer step: wait for the thread's last pieces (every group is final by now)."""
        missing = self.arrivals.missing()
        if missing:  # NOTE: never expected (end_micro_step drains every group); an error rather than a hang
            self.arrivals.cancel()
            if self.speculation is not None:
                self.speculation.cancel()
            self.join()
            raise RuntimeError(f"zero.offload_update overlapped: the gradients of groups {missing} never became final")
        if self.speculation is not None and self.speculation.coef is None:  # a step without clip_grad_norm: unclipped
            self.speculation.deliver(1.0, lambda: None)
        self.join()
        if self.cuda:  # the model's next use waits for the thread's last weight copies
            torch.cuda.current_stream().wait_stream(self.step.h2d)
