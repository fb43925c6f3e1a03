"""One tier of a rank's optimizer shard, and how the shard's groups are cut into tiers.

A `ShardPart` is a run of consecutive groups whose fp32 master weights and AdamW moments live in one
place: the device, CPU memory (offload_optimizer cpu) or a swap file (nvme). `split_groups` cuts the
groups at a ratio of the shard's elements (zero.offload_ratio, then zero.nvme_ratio): whole groups,
the same cut on every rank. sharded.py assembles the parts and drives them.
"""
from __future__ import annotations

import torch

from toolkit.runtime.int8_moments import BLOCK
from toolkit.runtime.optim import FlatShard, build_optimizer
from toolkit.runtime.zero.flat import FlatGroup, ShardLayout
from toolkit.runtime.zero import offload
from toolkit.runtime.zero.delayed_update import DelayedUpdate
from toolkit.runtime.zero.offload import OffloadedStep, SwappedStep
from toolkit.runtime.zero.overlapped_update import OverlappedUpdate
from toolkit.runtime.zero.swap import SwapDir
from toolkit.runtime.zero.swapped_moments import SwappedMoments, swapped_moments_bytes
from toolkit.specs import OptimizerSpec


def state_dtype(spec: OptimizerSpec) -> torch.dtype:
    """The master's and moments' dtype: bf16 weights on the device are their own master under state_dtype bf16."""
    return torch.bfloat16 if spec.state_dtype == "bf16" else torch.float32


def optimizer_swap_bytes(spec: OptimizerSpec, numel: int) -> int:
    """Bytes of a part's swap files for `numel` elements (what ShardPart reserves, and the disk check counts): master,
    exp_avg and exp_avg_sq in the state dtype (fp32 12 bytes an element, bf16 6), or under int8 moments an fp32 master
    file and the 8-bit moments' file."""
    if spec.state_dtype == "int8":
        return 4 * numel + swapped_moments_bytes(numel)
    return 3 * torch.empty(0, dtype=state_dtype(spec)).element_size() * numel


