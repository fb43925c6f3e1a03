"""AdamW (or Adam with L2 decay, optimizer.type adam) over a rank's shard: fp32 master weights, moments and gradients held as
contiguous segments (see flat.py), stepped with the same maths as
torch.optim.AdamW, decoupled weight decay per group (decayed matrices; biases,
norms and 1-D parameters not, as toolkit.runtime.optim.param_groups decides).

Three ways to run the step, one result (and a fourth for optimizer.state_dtype bf16: bf16 moments, the bf16
weights' chunk as master, torch's maths in fp32 and stochastic rounding, toolkit/runtime/low_precision_adamw.py;
and a fifth for int8: the shard's moments as one BlockwiseMoments run, 8-bit codes with an absmax per 256 elements
of the shard, stepped a window at a time by `step_segments`, toolkit/runtime/int8_moments.py):
  reference  torch's own per-tensor ops in torch's order (CPU, no offload): bit-identical
             to torch.optim.AdamW's single-tensor path, so ZeRO stages match stage 0 exactly
  fused      torch._fused_adamw_ on CUDA (what stage 0 uses there)
  cpu_adam   the toolkit's kernel (kernels/cpu_adam.cpp) for ZeRO-Offload, falling back
             to torch's fused CPU AdamW when the kernel cannot be built

`param_groups` carries `lr` so toolkit.runtime.optim.Schedule drives it like a torch optimizer.
"""
from __future__ import annotations

import torch

from toolkit.runtime.int8_moments import BLOCK, BlockwiseMoments, Piece, blockwise_adam_step
from toolkit.runtime.low_precision_adamw import (adam_reference_update_, bf16_adam_update_, hashed_bf16_adam_update_,
                                                 rounding_generator)
from toolkit.specs import OptimizerSpec


