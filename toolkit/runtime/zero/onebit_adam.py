"""1-bit Adam (optimizer.type onebit_adam): DeepSpeed's compressed-communication Adam
(Tang et al. 2021, arXiv:2102.02888; deepspeed/runtime/fp16/onebit/adam.py and the
compressed all-reduce of deepspeed/runtime/comm/nccl.py), on zero.stage 0.

Warm-up, the first optimizer.freeze_step steps: plain Adam on gradients all-reduced
in backward like data parallelism (stage 0's buckets). Then the variance (exp_avg_sq)
is frozen and backward communicates nothing: each rank updates the momentum with
its own gradient, and the momentum is averaged with the compressed all-reduce:
  worker  add the worker error; per parameter, scale = ||x|| / sqrt(numel); send the
          signs (1 bit each, packed 8 to a uint8) and the scales; keep x - scale*sign
          as the worker error (error feedback)
  server  rank r owns chunk r of the flat momentum: all-to-all of the packed signs, it
          averages the decompressed chunks of every rank, adds its server error,
          compresses again (a scale per parameter piece) and keeps the error
  gather  all-gather of the servers' packed signs and scales: every rank decompresses
          the same averaged momentum.
The update is DeepSpeed's: exp_avg / (sqrt(exp_avg_sq) + eps) plus weight_decay x
weight (matrices only, as for AdamW here), times lr; no bias correction.
Differences from DeepSpeed, on purpose: its first step only allocates state (no update)
and is not reproduced; the momentum is compressed as one flat buffer (one all-to-all and
three all-gathers per step, whatever the number of tensors) with a scale per parameter
on the worker side and per parameter piece on the server side, where DeepSpeed issues
those collectives per tensor; the error buffers are saved in checkpoints (one file per
rank) and restored at the same world size, where DeepSpeed resets them on load.
Refused (toolkit/recipe/checks.py): zero.stage > 0, fp16, a tensor/pipeline mesh; here: one process. The
optimizer state and its update are onebit_optimizer.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from toolkit.distributed import DistInfo
from toolkit.errors import UserError
from toolkit.observe.comm_ledger import wire_bytes
from toolkit.runtime.communicator import Communicator
from toolkit.runtime.zero.ddp import DataParallel
from toolkit.runtime.strategy import tensor_bytes
from toolkit.specs import OptimizerSpec, ZeroSpec

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """One bit per element of `x` (1: x >= 0), eight to a uint8, first element in the high bit."""
    bits = (x >= 0).to(torch.uint8).view(-1, 8)
    return (bits * _BIT_WEIGHTS.to(x.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """+1 / -1 (float32) for each bit of `packed`, in pack_signs' order."""
    bits = (packed.unsqueeze(1) >> _SHIFTS.to(packed.device)) & 1
    return bits.reshape(-1).to(torch.float32).mul_(2).sub_(1)


