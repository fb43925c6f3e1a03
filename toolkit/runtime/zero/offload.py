"""ZeRO-Offload's optimizer step, pipelined in pieces.

The fp32 master weights and the AdamW moments live in CPU memory; the reduced fp32
gradient shard stays on the training device. At the step, the shard streams to the
CPU one piece at a time while the CPU steps the piece before it and the new weights
of the piece before that go back to the device:

    device grads, piece k+1 --D2H, pinned staging-->  CPU AdamW, piece k         (kernels/cpu_adam.cpp)
    device weights, piece k-1 <--H2D, pinned staging--  new weights in the model dtype

Why pieces at the step rather than gradients streamed to the CPU during backward:
the CPU step is the slow part of an offloaded step, so copies hidden under it cost
nothing, and CPU memory holds only master + moments (12 bytes per parameter per rank)
plus two pieces of staging, not also a 4-byte gradient and a 2-byte weight copy
(DeepSpeed's 18 bytes, which on a 128 GiB host stop it near 5B parameters). The
device keeps the fp32 gradient shard (4 bytes per parameter per rank) instead.
On a CPU-only run the device is the CPU: the same pieces, plain copies.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from toolkit.runtime.zero.flat import ShardLayout
from toolkit.runtime.zero.swap import wait

PIECE_NUMEL = 1 << 24  # 16M elements: 64 MiB of fp32 gradient per transfer, ~10 ms of CPU AdamW on 16 cores


@dataclass(frozen=True)
class Piece:
    """A run of the shard with one weight-decay setting, inside one group's chunk."""
    group: int
    start: int         # within the group's chunk
    shard_offset: int  # within the rank's flat shard (master, moments)
    numel: int
    decay: bool


class PieceSequence:
    """The order a step takes its pieces in: all of them in shard order (their gradients are final when the step
    starts), or, given `arrivals` (zero.offload_update overlapped, overlapped_update.py), each group's pieces as
    soon as backward has finished that group's gradients, groups in the order they arrive."""

    def __init__(self, pieces: list[Piece], arrivals=None, on_arrival=None):
        self.arrivals, self.on_arrival = arrivals, on_arrival
        self.queue = list(range(len(pieces))) if arrivals is None else []
        self.by_group: dict[int, list[int]] = {}
        for k, piece in enumerate(pieces):
            self.by_group.setdefault(piece.group, []).append(k)

    def next(self, block: bool) -> int | None:
        """The next piece; None when every piece has been taken, or (block False) when the next group's gradients
        are not final yet."""
        while not self.queue and self.arrivals is not None:
            arrived = self.arrivals.take(block)
            if arrived is None:
                return None
            local, event = arrived
            if self.on_arrival is not None:
                self.on_arrival(event)  # the copies wait for backward's work on that group (CUDA streams)
            self.queue = list(self.by_group.get(local, []))
        return self.queue.pop(0) if self.queue else None


def split_pieces(layout: ShardLayout, piece_numel: int) -> list[Piece]:
    """The layout's weight-decay segments cut into pieces of at most `piece_numel` elements."""
    pieces = []
    for s in layout.segments:
        for a in range(0, s.stop - s.start, piece_numel):
            n = min(piece_numel, s.stop - s.start - a)
            pieces.append(Piece(s.group, s.start + a, s.shard_offset + a, n, s.decay))
    return pieces


