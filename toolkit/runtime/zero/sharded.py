"""What ZeRO stages 1-3 share: a rank's shard of fp32 master weights, gradients
and AdamW moments laid out by `ShardLayout`, and the optimizer-step half of the
strategy interface (overflow check, unscale, global-norm clipping, AdamW,
publishing the new weights), plus memory accounting and the shard's state.

Subclasses (partition.py for stages 1-2, stage3.py) own the parameters' flat
buffers, the backward hooks and collectives, and fill in:
  `param_chunks[g]`  this rank's chunk of group g's parameters (model dtype)
  `grad_chunks[g]`   this rank's reduced fp32 gradient chunk of group g (on the training
                     device, offload too)
and `after_step()` (stages 1-2 all-gather the new weights; stage 3 need not).

Master weights are the parameter chunks themselves for fp32 training; they are
a separate fp32 buffer for bf16/fp16 models and always for offload, where they
live in CPU memory with the moments and the step runs on the CPU piece by piece
(offload.py, kernels/cpu_adam.cpp). The shard's groups form one to three `ShardPart`s (shard_part.py):
with zero.offload_ratio below 1 the first groups keep their master and moments on
the device (stepped there, asynchronously) and the rest are offloaded; under nvme with
zero.nvme_ratio below 1 the offloaded groups split again, CPU memory then swap files.
"""
from __future__ import annotations

import math

import torch

from toolkit.runtime.precision import has_inf_or_nan
from toolkit.distributed import DistInfo
from toolkit.observe.comm_ledger import expected_step_bytes, wire_bytes
from toolkit.runtime.communicator import Communicator
from toolkit.runtime.strategy import StrategyBase, tensor_bytes
from toolkit.runtime.zero.flat import FlatGroup, ShardLayout
from toolkit.runtime.zero.param_offload import DeviceWeights
from toolkit.runtime.zero.shard_part import ShardPart, optimizer_swap_bytes, split_groups, state_dtype
from toolkit.runtime.zero.swap import SwapDir
from toolkit.observe.disk_fit import check_nvme_path
from toolkit.specs import DELAYED_UPDATES, OptimizerSpec, ZeroSpec

STATE_KINDS = ("param", "exp_avg", "exp_avg_sq")  # what chunk_states returns, named as checkpoints name them