def segment_scales(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """||segment|| / sqrt(len) for consecutive segments of `x` (0 for an empty one)."""
    pieces = [p for p in x.split(lengths)]
    norms = torch.stack([torch.linalg.vector_norm(p) if p.numel() else x.new_zeros(()) for p in pieces])
    sizes = torch.tensor([max(n, 1) for n in lengths], dtype=x.dtype, device=x.device)
    return norms / sizes.sqrt()


def compress_with_feedback(x: torch.Tensor, error: torch.Tensor, lengths: list[int]):
    """(packed signs, scales) of x + error per segment; `error` becomes what the compression lost."""
    x = x + error
    scales = segment_scales(x, lengths)
    signs = torch.where(x >= 0, 1.0, -1.0)
    error.copy_(x - signs * torch.repeat_interleave(scales, torch.tensor(lengths, device=x.device)))
    return pack_signs(x), scales


def chunk_segments(lengths: list[int], lo: int, hi: int) -> tuple[list[int], list[int]]:
    """The pieces of consecutive segments that fall in [lo, hi): (their lengths, their segment index)."""
    out, owners, start = [], [], 0
    for i, n in enumerate(lengths):
        a, b = max(start, lo), min(start + n, hi)
        if a < b:
            out.append(b - a)
            owners.append(i)
        start += n
    return out, owners


class OnebitAdamStrategy(DataParallel):
    """Stage 0 with 1-bit Adam: all-reduced gradients for freeze_step steps, then compressed momentum."""

    def __init__(self, model: nn.Module, zero: ZeroSpec, optimizer: OptimizerSpec, device: torch.device,
                 info: DistInfo, comm: Communicator):
        if not info.active:
            raise UserError("recipe.optimizer.type: onebit_adam compresses the ranks' communication and needs "
                            "several ranks; launch with `toolkit run --nproc N` or use 'adamw'")
        super().__init__(model, zero, optimizer, device, info, "torch", comm)  # its optimizer: OnebitAdam
        self.freeze_step = optimizer.freeze_step
        world, chunk = info.world_size, self.optimizer.padded // info.world_size
        self._server = [chunk_segments(self.optimizer.lengths, r * chunk, (r + 1) * chunk) for r in range(world)]
        self._most_pieces = max(len(lengths) for lengths, _ in self._server)
        self._announced = False

    @property
    def compressing(self) -> bool:
        """True once freeze_step warm-up steps are done."""
        return self.optimizer.step_count >= self.freeze_step

    def describe(self) -> str:
        """One line for the start-up table."""
        return (f"stage 0 (data parallel) over {self.info.world_size} rank(s) with 1-bit Adam: gradients "
                f"all-reduced for {self.freeze_step} warm-up step(s), then the momentum all-reduced as signs "
                f"+ scales with error feedback ({self.optimizer.numel:,} elements)")

    def begin_micro_step(self, boundary: bool) -> None:
        """Backward all-reduces the gradients only during the warm-up."""
        super().begin_micro_step(boundary and not self.compressing)

    def optimizer_step(self) -> None:
        """Adam on the all-reduced gradient (warm-up), or 1-bit Adam on this rank's gradient."""
        compressing = self.compressing
        if compressing and not self._announced and self.info.is_main:
            print(f"onebit_adam: step {self.optimizer.step_count + 1}: variance frozen, compressed communication "
                  "starts", file=sys.stderr, flush=True)
        self._announced = self._announced or compressing
        grads = torch.cat([flat.reshape(-1) for flat in self.flat_grads])
        self.optimizer.update(grads, self.compressed_allreduce if compressing else None)

    def optimizer_steps(self) -> int:
        """Optimizer steps applied so far."""
        return self.optimizer.step_count

    @torch.no_grad()
    def compressed_allreduce(self, buffer: torch.Tensor) -> None:
        """Replace `buffer` (the padded flat momentum) by its compressed average over the ranks."""
        opt, world, rank = self.optimizer, self.info.world_size, self.info.rank
        chunk = opt.padded // world
        packed, scales = compress_with_feedback(buffer, opt.worker_error, opt.lengths)
        received = torch.empty_like(packed)
        works = [self.comm.all_to_all_flat(received, packed)]
        all_scales = torch.empty(world * scales.numel(), device=buffer.device)
        works.append(self.comm.all_gather_flat(all_scales, scales))
        for work in works:
            work.wait()
        lengths, owners = self._server[rank]
        sizes = torch.tensor(lengths, device=buffer.device)
        per_rank = all_scales.view(world, -1)[:, owners]  # each worker's scale for each piece of my chunk
        signs = unpack_signs(received).view(world, chunk)
        mine = (signs * torch.repeat_interleave(per_rank, sizes, dim=1)).sum(0).div_(world)
        packed_mine, scales_mine = compress_with_feedback(mine, opt.server_error, lengths)
        padded_scales = torch.zeros(self._most_pieces, device=buffer.device)
        padded_scales[:scales_mine.numel()] = scales_mine
        all_packed = torch.empty(opt.padded // 8, dtype=torch.uint8, device=buffer.device)
        server_scales = torch.empty(world * self._most_pieces, device=buffer.device)
        works = [self.comm.all_gather_flat(all_packed, packed_mine),
                 self.comm.all_gather_flat(server_scales, padded_scales)]
        for work in works:
            work.wait()
        signs = unpack_signs(all_packed).view(world, chunk)
        for r, (lengths_r, _) in enumerate(self._server):
            piece_scales = server_scales.view(world, -1)[r, :len(lengths_r)]
            buffer[r * chunk:(r + 1) * chunk] = signs[r] * torch.repeat_interleave(
                piece_scales, torch.tensor(lengths_r, device=buffer.device))

    def expected_bytes_per_step(self, grad_accum_steps: int) -> dict[str, int]:
        """Bytes per rank of one compressed step, after the freeze step (the warm-up's are stage 0's): the
        packed signs twice, the scales twice (the formula behind the start-up table and the tests)."""
        opt, world = self.optimizer, self.info.world_size
        signs = opt.padded // 8
        scales = world * 4 * (len(opt.lengths) + self._most_pieces)
        return {"all_to_all": wire_bytes("all_to_all", signs, world),
                "all_gather": wire_bytes("all_gather", signs, world) + wire_bytes("all_gather", scales, world)}

    # -- checkpoint: the error-feedback buffers, one file per rank -------------------------------

    def extra_state(self) -> dict[str, torch.Tensor]:
        """This rank's worker and server error buffers."""
        return {"worker_error": self.optimizer.worker_error, "server_error": self.optimizer.server_error}

    @torch.no_grad()
    def load_extra_state(self, directory: Path, files: list[str]) -> None:
        """This rank's error buffers from a checkpoint saved at the same world size; else start them at zero
        (DeepSpeed's behaviour on every load) with a warning."""
        from safetensors.torch import load_file

        if len(files) != self.info.world_size:
            if self.info.is_main:
                print(f"warning: onebit_adam: the checkpoint's error-feedback buffers are for {len(files)} rank(s), "
                      f"this run has {self.info.world_size}; they restart at zero", file=sys.stderr, flush=True)
            return
        saved = load_file(str(Path(directory) / files[self.info.rank]))
        for name, buffer in self.extra_state().items():
            buffer.copy_(saved[name])

    # -- what stage 0's versions read from a torch optimizer ------------------------------------

    @torch.no_grad()
    def load_pieces(self, reader) -> None:
        """Whole parameters and Adam moments from any checkpoint reader (a ZeRO one included)."""
        m = self.optimizer.exp_avg[:self.optimizer.numel].split(self.optimizer.sizes)
        v = self.optimizer.exp_avg_sq.split(self.optimizer.sizes)
        for p, m_p, v_p in zip(self.params, m, v):
            name = self._names[id(p)]
            p.copy_(reader.read("param", name, 0, p.numel()).view_as(p))
            if reader.step:
                m_p.copy_(reader.read("exp_avg", name, 0, p.numel()))
                v_p.copy_(reader.read("exp_avg_sq", name, 0, p.numel()))
        self.optimizer.step_count = reader.step

    def memory_bytes(self) -> dict:
        """Model-state bytes held now (the error buffers count as optimizer state)."""
        opt = self.optimizer
        return {"mem_params_bytes": tensor_bytes(p.detach() for p in self.params),
                "mem_grads_bytes": tensor_bytes(self.flat_grads),
                "mem_optim_bytes": tensor_bytes([opt.exp_avg, opt.exp_avg_sq, opt.worker_error, opt.server_error]),
                "mem_master_bytes": 0, "mem_offload_bytes": 0}
