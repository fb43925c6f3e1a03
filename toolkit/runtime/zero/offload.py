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

from dataclasses import dataclass

import torch

from toolkit.runtime.zero.flat import ShardLayout

PIECE_NUMEL = 1 << 24  # 16M elements: 64 MiB of fp32 gradient per transfer, ~10 ms of CPU AdamW on 16 cores


@dataclass(frozen=True)
class Piece:
    """A run of the shard with one weight-decay setting, inside one group's chunk."""
    group: int
    start: int         # within the group's chunk
    shard_offset: int  # within the rank's flat shard (master, moments)
    numel: int
    decay: bool


def split_pieces(layout: ShardLayout, piece_numel: int) -> list[Piece]:
    """The layout's weight-decay segments cut into pieces of at most `piece_numel` elements."""
    pieces = []
    for s in layout.segments:
        for a in range(0, s.stop - s.start, piece_numel):
            n = min(piece_numel, s.stop - s.start - a)
            pieces.append(Piece(s.group, s.start + a, s.shard_offset + a, n, s.decay))
    return pieces


class OffloadedStep:
    """AdamW for a rank's shard with master and moments in CPU memory, gradients and weights on `device`."""

    def __init__(self, layout: ShardLayout, optimizer, master: torch.Tensor, grad_chunks: list[torch.Tensor],
                 param_chunks: list[torch.Tensor], device: torch.device, piece_numel: int | None = None):
        self.optimizer, self.master = optimizer, master
        self.grad_chunks, self.param_chunks = grad_chunks, param_chunks
        self.pieces = split_pieces(layout, piece_numel or PIECE_NUMEL)
        self.cuda = device.type == "cuda"
        size = max((p.numel for p in self.pieces), default=0)
        dtype = param_chunks[0].dtype if param_chunks else torch.float32
        # NOTE: two of each, so piece k+1 arrives and piece k-1 leaves while piece k is stepped.
        self.grad_staging = [torch.empty(size, dtype=torch.float32, pin_memory=self.cuda) for _ in range(2)]
        self.out_staging = [torch.empty(size, dtype=dtype, pin_memory=self.cuda) for _ in range(2)]
        if self.cuda:
            self.d2h, self.h2d = torch.cuda.Stream(device), torch.cuda.Stream(device)
            self.arrived = [torch.cuda.Event() for _ in range(2)]
            self.sent = [torch.cuda.Event() for _ in range(2)]

    def _fetch(self, k: int) -> None:
        piece, slot = self.pieces[k], k % 2
        source = self.grad_chunks[piece.group][piece.start:piece.start + piece.numel]
        target = self.grad_staging[slot][:piece.numel]
        if not self.cuda:
            target.copy_(source)
            return
        with torch.cuda.stream(self.d2h):
            target.copy_(source, non_blocking=True)
            self.arrived[slot].record()

    def _send(self, k: int, weights: torch.Tensor) -> None:
        piece = self.pieces[k]
        target = self.param_chunks[piece.group][piece.start:piece.start + piece.numel]
        if not self.cuda:
            target.copy_(weights)
            return
        with torch.cuda.stream(self.h2d):
            target.copy_(weights, non_blocking=True)
            self.sent[k % 2].record()

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step over every piece; on return the device's weights are the new ones (stream-ordered)."""
        self.optimizer.begin_step()
        if not self.pieces:
            return
        if self.cuda:  # the gradients are final (unscaled, clipped) once the compute stream gets here
            self.d2h.wait_stream(torch.cuda.current_stream())
            self.h2d.wait_stream(torch.cuda.current_stream())
        self._fetch(0)
        for k, piece in enumerate(self.pieces):
            if k + 1 < len(self.pieces):
                self._fetch(k + 1)  # its staging slot was read by piece k-1's CPU step, which has returned
            slot, sl = k % 2, slice(piece.shard_offset, piece.shard_offset + piece.numel)
            out = self.out_staging[slot][:piece.numel]
            if self.cuda:
                self.arrived[slot].synchronize()
                self.sent[slot].synchronize()  # piece k-2's weights have left this staging slot
            self.optimizer.update(piece.decay, self.master[sl], self.grad_staging[slot][:piece.numel],
                                  self.optimizer.exp_avg[sl], self.optimizer.exp_avg_sq[sl], out)
            self._send(k, out)
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.h2d)