class ShardedStrategy(StrategyBase):
    """Base of stages 1-3: the shard's optimizer step and bookkeeping."""

    stage = 1
    sharded_checkpoint = True  # each rank writes its shard (toolkit/checkpoint/zero_shards.py)

    def __init__(self, zero: ZeroSpec, optimizer: OptimizerSpec, device: torch.device, info: DistInfo,
                 groups: list[FlatGroup], param_dtype: torch.dtype, comm: Communicator, grad_accum_steps: int,
                 grad_clip: float = 0.0):
        self.zero, self.optimizer_spec, self.device, self.info, self.comm = zero, optimizer, device, info, comm
        self.grad_clip = grad_clip  # > 0: an overlapped offload step speculates on the clip coefficient
        self.grad_accum_steps = grad_accum_steps  # the swap reads per step (describe_tiers)
        self.groups = groups
        self.layout = ShardLayout(groups, info.rank)
        self.param_dtype = param_dtype
        self.offload = zero.offload_optimizer != "none"
        self.bf16_states = state_dtype(optimizer) == torch.bfloat16
        # zero.grad_dtype: the reduced gradient shard's dtype (bf16 only under bf16 states: recipe checks)
        self.grad_dtype = torch.bfloat16 if zero.grad_dtype == "bf16" else torch.float32
        self.separate_master = (self.offload or param_dtype not in (torch.float32, state_dtype(optimizer))
                                or zero.offload_param != "none")
        self.param_chunks: list[torch.Tensor] = []
        self.weights = None  # where the parameter chunks live (param_offload.py); DeviceWeights unless stage 3 says
        self.grad_chunks: list[torch.Tensor] = []
        self.parts: list[ShardPart] = []
        self.swap_dir: SwapDir | None = None
        if "nvme" in (zero.offload_optimizer, zero.offload_param):
            self.swap_dir = SwapDir(check_nvme_path(zero.nvme_path, self._swap_bytes_needed()))

    def _swap_bytes_needed(self) -> int:
        """Swap bytes of every rank on this host (they share the disk): 12 per offloaded optimizer element
        under nvme, plus the parameter shard under offload_param nvme."""
        import os

        zero = self.zero
        need = 0
        if zero.offload_optimizer == "nvme":
            need += optimizer_swap_bytes(self.optimizer_spec,
                                         sum(self.groups[g].chunk for g in self._optimizer_tiers()[2]))
        if zero.offload_param == "nvme":
            need += self.layout.numel * torch.empty(0, dtype=self.param_dtype).element_size()
        return need * int(os.environ.get("LOCAL_WORLD_SIZE", self.info.world_size))

    def _optimizer_tiers(self) -> tuple[range, range, range]:
        """(groups whose optimizer stays on the device, in CPU memory, in swap files): offload_ratio of the
        shard leaves the device; under nvme, nvme_ratio of that goes to swap files (the last groups)."""
        zero = self.zero
        kept, offloaded = split_groups(self.groups, self.offload, zero.offload_ratio)
        if zero.offload_optimizer != "nvme":
            return kept, offloaded, range(len(self.groups), len(self.groups))
        # NOTE: nvme_ratio 1 swaps every offloaded group (split_groups' exact fit), none stays in CPU memory
        in_memory, swapped = split_groups([self.groups[g] for g in offloaded], True, zero.nvme_ratio)
        start = offloaded.start
        return kept, range(start, start + len(in_memory)), range(start + swapped.start, offloaded.stop)

    def describe(self) -> str:
        """One line for the start-up table: what is sharded, the master copy, the AdamW that runs."""
        what = {1: "optimizer states", 2: "optimizer states + gradients", 3: "optimizer states + gradients + "
                "parameters"}[self.stage]
        master = ("bf16 master and moments offloaded (bf16 states)" if self.offload and self.bf16_states
                  else "fp32 master separate" if self.separate_master else "bf16 weights are the master (bf16 states)"
                  if self.param_dtype == torch.bfloat16 else "fp32 weights are the master")
        adams = []
        for part in self.parts:
            if part.offloaded and part.int8 is not None:
                where = f"on the CPU: {part.optimizer.mode} (torch ops)"
            elif part.offloaded and part.optimizer.whole_matrices:
                where = (f"on the CPU ({part.optimizer.adamw.mode}) with Muon's momentum there, its Newton-Schulz "
                         f"on {part.optimizer.compute_device}")
            elif part.offloaded:
                from toolkit.ops.cpu_adam import cpu_adam_status

                status = cpu_adam_status()
                where = f"on the CPU: {status.name} {status.state}" + ("" if status.active else f" ({status.reason})")
            else:
                where = part.optimizer.mode
            share = f" for {part.layout.numel / max(1, self.layout.numel):.0%}" if len(self.parts) > 1 else ""
            adams.append(where + share)
        where = [f"{p.layout.numel / max(1, self.layout.numel):.0%} in "
                 f"{'swap files' if p.tier == 'nvme' else 'CPU memory'}" for p in self.parts if p.offloaded]
        return (f"stage {self.stage}: {what} sharded over {self.info.world_size} rank(s) "
                f"({self.layout.numel:,} elements each, {len(self.groups)} {self.group_kind}); {master}; "
                f"AdamW {' + '.join(adams)}"
                + (f"; offload: master, moments and step of {' + '.join(where)}" if self.offload else "")
                + ("; the parameter shard in CPU memory is the offloaded master (zero.offload_param cpu)"
                   if any(p.weights_are_master for p in self.parts) else "")
                + (f"; update delayed one step after {self._delay_after()} exact steps (zero.offload_update "
                   f"{self.zero.offload_update})"
                   if self._delay_after() is not None else "")
                + ("; CPU step started during backward (zero.offload_update overlapped)"
                   if any(p.overlapped is not None for p in self.parts) else ""))

    def describe_tiers(self) -> str:
        """One line for the start-up table: where parameters, gradients, master + moments live (bytes per
        rank, counted from live tensors and swap files) and the swap bytes one optimizer step reads and writes."""
        from toolkit.observe.estimate import format_bytes

        mem = self.memory_bytes()
        param_tier = self.weights.tier if self.weights is not None else "none"
        elem = torch.empty(0, dtype=self.param_dtype).element_size()
        where = {"none": "device", "cpu": "CPU memory", "nvme": "swap file"}
        # NOTE: at stages 1-2 every rank holds the whole parameters (counted from the flat buffers); only
        # stage 3 keeps a shard, on the device or offloaded whole (elem bytes per element of the shard)
        params = mem["mem_params_bytes"] if param_tier == "none" else elem * self.layout.numel
        states = [f"params {where[param_tier]} ({format_bytes(params)})",
                  f"{'bf16' if self.grad_dtype == torch.bfloat16 else 'fp32'} grads device "
                  f"({format_bytes(mem['mem_grads_bytes'])})"]
        for part in self.parts:
            tier = part.tier
            numel = part.layout.numel
            share = f" {numel / max(1, self.layout.numel):.0%}" if len(self.parts) > 1 else ""
            if tier == "cpu":  # the live master and moments: fp32 12 bytes an element, bf16 6, int8 moments 4 + 2.03
                # NOTE: a master that is the parameter shard in CPU memory (offload_param cpu) is counted there
                nbytes = tensor_bytes([*part.moment_tensors(), *([] if part.weights_are_master else [part.master])])
            else:  # a swapped part holds its states in its files
                nbytes = part.swap_bytes if tier == "nvme" else mem["mem_optim_bytes"] + mem["mem_master_bytes"]
            what = "moments (master: the params)" if part.weights_are_master else "master+moments"
            states.append(f"{what}{share} {where[tier]}{'s' if tier == 'nvme' else ''} ({format_bytes(nbytes)})")
        delayed = [t for part in self.parts if part.delayed is not None for t in part.delayed.host_tensors()]
        if delayed:
            states.append(f"delayed-update gradient + weight copies CPU memory ({format_bytes(tensor_bytes(delayed))})")
        arena = [t for part in self.parts if part.overlapped is not None and part.overlapped.speculation is not None
                 for t in part.overlapped.speculation.host_tensors()]
        if arena:
            states.append(f"overlapped-update rollback copies CPU memory ({format_bytes(tensor_bytes(arena))})")
        text = "; ".join(states)
        if self.swap_dir is None:
            return text
        optim = sum(p.swap_bytes for p in self.parts)
        param_bytes = self.layout.numel * elem if param_tier == "nvme" else 0
        # NOTE: parameters are read at every gather (forward and backward: twice per micro-step)
        reads = sum(p.swap_read_bytes for p in self.parts) + 2 * self.grad_accum_steps * param_bytes
        return (text + f"; swap {self.swap_dir.path}: per step reads {format_bytes(reads)}, "
                f"writes {format_bytes(optim + param_bytes)}")

    group_kind = "buckets"

    # -- set-up the subclasses call once their buffers exist ---------------------

    def _init_master(self) -> None:
        """The shard's parts (master copies, moments, AdamW), once param_chunks and grad_chunks exist."""
        kept, in_memory, swapped = self._optimizer_tiers()
        if self.weights is None:
            self.weights = DeviceWeights(self.param_chunks)
        # NOTE: the CPU-memory part steps before the swapped one, so the disk's part comes last in a step
        self.parts = [ShardPart(self.optimizer_spec, groups, self.groups, self.info.rank, self.weights,
                                self.grad_chunks, self.device, offloaded=on_cpu, dtype=self.param_dtype,
                                swap_dir=swap, comm=self.comm, delay_after=self._delay_after(),
                                extrapolate=self.zero.offload_update == "delayed_extrapolated",
                                overlap=self.zero.offload_update == "overlapped", speculate=self.grad_clip > 0)
                      for groups, on_cpu, swap in ((kept, False, None), (in_memory, True, None),
                                                   (swapped, True, self.swap_dir)) if len(groups)]
        self.optimizer = self.parts[0].optimizer
        self._part_of = {g: (part, local) for part in self.parts for local, g in enumerate(part.groups)}
        self._final_round = False  # in the accumulation's last micro-step (_begin_round)
        for part in self.parts[1:]:  # NOTE: one set of param_groups, so the schedule's lr reaches every part
            part.optimizer.param_groups = self.optimizer.param_groups

    def _delay_after(self) -> int | None:
        """zero.offload_update delayed: the applied steps taken exactly first; None: every step exact."""
        return (self.zero.offload_update_warmup if self.zero.offload_update in DELAYED_UPDATES
                else None)

    def complete_pending_update(self) -> None:
        """Land a delayed update in flight (zero/delayed_update.py) and give every rank the new weights; every
        rank calls it at the same point (evaluation, checkpoints, the end of training)."""
        landed = [part.land() for part in self.parts]  # NOTE: a list, not any(): every part lands
        if any(landed):
            self.after_step()

    # -- reduced gradients: accepted in launch order, as soon as each completes ---------

    def _begin_round(self, boundary: bool) -> None:
        """Before backward (the subclasses' begin_micro_step calls it): in the accumulation's last micro-step, an
        overlapped update (zero.offload_update overlapped) starts its thread, which steps each group once `_drain`
        accepts it."""
        self._final_round = boundary
        if boundary:
            for part in self.parts:
                part.begin_final_round()

    def _queue_reduced(self, g: int, work, out: torch.Tensor) -> None:
        """A reduce-scatter in flight (work None: one process, `out` is the whole bucket); take what is done."""
        self._pending.append((g, work, out))
        self._drain(block=False)

    def _drain(self, block: bool) -> None:
        # NOTE: taking finished buckets during backward streams them into the shard (device to host
        # under offload) while later buckets still compute, and frees their staging buffers early.
        while self._pending:
            g, work, out = self._pending[0]
            if work is not None:
                if not block and not work.is_completed():
                    return
                work.wait()
            else:
                out = out[:self.groups[g].chunk]
            self._pending.pop(0)
            self._accept_reduced(g, out)
            part, local = self._part_of[g]
            if self._final_round:  # the group's gradient is final
                part.group_final(local)

    def _accept_reduced(self, g: int, out: torch.Tensor) -> None:
        """Add a reduced chunk into this rank's gradient shard (stage 1 overrides: it copies)."""
        self.grad_chunks[g].add_(out.to(self.grad_chunks[g].device, self.grad_dtype))

    # -- the step ----------------------------------------------------------------

    def grads_overflow(self) -> bool:
        """True on every rank when any rank's gradient shard holds an inf or NaN."""
        return self.comm.any_true(has_inf_or_nan(self.grad_chunks))

    def scale_grads(self, factor: float) -> None:
        """Multiply the gradient shard by `factor` (unscaling after fp16 loss scaling)."""
        for part in self.parts:
            part.scaling_grads(factor)
        torch._foreach_mul_(self.grad_chunks, factor)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm over every rank's shard; scale the shard down to max_norm (torch's formula)."""
        # NOTE: one fused norm per chunk, summed on the shard's device: a single host sync per step.
        # NOTE: in fp32 also for a bf16 shard (zero.grad_dtype), so the clip coefficient is not rounded to bf16
        norms = torch._foreach_norm([c for c in self.grad_chunks if c.numel()], 2.0,
                                    dtype=torch.float32 if self.grad_dtype != torch.float32 else None)
        local = float(torch.stack(norms).double().square().sum()) if norms else 0.0
        total = math.sqrt(self.comm.sum_floats([local])[0])
        clipping = max_norm > 0 and math.isfinite(max_norm)
        # torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped to 1
        coef = min(max_norm / (total + 1e-6), 1.0) if clipping else 1.0
        # NOTE: an overlapped step speculating on the coefficient (speculation.py) reads its part's chunks on its
        # thread: their clip is ordered against its fetches there
        speculating = [p for p in self.parts if p.overlapped is not None and p.overlapped.speculation is not None
                       and p.overlapped.in_flight]
        for part in speculating:
            part.overlapped.clip(coef, [self.grad_chunks[g] for g in part.groups])
        skip = {g for part in speculating for g in part.groups}
        scaled = [c for g, c in enumerate(self.grad_chunks) if g not in skip]
        if clipping and scaled:
            for part in self.parts:
                part.scaling_grads(coef)
            torch._foreach_mul_(scaled, coef)
        return total

    def optimizer_step(self) -> None:
        """AdamW on this rank's shard, then every rank gets the new weights."""
        for part in self.parts:  # the device's part first: it runs while the CPU steps the offloaded one
            part.step()
        self.after_step()

    def after_step(self) -> None:
        """Stages 1-2: all-gather the updated chunks (stage 3 gathers lazily)."""

    def zero_grad(self) -> None:
        """Clear the accumulated gradients for the next optimizer step."""
        for chunk in self.grad_chunks:
            chunk.zero_()

    def expected_bytes_per_step(self, grad_accum_steps: int) -> dict[str, int]:
        """The formula's bytes per rank per step for this flat layout (toolkit/observe/comm_ledger.py expected_step_bytes)."""
        numel = sum(g.padded_numel for g in self.groups)
        element = torch.empty((), dtype=self.param_dtype).element_size()
        kinds = expected_step_bytes(self.stage, numel, self.info.world_size, element, grad_accum_steps,
                                    root_numel=self._gathered_all_along())
        # Muon (zero/muon.py): each group holding a matrix all-gathers its updates once per step, in the
        # Newton-Schulz dtype (muon_ns_dtype: bf16, 2 bytes; fp32, 4)
        muon = sum(g.padded_numel for g in self.groups if any(s.muon for s in g.slots))
        if muon and self.info.world_size > 1:
            ns_bytes = 4 if self.optimizer_spec.muon_ns_dtype == "fp32" else 2
            kinds["all_gather"] = kinds.get("all_gather", 0) + wire_bytes("all_gather", ns_bytes * muon,
                                                                          self.info.world_size)
        return kinds

    def _gathered_all_along(self) -> int:
        """Elements gathered once per micro step rather than per unit (stage 3's root unit; none before)."""
        return 0

    # -- checkpoint state (toolkit/checkpoint/zero_shards.py) --------------------------------------

    def _owned_slices(self, g: int):
        """(name, start, stop, slice of the chunk) for each piece of a parameter in this rank's chunk of group g."""
        group = self.groups[g]
        lo, hi = group.chunk_range(self.info.rank)
        for slot in group.slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                yield slot.name, a - slot.offset, b - slot.offset, slice(a - lo, b - lo)

    def owned_pieces(self) -> list[tuple[str, int, int, dict[str, torch.Tensor]]]:
        """(name, start, stop, {param, exp_avg, exp_avg_sq: view}) for each parameter piece this rank owns
        (views of copies under offload_optimizer nvme)."""
        if any(part.delayed is not None and part.delayed.in_flight for part in self.parts):
            raise RuntimeError("owned_pieces: a delayed update is in flight; call complete_pending_update() first")
        pieces = []
        for part in self.parts:
            for local, g in enumerate(part.groups):
                states = part.chunk_states(local)
                for name, start, stop, sl in self._owned_slices(g):
                    pieces.append((name, start, stop, {kind: s[sl] for kind, s in zip(STATE_KINDS, states)}))
        return pieces

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's shape by name."""
        return {slot.name: slot.shape for group in self.groups for slot in group.slots}

    def optimizer_steps(self) -> int:
        """AdamW steps applied so far."""
        return self.optimizer.step_count

    @torch.no_grad()
    def load_pieces(self, reader) -> None:
        """Fill this rank's master weights and moments from any checkpoint reader, then publish the weights."""
        for part in self.parts:
            for local, g in enumerate(part.groups):
                states = part.chunk_states(local)
                for name, start, stop, sl in self._owned_slices(g):
                    for kind, state in zip(STATE_KINDS, states):
                        state[sl].copy_(reader.read(kind, name, start, stop))
                part.store_chunk_states(local, states)
        for part in self.parts:
            part.optimizer.step_count = reader.step
            part.publish()
        self.after_step()

    # -- accounting -------------------------------------------------------------------

    def master_chunks(self) -> list[torch.Tensor]:
        """fp32 master weights per group (this rank's chunk)."""
        return [chunk for part in self.parts for chunk in part.master_chunks]

    def memory_bytes(self) -> dict:
        """Model-state bytes this rank holds now, counted from live tensors.

        mem_*: on the training device (master: the fp32 copy, when separate from the parameters);
        mem_offload_bytes: what offload keeps in CPU memory (master, moments), counted apart even when
        the training device is the CPU itself. Like stage 2's reduce buckets, the step's staging (two
        pieces, at most 2 x 16M x 6 bytes pinned) is a working buffer, not a model state, and not counted.
        """
        kept = [part for part in self.parts if not part.offloaded]
        return {"mem_params_bytes": tensor_bytes(self.param_tensors()),
                "mem_grads_bytes": tensor_bytes(self.grad_tensors()),
                "mem_optim_bytes": tensor_bytes(t for p in kept for t in p.moment_tensors()),
                "mem_master_bytes": tensor_bytes(p.master for p in kept if p.master is not None),
                "mem_offload_bytes": tensor_bytes([*(t for p in self.parts if p.offloaded for t in p.state_tensors()),
                                                   *self.weights.host_tensors()])}

    def param_tensors(self) -> list[torch.Tensor]:
        """Live parameter buffers (subclasses)."""
        raise NotImplementedError

    def grad_tensors(self) -> list[torch.Tensor]:
        """Live gradient buffers on the training device (subclasses)."""
        raise NotImplementedError
