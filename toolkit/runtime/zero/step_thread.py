"""An offloaded part's CPU step on a background thread, as the delayed and the overlapped updates run it
(delayed_update.py, overlapped_update.py): started with a target, joined where the step must be done, and an error
on the thread raised on the caller's, where the run can stop cleanly."""
from __future__ import annotations

import threading
import time
from collections import deque

import torch


def event_now(cuda: bool):
    """A CUDA event after the work queued so far on the current stream (None on a CPU): how the training thread
    tells a step thread where in its stream a group's gradients became final."""
    if not cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class StepThread:
    """start(target) runs `target` on a daemon thread; join() waits for it and raises what it raised."""

    def __init__(self, name: str):
        self.name = name
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        # perf_counter (start, end) of the last joins, for timelines (tutorials/18)
        self.wait_spans: deque[tuple[float, float]] = deque(maxlen=256)

    @property
    def in_flight(self) -> bool:
        """True from `start` until `join`."""
        return self.thread is not None

    def start(self, target) -> None:
        self.error = None
        self.thread = threading.Thread(target=self._guarded, args=(target,), name=self.name, daemon=True)
        self.thread.start()

    def _guarded(self, target) -> None:
        try:
            target()
        except BaseException as exc:  # NOTE: raised by `join` on the caller's thread
            self.error = exc
            self.failed()

    def failed(self) -> None:
        """Called on the thread after `target` raised (subclasses wake whatever it waited for)."""

    def join(self) -> None:
        """Wait for the thread; raise its error, if any."""
        start = time.perf_counter()
        self.thread.join()
        self.wait_spans.append((start, time.perf_counter()))
        self.thread = None
        if self.error is not None:
            raise self.error