class ShardedAdamW:
    """AdamW state for one rank's shard: exp_avg and exp_avg_sq as contiguous fp32 buffers."""

    whole_matrices = False  # steps decay segments (ShardedMuon, zero/muon.py, needs whole matrices)

    def __init__(self, spec: OptimizerSpec, numel: int, device: torch.device, *, offload: bool):
        self.spec = spec
        self.l2 = spec.type == "adam"  # torch Adam: weight decay added to the gradient, not decoupled
        self.eps = spec.eps
        # optimizer.state_dtype bf16: bf16 moments (and a bf16 master: shard_part.py), stochastic rounding
        state_dtype = torch.bfloat16 if spec.state_dtype == "bf16" else torch.float32
        # optimizer.state_dtype int8: the moments are 8-bit codes and block scales (`step_segments` steps them)
        self.moments = BlockwiseMoments.zeros(numel, device) if spec.state_dtype == "int8" else None
        self.exp_avg, self.exp_avg_sq = ((self.moments.exp_avg, self.moments.exp_avg_sq) if self.moments else
                                         (torch.zeros(numel, dtype=state_dtype, device=device),
                                          torch.zeros(numel, dtype=state_dtype, device=device)))
        self.seed = torch.initial_seed()  # the run's training.seed: the rounding bits (low_precision_adamw.py)
        self.step_count = 0  # applied steps (skipped fp16 steps excluded), as torch's per-parameter `step`
        # NOTE: betas live in the groups as in torch, so a OneCycle schedule can cycle them.
        betas = tuple(spec.betas)
        self.param_groups = [{"lr": spec.lr, "weight_decay": spec.weight_decay, "decay": True, "betas": betas},
                             {"lr": spec.lr, "weight_decay": 0.0, "decay": False, "betas": betas}]
        self.kernel = None
        self._scratch = None  # fp32, a piece long: delayed_extrapolated's old weights where the kernel cannot extrapolate
        self._window = None  # int8 offloaded: (start, exp_avg, exp_avg_sq), fp32 moments of the blocks open this step
        if offload and self.moments is None:  # the kernel steps fp32 and bf16 states; int8 moments step in torch ops
            from toolkit.ops.cpu_adam import load_cpu_adam

            self.kernel = load_cpu_adam()
        self.mode = "cpu_adam" if self.kernel is not None else "bf16" if state_dtype == torch.bfloat16 else (
            "int8 blockwise moments" if self.moments else "fused" if device.type == "cuda" or offload else "reference")

    @property
    def betas(self) -> tuple[float, float]:
        """Adam's (beta1, beta2) for this step (the schedule may change them)."""
        return tuple(self.param_groups[0]["betas"])

    def begin_step(self) -> None:
        """Count one applied step (the bias corrections use it) and fix its settings; then `update` each piece."""
        self.step_count += 1
        # NOTE: frozen here, so a delayed update (zero/delayed_update.py) that runs its pieces on a thread after
        # the schedule has moved on still uses this step's lr and betas
        self.step_settings = [(float(g["lr"]), float(g["weight_decay"])) for g in self.param_groups]
        self.step_betas = self.betas

    def step(self, params: dict[bool, list[torch.Tensor]], grads: dict[bool, list[torch.Tensor]],
             moments: dict[bool, tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
        """One AdamW step on the device's shard (offload steps piece by piece instead: toolkit/runtime/zero/offload.py);
        each dict maps decay (True/False) to matching lists of fp32 segment views."""
        self.begin_step()
        self.apply(params, grads, moments)

    def apply(self, params: dict[bool, list[torch.Tensor]], grads: dict[bool, list[torch.Tensor]],
              moments: dict[bool, tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
        """`step` after its `begin_step`: Muon (zero/muon.py) applies it to its AdamW pieces, in swap files a piece at a
        time."""
        for group in self.param_groups:
            decay = group["decay"]
            ps, gs = params[decay], grads[decay]
            ms, vs = moments[decay]
            if not ps:
                continue
            lr, wd = float(group["lr"]), float(group["weight_decay"])
            if self.mode == "bf16":
                self._bf16(ps, gs, ms, vs, lr, wd)
            elif self.mode == "reference":
                self._reference(ps, gs, ms, vs, lr, wd)
            else:
                self._fused(ps, gs, ms, vs, lr, wd)

    def step_segments(self, layout, masters: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """One step of the int8 moments (state_dtype int8): each of `layout`'s segments (flat.ShardLayout) over the
        fp32 `masters[g]` and `grads[g]` chunks, its moments at the segment's place in the shard."""
        self.begin_step()
        settings = {decay: (float(group["lr"]), float(group["weight_decay"]))
                    for decay, group in zip((True, False), self.param_groups)}
        pieces = [Piece(s.shard_offset, masters[s.group][s.start:s.stop], grads[s.group][s.start:s.stop],
                        *settings[s.decay]) for s in layout.segments]
        blockwise_adam_step(self.moments, pieces, step=self.step_count, betas=self.betas, eps=self.eps, l2=self.l2)

    def update(self, decay: bool, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor, offset: int = 0, extrapolate: bool = False, grad_scales: tuple = ()) -> None:
        """This step's AdamW on one contiguous piece (after `begin_step`) starting at element `offset` of the shard;
        `out` gets the new weights in its dtype (`extrapolate`, delayed_extrapolated: new + (new - old)).
        `grad_scales`: step on the fp32 gradient `g` multiplied by each in turn (a delayed update's copy taken before
        a clip or an unscale), the floats torch's `g.mul_(scale)` gives: the kernel in its pass (`g` unchanged),
        else torch in place."""
        lr, wd = self.step_settings[0 if decay else 1]
        beta1, beta2 = self.step_betas
        # NOTE: the kernel writes the bf16 copy (or the extrapolated one) in its pass over memory, fp32 or bf16 states
        kernel_writes_out = self.mode == "cpu_adam" and out.dtype == torch.bfloat16 and out is not p
        # the kernel's own pass multiplies: not before the L2 term nor through the extrapolation's torch ops below
        kernel_scales = self.kernel is not None and not self.l2 and (kernel_writes_out or not extrapolate)
        if grad_scales and not kernel_scales:
            for scale in grad_scales:
                g.mul_(scale)
            grad_scales = ()
        if extrapolate and not kernel_writes_out:  # torch ops: three passes through a scratch kept across steps
            if self._scratch is None or self._scratch.numel() < p.numel():
                self._scratch = torch.empty(p.numel(), dtype=torch.float32, device=p.device)
            delta = self._scratch[:p.numel()]
            delta.copy_(p)  # the weights before the update
            self.update(decay, p, g, m, v, out, offset)
            torch.sub(p, delta, out=delta)
            torch.add(p, delta, out=out)
            return
        if self.l2 and wd != 0:  # the staged gradient is this step's own copy: L2 decay into it, then plain Adam
            g.add_(p, alpha=wd)
            wd = 0.0
        if self.moments is not None:  # int8 moments offloaded: the piece's part of the blocks open this step
            exp_avg, exp_avg_sq = self._open_window(offset, offset + p.numel())
            adam_reference_update_(p, g, exp_avg, exp_avg_sq, step=self.step_count, lr=lr, wd=wd,
                                   betas=(beta1, beta2), eps=self.eps, l2=False)
        elif p.dtype == torch.bfloat16:  # offloaded bf16 states: the rounding bits keyed by the element's index
            self._update_bf16(p, g, m, v, lr, wd, (beta1, beta2), offset, out if kernel_writes_out else None,
                              extrapolate, grad_scales)
        elif self.mode == "cpu_adam":
            self.kernel.adamw_step(p, g, m, v, self.step_count, lr, beta1, beta2, self.eps, wd,
                                   out if kernel_writes_out else None, False, extrapolate, list(grad_scales))
        else:
            self._fused([p], [g], [m], [v], lr, wd, (beta1, beta2))
        if not kernel_writes_out:
            out.copy_(p)

    def _open_window(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 moments of elements [start, stop) for an offloaded int8 step, whose pieces come in shard order: the
        blocks before `start`'s are done and quantized back; the blocks up to `stop` are read once and stay open
        (the next piece may share the last one), so each block is quantized once a step, as on the device."""
        first = start // BLOCK * BLOCK
        last = min(-(-stop // BLOCK) * BLOCK, self.moments.numel)
        if self._window is not None and first >= self._window[0] + self._window[1].numel():
            self.end_pieces()
        if self._window is not None:
            open_at, exp_avg, exp_avg_sq = self._window
            assert first >= open_at, (first, open_at)  # pieces in shard order
            if first > open_at:  # blocks no later piece touches
                self.moments.write(open_at, exp_avg[:first - open_at], exp_avg_sq[:first - open_at])
                exp_avg, exp_avg_sq = exp_avg[first - open_at:], exp_avg_sq[first - open_at:]
            opened = first + exp_avg.numel()
            if last > opened:
                more = self.moments.read(opened, last)
                exp_avg, exp_avg_sq = torch.cat([exp_avg, more[0]]), torch.cat([exp_avg_sq, more[1]])
        else:
            exp_avg, exp_avg_sq = self.moments.read(first, last)
        self._window = (first, exp_avg, exp_avg_sq)
        return exp_avg[start - first:stop - first], exp_avg_sq[start - first:stop - first]

    def end_pieces(self) -> None:
        """After the last `update` of a step: quantize the int8 moments' open blocks back (else nothing)."""
        if self._window is not None:
            self.moments.write(*self._window)
            self._window = None

    def _update_bf16(self, p, g, m, v, lr: float, wd: float, betas: tuple[float, float], offset: int,
                     out: torch.Tensor | None = None, extrapolate: bool = False, grad_scales: tuple = ()) -> None:
        if self.kernel is not None:
            self.kernel.adamw_step_bf16(p, g, m, v, self.step_count, lr, betas[0], betas[1], self.eps, wd, self.seed,
                                        offset, out, extrapolate, list(grad_scales))
        else:  # the kernel's maths and rounding bits in torch ops
            hashed_bf16_adam_update_(p, g, m, v, seed=self.seed, offset=offset, step=self.step_count, lr=lr, wd=wd,
                                     betas=betas, eps=self.eps, l2=False)

    def _fused(self, ps, gs, ms, vs, lr: float, wd: float, betas: tuple[float, float] | None = None) -> None:
        steps = [torch.tensor(float(self.step_count), device=p.device) for p in ps]
        fused_step = torch._fused_adam_ if self.l2 else torch._fused_adamw_
        beta1, beta2 = betas or self.betas
        fused_step(ps, gs, ms, vs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
                            weight_decay=wd, eps=self.eps, amsgrad=False, maximize=False)

    def _bf16(self, ps, gs, ms, vs, lr: float, wd: float) -> None:
        generator = rounding_generator(self.seed, self.step_count, ps[0].device)
        for p, g, m, v in zip(ps, gs, ms, vs):
            bf16_adam_update_(p, g, m, v, generator, step=self.step_count, lr=lr, wd=wd, betas=self.betas,
                              eps=self.eps, l2=self.l2)

    def _reference(self, ps, gs, ms, vs, lr: float, wd: float) -> None:
        for p, g, m, v in zip(ps, gs, ms, vs):
            adam_reference_update_(p, g, m, v, step=self.step_count, lr=lr, wd=wd, betas=self.betas, eps=self.eps,
                                   l2=self.l2)

    def state_dict(self) -> dict:
        """Step count and the settings in force (moments travel with the shard: toolkit/checkpoint/zero_shards.py)."""
        return {"step": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        """Restore the step count; the moments are loaded into exp_avg / exp_avg_sq by the caller."""
        self.step_count = int(state["step"])

    def memory_bytes(self) -> int:
        """Bytes of the two moment buffers (int8: their codes and block scales)."""
        return sum(t.numel() * t.element_size() for t in self.moment_tensors())

    def moment_tensors(self) -> list[torch.Tensor]:
        """The tensors that hold the two moments."""
        return self.moments.tensors() if self.moments else [self.exp_avg, self.exp_avg_sq]