class OffloadedStep:
    """AdamW for a rank's shard with master and moments in CPU memory, gradients on `device`, new weights
    written to `weights` (param_offload.py: the device's chunks, or the CPU / swap tier of offload_param)."""

    def __init__(self, layout: ShardLayout, optimizer, master: torch.Tensor | None, grad_chunks: list[torch.Tensor],
                 weights, groups: range, device: torch.device, piece_numel: int | None = None, in_place: bool = False,
                 master_is_weights: bool = False):
        self.optimizer, self.master = optimizer, master
        # offload_param cpu (shard_part.host_shard_as_master): the master is the host's weights, stepped where it is
        self.master_is_weights = master_is_weights
        self.grad_chunks, self.weights, self.groups = grad_chunks, weights, groups
        self.pieces = split_pieces(layout, piece_numel or PIECE_NUMEL)
        self.cuda = device.type == "cuda"
        # in_place: the gradients and the weights are CPU buffers this step owns (a delayed update's,
        # delayed_update.py), read and written where they are, with no staging copies
        self.in_place = in_place
        self.piece_spans: list[tuple[float, float]] = []  # perf_counter (start, end) of the last step's pieces' AdamW
        size = 0 if in_place else max((p.numel for p in self.pieces), default=0)
        dtype = weights.read(groups[0]).dtype if len(groups) else torch.float32
        # NOTE: two of each, so piece k+1 arrives and piece k-1 leaves while piece k is stepped.
        self.grad_staging = [torch.empty(size, dtype=torch.float32, pin_memory=self.cuda) for _ in range(2)]
        self.out_staging = [torch.empty(size, dtype=dtype, pin_memory=self.cuda) for _ in range(2)]
        self.unclipped = [False, False]  # a speculating overlapped step: each slot's gradient read before the clip
        if self.cuda:
            self.d2h, self.h2d = torch.cuda.Stream(device), torch.cuda.Stream(device)
            self.arrived = [torch.cuda.Event() for _ in range(2)]
            self.sent = [torch.cuda.Event() for _ in range(2)]

    def _fetch(self, k: int, slot: int, speculation=None) -> None:
        if self.in_place:
            return
        if speculation is not None:  # whether the copy reads the gradient before the clip (speculation.py)
            self.unclipped[slot] = speculation.fetch(lambda: self._copy_in(k, slot))
            return
        self._copy_in(k, slot)

    def _copy_in(self, k: int, slot: int) -> None:
        piece = self.pieces[k]
        source = self.grad_chunks[piece.group][piece.start:piece.start + piece.numel]
        target = self.grad_staging[slot][:piece.numel]
        if not self.cuda:
            target.copy_(source)
            return
        with torch.cuda.stream(self.d2h):
            target.copy_(source, non_blocking=True)
            self.arrived[slot].record()

    # a delayed update's early landing (delayed_update.py): called with each piece once its new weights are written
    piece_done = None

    def _send(self, k: int, slot: int, weights: torch.Tensor) -> None:
        if self.in_place or self.master_is_weights:  # `weights` is the destination itself (_arrived)
            if self.piece_done is not None:
                self.piece_done(self.pieces[k])
            return
        piece = self.pieces[k]
        if not (self.cuda and self.weights.on_device):  # CPU copies, or offload_param's host / swap tier
            self.weights.write(self.groups[piece.group], piece.start, weights)
            return
        target = self.weights.chunks[self.groups[piece.group]][piece.start:piece.start + piece.numel]
        with torch.cuda.stream(self.h2d):
            target.copy_(weights, non_blocking=True)
            self.sent[slot].record()

    def _sequence(self, arrivals) -> PieceSequence:
        """The pieces in the order this step takes them (see PieceSequence), the copy streams ordered after the work
        that made their gradients final."""
        if arrivals is None and self.cuda:  # the gradients are final (unscaled, clipped) once the compute stream gets here
            self.d2h.wait_stream(torch.cuda.current_stream())
            self.h2d.wait_stream(torch.cuda.current_stream())
        return PieceSequence(self.pieces, arrivals, self._after_event if self.cuda else None)

    def _after_event(self, event) -> None:
        self.d2h.wait_event(event)
        self.h2d.wait_event(event)  # backward's reads of these weights were queued before it

    def _arrived(self, k: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Piece k's gradients and where its new weights go: staging slots once their copies are done, or in place."""
        piece = self.pieces[k]
        n = piece.numel
        if self.in_place:
            window = slice(piece.start, piece.start + n)
            return self.grad_chunks[piece.group][window], self.weights.read(self.groups[piece.group])[window]
        if self.cuda:
            self.arrived[slot].synchronize()
            self.sent[slot].synchronize()  # piece k-2's weights have left this staging slot
        if self.master_is_weights:  # the update writes the master, which is the weights (zero/adamw.py `update`)
            return self.grad_staging[slot][:n], self.master[piece.shard_offset:piece.shard_offset + n]
        return self.grad_staging[slot][:n], self.out_staging[slot][:n]

    def _end(self, arrivals) -> None:
        # NOTE: an overlapped step's thread leaves this to OverlappedUpdate.finish, on the training thread: here it
        # would make the compute stream wait in the middle of the backward
        if self.cuda and arrivals is None:
            torch.cuda.current_stream().wait_stream(self.h2d)

    # zero.offload_update delayed_extrapolated (delayed_update.py): `out` gets the master one update ahead,
    # 2 x new - old, the weights the next gradient will be applied to, had this update's direction held
    extrapolate = False
    # zero.offload_update delayed: the multipliers (clip, fp16 unscale) its gradient copy has yet to take
    grad_scales: tuple[float, ...] = ()

    def _update(self, piece: Piece, master: torch.Tensor, grads, m, v, out: torch.Tensor) -> None:
        """This step's AdamW on one piece; `out` gets the new weights (or, extrapolating, one update beyond them)."""
        self.optimizer.update(piece.decay, master, grads, m, v, out, offset=piece.shard_offset,
                              extrapolate=self.extrapolate, grad_scales=self.grad_scales)

    def _update_held(self, piece: Piece, grads: torch.Tensor, out: torch.Tensor) -> None:
        """`_update` on the piece's master and moments where this step holds them, in CPU memory (SwappedStep reads
        them into its slots instead)."""
        sl = slice(piece.shard_offset, piece.shard_offset + piece.numel)
        self._update(piece, self.master[sl], grads, self.optimizer.exp_avg[sl], self.optimizer.exp_avg_sq[sl], out)

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step over every piece; on return the device's weights are the new ones (stream-ordered)."""
        self.optimizer.begin_step()
        self.run_pieces()

    @torch.no_grad()
    def run_pieces(self, arrivals=None, speculation=None) -> None:
        """The step's pieces, after the optimizer's `begin_step` (a delayed or overlapped update runs them on its
        thread; `arrivals`: PieceSequence's; `speculation`: an overlapped step's clip coefficient, speculation.py)."""
        sequence = self._sequence(arrivals)
        k = sequence.next(block=True)
        if k is not None:
            self._fetch(k, 0, speculation)
        waited = stepped = 0.0
        self.piece_spans = []
        i = 0
        while k is not None:
            # NOTE: piece i+1 is fetched before piece i steps when its gradients are final; its staging slot was read
            # by piece i-1's CPU step, which has returned
            ahead = sequence.next(block=False)
            if ahead is not None:
                self._fetch(ahead, (i + 1) % 2, speculation)
            piece = self.pieces[k]
            start = time.perf_counter()
            grads, out = self._arrived(k, i % 2)
            if speculation is not None and speculation.before_update(k, piece.shard_offset, piece.numel,
                                                                     self.unclipped[i % 2]):
                self._fetch(k, i % 2, speculation)  # fetched before the clip: its clipped gradient now
                grads, out = self._arrived(k, i % 2)
            arrived = time.perf_counter()
            self._update_held(piece, grads, out)
            self.piece_spans.append((arrived, time.perf_counter()))
            waited, stepped = waited + arrived - start, stepped + self.piece_spans[-1][1] - arrived
            self._send(k, i % 2, out)
            if ahead is None:  # overlapped: wait for backward's next group
                ahead = sequence.next(block=True)
                if ahead is not None:
                    self._fetch(ahead, (i + 1) % 2, speculation)
            k, i = ahead, i + 1
        if speculation is not None:
            self._settle(speculation, i)
        self.optimizer.end_pieces()
        self._end(arrivals)
        # the last step's CPU seconds: blocked on a piece's transfers, and in its AdamW (benchmarks/offload_profile.py)
        self.last_seconds = {"waited": waited, "stepped": stepped}

    def _settle(self, speculation, i: int) -> None:
        """The speculated pieces stand when the coefficient is 1; else each is restored, its clipped gradient fetched
        and stepped, its weights sent again (`i`: the staging slots' turn)."""
        if not speculation.saved:
            speculation.outcomes.append("waited")
            return
        coef = speculation.wait()
        if coef is None:  # cancelled: the step will not finish
            return
        speculation.outcomes.append("stood" if coef == 1.0 else "rolled back")
        if coef == 1.0:
            return
        for k in speculation.restore():
            self._fetch(k, i % 2, speculation)
            grads, out = self._arrived(k, i % 2)
            self._update_held(self.pieces[k], grads, out)
            self._send(k, i % 2, out)
            i += 1


class SwappedStep(OffloadedStep):
    """offload_optimizer nvme: as OffloadedStep, with master and moments streamed from a swap file
    (regions: master, exp_avg, exp_avg_sq, each the shard's length in fp32) through three buffer slots:

        read piece k+1 (I/O threads)  |  CPU AdamW piece k  |  write piece k-1 (I/O threads)

    so CPU memory holds 3 x 12 bytes x PIECE_NUMEL of state (576 MiB at the default), whatever the model.
    """

    def __init__(self, layout: ShardLayout, optimizer, swap, grad_chunks, weights, groups: range,
                 device: torch.device, piece_numel: int | None = None, in_place: bool = False):
        super().__init__(layout, optimizer, None, grad_chunks, weights, groups, device, piece_numel, in_place)
        # the states' dtype in the file: fp32, or bf16 (optimizer.state_dtype bf16); int8 moments keep only the fp32
        # master here (their codes are swapped by the optimizer's own SwappedMoments, block by block)
        int8 = optimizer.moments is not None
        dtype = torch.float32 if int8 else optimizer.exp_avg.dtype
        self.regions = 1 if int8 else 3
        self.element = torch.empty(0, dtype=dtype).element_size()
        self.swap, self.region = swap, self.element * layout.numel
        size = max((p.numel for p in self.pieces), default=0)
        self.slots = [torch.empty(self.regions, size, dtype=dtype) for _ in range(3)]
        self._writes: dict[int, list] = {}

    def _read(self, k: int, slot: int) -> list:
        piece = self.pieces[k]
        wait(self._writes.pop(slot, []))  # piece k-3 has left this slot
        return [f for kind in range(self.regions) for f in self.swap.read_async(
            self.slots[slot][kind, :piece.numel], kind * self.region + self.element * piece.shard_offset)]

    def _write(self, k: int, slot: int) -> None:
        piece = self.pieces[k]
        self._writes[slot] = [f for kind in range(self.regions) for f in self.swap.write_async(
            self.slots[slot][kind, :piece.numel], kind * self.region + self.element * piece.shard_offset)]

    @torch.no_grad()
    def run_pieces(self, arrivals=None) -> None:
        """The step's pieces, states read from and written back to the swap file."""
        sequence = self._sequence(arrivals)
        k = sequence.next(block=True)
        reading = None
        if k is not None:
            self._fetch(k, 0)
            reading = self._read(k, 0)
        self.piece_spans = []
        i = 0
        while k is not None:
            ahead = sequence.next(block=False)
            ahead_reading = None
            if ahead is not None:
                self._fetch(ahead, (i + 1) % 2)
                ahead_reading = self._read(ahead, (i + 1) % 3)
            wait(reading)
            piece = self.pieces[k]
            states = self.slots[i % 3][:, :piece.numel]
            master, m, v = states if self.regions == 3 else (states[0], None, None)  # int8: moments not here
            grads, out = self._arrived(k, i % 2)
            start = time.perf_counter()
            self._update(piece, master, grads, m, v, out)
            self.piece_spans.append((start, time.perf_counter()))
            self._write(k, i % 3)
            self._send(k, i % 2, out)
            if ahead is None:  # overlapped: wait for backward's next group
                ahead = sequence.next(block=True)
                if ahead is not None:
                    self._fetch(ahead, (i + 1) % 2)
                    ahead_reading = self._read(ahead, (i + 1) % 3)
            k, reading, i = ahead, ahead_reading, i + 1
        self.optimizer.end_pieces()  # int8: the last open blocks back to their file
        for slot in list(self._writes):
            wait(self._writes.pop(slot))
        self._end(arrivals)
