"""The one place the engine's collectives are issued: each is counted in a CommLedger
(toolkit/observe/comm_ledger.py: bytes sent by this rank, by kind) and every wait on one is
timed (the exposed communication). The strategies (zero/) and the engine call
`Communicator` methods, never torch.distributed directly.

Two knobs live here because they act on every collective:
  overlap_comm false (recipe.zero.overlap_comm)  every asynchronous collective is waited
      for as soon as it is issued, so nothing overlaps with backward or forward (DeepSpeed's
      overlap_comm off); the bytes are the same, the exposed time is all of it.
  simulated_link_gbps (recipe.communication)  a SIMULATION of a slower link: the link is a
      queue, each collective occupies it for wire_bytes x 8 / bandwidth after the previous one
      left it, and a wait returns no earlier than that (plus the real collective). Compute that
      runs meanwhile hides the delay exactly as it would hide a slow network; marked in the
      start-up table, the summary and every metrics line (comm_simulated_link_gbps).

Not counted: process-group set-up, the train loop's stop-signal flag (toolkit/train/stop.py),
checkpoint and run-directory agreement (broadcast_object): none happens per step in the engine.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from toolkit.distributed import DistInfo, all_gather_flat, any_true, reduce_scatter_flat, sum_floats
from toolkit.observe.comm_ledger import CommLedger, wire_bytes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TimedWork:
    """A collective in flight: wait() blocks until it is done (and, under a simulated link, until the
    link would have delivered it), charging the blocked time to the ledger."""

    def __init__(self, work, ledger: CommLedger, done_at: float, issued_at: float):
        self.work, self.ledger, self.done_at, self.issued_at = work, ledger, done_at, issued_at
        self._waited = work is None

    def is_completed(self) -> bool:
        """True when waiting would not block."""
        return self._waited or ((self.work.is_completed()) and time.perf_counter() >= self.done_at)

    def wait(self, *, since_issued: bool = False) -> None:
        """Block until done; the time spent here (since the collective was issued, for one waited for at
        once: nothing ran meanwhile) is exposed communication."""
        if self._waited:
            return
        start = self.issued_at if since_issued else time.perf_counter()
        self.work.wait()
        late = self.done_at - time.perf_counter()
        if late > 0:
            time.sleep(late)
        self.ledger.blocked(time.perf_counter() - start)
        self._waited = True


class Communicator:
    """This rank's collectives over the default process group, counted (see the module docstring)."""

    def __init__(self, info: DistInfo, device: torch.device, *, overlap_comm: bool = True,
                 simulated_link_gbps: float | None = None):
        self.info, self.device, self.overlap_comm = info, device, overlap_comm
        self.ledger = CommLedger(simulated_link_gbps)
        self._link_free_at = 0.0  # simulated link: when the last collective issued leaves it

    @property
    def world(self) -> int:
        return self.info.world_size

    def _issue(self, kind: str, buffer_bytes: int, start) -> TimedWork:
        """Count a collective, start it (`start()` -> a work handle), and hand back its timed handle."""
        sent = wire_bytes(kind, buffer_bytes, self.world)
        self.ledger.sent(kind, sent)
        now = time.perf_counter()
        done_at = now
        gbps = self.ledger.simulated_link_gbps
        if gbps:
            self._link_free_at = max(self._link_free_at, now) + sent * 8 / (gbps * 1e9)
            done_at = self._link_free_at
        work = TimedWork(start(), self.ledger, done_at, issued_at=now)
        if not self.overlap_comm:
            work.wait(since_issued=True)
        return work

    # -- the collectives (async: a TimedWork; call .wait()) --------------------------------

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, *, async_op: bool = True):
        """Sum (or `op`) `tensor` over the ranks in place."""
        work = self._issue("all_reduce", _nbytes(tensor), lambda: dist.all_reduce(tensor, op=op, async_op=True))
        return work if async_op else work.wait(since_issued=True)

    def reduce_scatter_flat(self, output: torch.Tensor, source: torch.Tensor) -> TimedWork:
        """Sum `source` over the ranks; rank r receives chunk r of the sum in `output`."""
        return self._issue("reduce_scatter", _nbytes(source), lambda: reduce_scatter_flat(output, source))

    def all_gather_flat(self, output: torch.Tensor, chunk: torch.Tensor) -> TimedWork:
        """Every rank's `chunk` laid end to end in `output`."""
        return self._issue("all_gather", _nbytes(output), lambda: all_gather_flat(output, chunk))

    def all_gather_list(self, outputs: list[torch.Tensor], chunk: torch.Tensor) -> TimedWork:
        """Every rank's `chunk` into `outputs[rank]`."""
        return self._issue("all_gather", sum(_nbytes(o) for o in outputs),
                           lambda: dist.all_gather(outputs, chunk, async_op=True))

    def all_to_all_flat(self, output: torch.Tensor, source: torch.Tensor) -> TimedWork:
        """Chunk r of every rank's `source`, laid end to end in rank r's `output` (equal chunks)."""
        return self._issue("all_to_all", _nbytes(source),
                           lambda: dist.all_to_all_single(output, source, async_op=True))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Rank `src`'s `tensor` on every rank (synchronous)."""
        work = self._issue("broadcast", _nbytes(tensor), lambda: dist.broadcast(tensor, src=src, async_op=True))
        work.wait(since_issued=True)

    # -- the small ones the strategies need (toolkit/distributed.py's, counted) -----------------

    def any_true(self, flag: bool) -> bool:
        """True when `flag` is true on any rank (every rank gets the same answer)."""
        return any_true(flag, self.info, self.device, all_reduce=self._all_reduce_now)

    def sum_floats(self, values: list[float]) -> list[float]:
        """Element-wise sum of a few floats over the ranks (float64 on the wire)."""
        return sum_floats(values, self.info, self.device, all_reduce=self._all_reduce_now)

    def _all_reduce_now(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        self.all_reduce(tensor, op, async_op=False)

    def describe(self) -> str:
        """One line for the start-up table."""
        if not self.info.active:
            return "one process: no collectives"
        overlap = ("overlapped with compute (zero.overlap_comm)" if self.overlap_comm else
                   "each collective waited for when issued (zero.overlap_comm false)")
        gbps = self.ledger.simulated_link_gbps
        sim = f"; SIMULATED link {gbps:g} Gb/s: each collective delayed by bytes / bandwidth" if gbps else ""
        return f"{overlap}{sim}"