class ShardPart:
    """A run of consecutive groups whose master weights and AdamW moments live on one tier: the device,
    CPU memory (offload_optimizer cpu) or a swap file (offload_optimizer nvme: `swap` is set)."""

    def __init__(self, spec: OptimizerSpec, groups: range, all_groups: list[FlatGroup], rank: int, weights, grad_chunks,
                 device: torch.device, offloaded: bool, dtype: torch.dtype, swap_dir: SwapDir | None = None,
                 comm=None, delay_after: int | None = None, extrapolate: bool = False, overlap: bool = False,
                 speculate: bool = False):
        self.groups = groups
        self.layout = ShardLayout([all_groups[g] for g in groups], rank)
        self.weights, self.grad_chunks = weights, [grad_chunks[g] for g in groups]
        self.offloaded = offloaded
        opt_device = torch.device("cpu") if offloaded else device
        numel = self.layout.numel
        # nvme: master, exp_avg, exp_avg_sq are three regions of one file (fresh moments read as zeros), each in the
        # state dtype: fp32, or bf16 under optimizer.state_dtype bf16 (6 bytes an element instead of 12)
        self.state_dtype = state_dtype(spec)  # also a device part's separate master (offload_param: bf16 states)
        self.state_bytes = torch.empty(0, dtype=self.state_dtype).element_size()
        # int8 moments keep only the fp32 master in this file; their codes and scales are a second one (SwappedMoments)
        regions = 1 if spec.state_dtype == "int8" else 3
        name = f"rank{rank}-units{groups.start}-{groups.stop}.bin"
        self.swap = (swap_dir.file(f"optimizer-{name}", regions * self.state_bytes * numel)
                     if offloaded and swap_dir is not None else None)  # with the moments' file: optimizer_swap_bytes
        self.optimizer = build_optimizer(spec, FlatShard(0 if self.swap else numel, opt_device, offloaded,
                                                         self.layout, comm, compute_device=device))
        self.swap_files = [self.swap] if self.swap is not None else []
        if self.swap is not None and regions == 1:
            moments = swap_dir.file(f"optimizer-moments-{name}", swapped_moments_bytes(numel))
            self.optimizer.moments = SwappedMoments(moments, numel)
            self.swap_files.append(moments)
        self.master: torch.Tensor | None = None
        self.weights_are_master = False  # offload_param cpu: the host shard itself (host_shard_as_master)
        self.master_chunks = [weights.read(g) for g in groups]  # fp32 weights on the device are their own master
        if self.swap is not None:
            for local, g in enumerate(groups):
                self._write_region(local, 0, weights.read(g).to("cpu"))
            self.master_chunks = []
        elif offloaded or dtype not in (torch.float32, state_dtype(spec)) or not weights.on_device:
            # NOTE: offloaded bf16 states keep a bf16 master in CPU memory (kernels/cpu_adam_bf16.cpp, adamw_step_bf16)
            self.master = host_shard_as_master(weights, groups, numel, self.state_dtype,
                                               offloaded and delay_after is None)
            self.weights_are_master = self.master is not None
            if self.master is None:
                self.master = torch.empty(numel, dtype=self.state_dtype, device=opt_device)
            self.master_chunks = [self.layout.chunk_of(self.master, g) for g in range(len(groups))]
            for master, g in zip(self.master_chunks, groups):
                if not self.weights_are_master:
                    master.copy_(weights.read(g))
        # NOTE: Muon's exp_avg_sq is compact (AdamW's elements only): no chunk views of it (zero/muon.py); int8
        # moments are codes (chunk_states dequantizes copies, store_chunk_states stages them for one quantization)
        self.int8 = self.optimizer.moments
        self.loading: tuple[torch.Tensor, torch.Tensor] | None = None
        self.moment_chunks = [] if self.swap is not None or self.int8 is not None else [
            (self.layout.chunk_of(self.optimizer.exp_avg, g),
             None if self.optimizer.whole_matrices else self.layout.chunk_of(self.optimizer.exp_avg_sq, g))
            for g in range(len(groups))]
        if self.swap is not None and not self.optimizer.whole_matrices:
            self.offloaded_step = SwappedStep(self.layout, self.optimizer, self.swap, self.grad_chunks, weights,
                                              groups, device)
        else:  # NOTE: Muon offloaded steps whole chunks (`step`), not OffloadedStep's or SwappedStep's pieces
            self.offloaded_step = (OffloadedStep(self.layout, self.optimizer, self.master, self.grad_chunks,
                                                 weights, groups, device, master_is_weights=self.weights_are_master)
                                   if offloaded and not self.optimizer.whole_matrices else None)
        # zero.offload_update delayed: after `delay_after` applied steps, the CPU step runs behind the next step
        self.delay_after = delay_after
        self.delayed = (DelayedUpdate(self.layout, self.optimizer, self.master, self.swap, self.grad_chunks, weights,
                                      groups, device, dtype, extrapolate=extrapolate)
                        if offloaded and delay_after is not None else None)
        # zero.offload_update overlapped: the exact step's pieces, each group's from when backward makes it final
        # (speculate: training.grad_clip > 0, so each step's clip coefficient comes after the pieces begin; the states
        # it saves to roll back to are a master and two moments in memory: not swap files, not int8 codes)
        if speculate and overlap and offloaded and (self.swap is not None or self.int8 is not None):
            raise ValueError("zero.offload_update overlapped with training.grad_clip > 0 needs the optimizer states in "
                             "CPU memory in fp32 or bf16 (recipe checks say so first)")
        self.overlapped = (OverlappedUpdate(self.offloaded_step, in_order=self.int8 is not None, device=device,
                                            speculate=speculate)
                           if offloaded and overlap and self.offloaded_step is not None else None)

    @property
    def tier(self) -> str:
        """Where master and moments live, in the recipe's words: none (the device), cpu or nvme."""
        return "nvme" if self.swap is not None else "cpu" if self.offloaded else "none"

    def begin_final_round(self) -> None:
        """The accumulation's last micro-step starts: an overlapped update starts its thread; a delayed one will copy
        each group's gradient to the host as soon as backward makes it final."""
        if self.overlapped is not None:
            self.overlapped.begin()
        if self._delays_this_step():
            self.delayed.begin()

    def _delays_this_step(self) -> bool:
        """A delayed update lands and launches at the coming optimizer step (after `delay_after` exact ones)."""
        return self.delayed is not None and self.optimizer.step_count >= self.delay_after

    def group_final(self, local: int) -> None:
        """Backward has made group `local`'s reduced gradient final (in the last micro-step)."""
        if self.overlapped is not None:
            self.overlapped.ready(local)
        if self.delayed is not None:
            self.delayed.ready(local)

    def scaling_grads(self, factor: float) -> None:
        """The gradients are about to be multiplied after backward (fp16 unscaling, clipping): a delayed update's
        early copies of them take the same multiply unless `factor` is 1."""
        if self.delayed is not None and factor != 1.0:  # NOTE: not `< 1`: a NaN coefficient scales too
            self.delayed.scaling(factor)

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this part (the device's runs asynchronously; the CPU's returns when done, or, delayed, lands
        the last step's update and launches this one's)."""
        if self._delays_this_step():
            self.delayed.stage()  # NOTE: before landing: the copy overlaps the last update's end and its landing
            self.delayed.land()
            self.delayed.launch()
            return
        if self.overlapped is not None and self.overlapped.in_flight:  # begun in the last micro-step's backward
            self.overlapped.finish()
            return
        if self.offloaded_step is not None:
            self.offloaded_step.step()
            return
        if self.int8 is not None:  # the shard's moments in 8 bits, a window at a time (int8_moments.py)
            self.optimizer.step_segments(self.layout, self.master_chunks, self.grad_chunks)
            self.publish()
            return
        if self.optimizer.whole_matrices:  # Muon: per slot, gathering each matrix (zero/muon.py)
            self._step_whole_matrices()
            return
        views = {decay: (self.layout.segment_views(self.master_chunks, decay),
                         self.layout.segment_views(self.grad_chunks, decay),
                         self.layout.segment_views([m for m, _ in self.moment_chunks], decay),
                         self.layout.segment_views([v for _, v in self.moment_chunks], decay))
                 for decay in (True, False)}
        self.optimizer.step({d: views[d][0] for d in views}, {d: views[d][1] for d in views},
                            {d: views[d][2:] for d in views})
        self.publish()

    def _step_whole_matrices(self) -> None:
        """Muon's step: the chunks in memory at once, or (swap files) a group at a time, streamed through memory in
        pieces of at most PIECE_NUMEL elements (zero/muon.py `step_group_streamed`; synchronous I/O, not
        SwappedStep's pipeline). Offloaded, the gradients come to the CPU, where the states are."""
        if self.swap is None:
            grads = [g.to("cpu") for g in self.grad_chunks] if self.offloaded else self.grad_chunks
            self.optimizer.step_chunks(self.master_chunks, grads, self.moment_chunks)
            self.publish()
            return
        self.optimizer.begin_step()
        for local, g in enumerate(self.groups):  # NOTE: the gradients too come over a piece at a time
            self.optimizer.step_group_streamed(
                local, lambda kind, a, b, local=local: self._read_region(local, kind, a, b),
                lambda kind, a, values, local=local: self._write_region(local, kind, values, a),
                self.grad_chunks[local], lambda a, values, g=g: self.weights.write(g, a, values), offload.PIECE_NUMEL)

    def land(self) -> bool:
        """Finish a delayed update in flight and give the model the master itself (not an extrapolation): what
        evaluation and checkpoints read. False when none was in flight."""
        if self.delayed is None or not self.delayed.land():
            return False
        if self.delayed.extrapolate:
            self.publish()
        return True

    def publish(self) -> None:
        """Copy a separate master into the parameter chunks (after a device step, or a load)."""
        if (self.master is None and self.swap is None) or self.weights_are_master:
            return
        for local, g in enumerate(self.groups):
            self.weights.write(g, 0, self.chunk_states(local)[0])

    def chunk_states(self, local: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(master, exp_avg, exp_avg_sq) of the part's group `local`: views, or (nvme) copies read from the file."""
        if self.int8 is not None:  # fp32 copies, dequantized (a chunk need not start or end on a block)
            start = self.layout.offsets[local]
            first = start - start % BLOCK
            exp_avg, exp_avg_sq = self.int8.read(first, start + self.layout.groups[local].chunk)
            master = self.master_chunks[local] if self.swap is None else self._read_region(local, 0)
            return master, exp_avg[start - first:], exp_avg_sq[start - first:]
        if self.swap is None and self.optimizer.whole_matrices:  # Muon: a copy of the compact exp_avg_sq
            return self.master_chunks[local], self.moment_chunks[local][0], self.optimizer.second_moment_chunk(local)
        if self.swap is None:
            return (self.master_chunks[local], *self.moment_chunks[local])
        return tuple(self._read_region(local, kind) for kind in range(3))

    def _region_offset(self, local: int, kind: int, start: int = 0) -> int:
        """Byte offset of element `start` of group `local`'s chunk in region `kind` of the swap file (0: the master;
        1, 2: the moments)."""
        return self.state_bytes * (kind * self.layout.numel + self.layout.offsets[local] + start)

    def _read_region(self, local: int, kind: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Elements start:stop (default: all) of group `local`'s chunk of region `kind`, read into a new CPU tensor."""
        stop = self.layout.groups[local].chunk if stop is None else stop
        return self.swap.read(torch.empty(stop - start, dtype=self.state_dtype), self._region_offset(local, kind, start))

    def _write_region(self, local: int, kind: int, values: torch.Tensor, start: int = 0) -> None:
        """Group `local`'s chunk of region `kind` of the swap file from element `start`, from `values` (any dtype,
        on the CPU)."""
        self.swap.write(values.to(self.state_dtype).contiguous(), self._region_offset(local, kind, start))

    @property
    def swap_bytes(self) -> int:
        """Bytes of this part's swap files (0 when it has none)."""
        return sum(f.nbytes for f in self.swap_files)

    @property
    def swap_read_bytes(self) -> int:
        """Bytes a step reads from this part's swap files: all of them, and Muon's matrices' master twice (zero/muon.py
        `step_group_streamed`)."""
        if self.swap is None or not self.optimizer.whole_matrices:
            return self.swap_bytes
        matrices = sum(b - a for pieces in self.optimizer.pieces for slot, a, b in pieces if slot.muon)
        return self.swap_bytes + self.state_bytes * matrices

    def store_chunk_states(self, local: int, states: tuple[torch.Tensor, ...]) -> None:
        """Write back what `chunk_states` returned, after filling it (nvme, Muon's compact exp_avg_sq, int8's
        copies; views need nothing)."""
        if self.int8 is not None:
            if self.swap is not None:
                self._write_region(local, 0, states[0])
            self._stage_int8(local, states[1], states[2])
            return
        if self.optimizer.whole_matrices and self.swap is None:  # a swap file holds exp_avg_sq in the chunk layout
            self.optimizer.store_second_moment_chunk(local, states[2])
        if self.swap is not None:
            for kind, tensor in enumerate(states):
                self._write_region(local, kind, tensor)

    def _stage_int8(self, local: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Gather loaded fp32 moments group by group; quantize the whole shard at once after the last group (a block
        quantized twice, once per group it spans, could round twice)."""
        if self.loading is None:
            self.loading = self.int8.read(0, self.int8.numel)
        start = self.layout.offsets[local]
        self.loading[0][start:start + exp_avg.numel()] = exp_avg
        self.loading[1][start:start + exp_avg.numel()] = exp_avg_sq
        if local == len(self.groups) - 1:
            self.int8.write(0, *self.loading)
            self.loading = None

    def moment_tensors(self) -> list[torch.Tensor]:
        """The tensors that hold the moments (int8: codes and block scales)."""
        return self.optimizer.moment_tensors()

    def state_tensors(self) -> list[torch.Tensor]:
        """Moments, the separate master and a delayed or speculating update's buffers, those in memory (a swapped part
        holds no master or moments)."""
        delayed = self.delayed.host_tensors() if self.delayed is not None else []
        if self.overlapped is not None and self.overlapped.speculation is not None:
            delayed += self.overlapped.speculation.host_tensors()
        return self.moment_tensors() + ([self.master] if self.master is not None else []) + delayed


def host_shard_as_master(weights, groups: range, numel: int, dtype: torch.dtype, allowed: bool) -> torch.Tensor | None:
    """offload_param cpu, the optimizer offloaded to CPU memory, states in the weights' dtype (bf16 states under bf16,
    fp32 under fp32): the host's parameter shard over `groups` is already the master, so it is the master (a view:
    2 or 4 bytes per element of CPU memory not held twice). None where a separate master is needed: another tier,
    another dtype, or not `allowed` (a delayed update steps its own copy while the forward reads the weights)."""
    if not (allowed and weights.tier == "cpu" and len(groups) and weights.shard.dtype == dtype):
        return None
    start = weights.chunks[groups.start].storage_offset() - weights.shard.storage_offset()
    return weights.shard[start:start + numel]


def split_groups(groups: list[FlatGroup], offload: bool, ratio: float) -> tuple[range, range]:
    """(groups kept on the device, groups offloaded): the last groups, about `ratio` of the shard's elements.

    Every rank's chunk of a group has the same size, so every rank splits at the same group.
    """
    n = len(groups)
    if not offload:
        return range(n), range(n, n)
    want = ratio * sum(g.chunk for g in groups)
    best, best_gap, host = n - 1, float("inf"), 0
    for first in range(n - 1, -1, -1):  # offload groups[first:], at least one
        host += groups[first].chunk
        if abs(host - want) < best_gap:
            best, best_gap = first, abs(host - want)
    return range(best), range(best, n)
