"""Where a rank's model states live under ZeRO-Infinity, before a run: the bytes per rank on the
GPU, in CPU memory and in swap files (NVMe) for every `zero.offload_optimizer` x `zero.offload_param`
combination, and the swap bytes one optimizer step reads and writes. `toolkit estimate` prints
the table below its stage table; memory_fit.py holds the recipe's row against the machine.

The accounting is the engine's (toolkit/runtime/zero/): the reduced fp32 gradient shard (bf16 under
zero.grad_dtype bf16) stays on the device whatever is offloaded; master weights and moments (12 bytes per offloaded element) go
to CPU memory or a swap file, `offload_ratio` of the shard (under nvme, `nvme_ratio` of that in
swap files and the rest in CPU memory); the parameter shard (stage 3) goes to CPU memory or a swap
file whole. Under offload_optimizer nvme the CPU holds the step's three buffer slots (offload.py:
3 x 12 bytes x a piece) for the swapped states. Activations, gathered
units and transfer staging are working memory, not counted here (estimate.py has activations).

Torch-free, like estimate.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from toolkit.observe.estimate import (BF16_OFFLOAD_K, MUON_SAVED, OFFLOAD_K, PARAM_BYTES, estimate_model_state_bytes,
                                      format_bytes, int8_moment_bytes)
from toolkit.observe.estimate_input import EstimateInput
from toolkit.specs import DELAYED_UPDATES, SPECULATED_SHARE

# NOTE: toolkit/runtime/zero/offload.py's PIECE_NUMEL (this layer may not import runtime; a test
# checks the two agree).
PIECE_NUMEL = 1 << 24
TIERS = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class TierBytes:
    """One rank's model-state bytes per tier, and swap traffic per optimizer step."""

    offload_optimizer: str
    offload_param: str
    gpu: int        # parameters, fp32 gradient shard, device part of the optimizer
    cpu: int        # CPU memory: offloaded optimizer (cpu), parameter shard (cpu), swap buffers (nvme optimizer)
    nvme: int       # swap files
    read: int       # swap bytes read per optimizer step
    written: int    # swap bytes written per optimizer step


def estimate_tiers(num_params: int, *, stage: int, world_size: int, dtype: str, offload_optimizer: str = "none",
                   offload_param: str = "none", offload_ratio: float = 1.0, nvme_ratio: float = 1.0,
                   grad_accum_steps: int = 1, muon_params: int = 0, state_dtype: str = "fp32",
                   offload_update: str = "exact", grad_dtype: str = "fp32", clipped: bool = False) -> TierBytes:
    """Bytes per tier for one rank and one offload combination (offload_param needs stage 3); `muon_params`
    step with Muon (one moment, not two: estimate.py MUON_SAVED); `state_dtype` bf16: the bf16 weights are the master,
    2-byte moments (estimate.py BF16_STATE_K); int8: 8-bit blockwise moments (estimate.py int8_moment_bytes);
    `offload_update` delayed: two gradients (4 bytes) and two weight copies per offloaded element in CPU memory
    (zero/delayed_update.py); overlapped and `clipped` (training.grad_clip > 0): the states of SPECULATED_SHARE of the
    offloaded elements kept to roll back to (zero/speculation.py); `grad_dtype` bf16 (zero.grad_dtype): a 2-byte
    gradient shard on the device."""
    if offload_param != "none" and stage != 3:
        raise ValueError(f"offload_param {offload_param!r} needs stage 3, not {stage}")
    states = estimate_model_state_bytes(num_params, stage=stage, world_size=world_size, dtype=dtype,
                                        offload=offload_optimizer, offload_ratio=offload_ratio,
                                        muon_params=muon_params, state_dtype=state_dtype, grad_dtype=grad_dtype)
    shard = -(-num_params // world_size)
    host = round(offload_ratio * shard) if offload_optimizer != "none" else 0
    params, optim = states.params, states.optim
    master = 2 if state_dtype == "bf16" else 4  # bytes of a master element: the states' dtype (int8: fp32 master)
    if offload_param != "none":
        params = 0
        if shard > host and master == PARAM_BYTES[dtype]:  # NOTE: the device's master is then a separate copy
            optim += master * (shard - host)                # (zero/shard_part.py), not the weights' chunk
    param_shard = PARAM_BYTES[dtype] * shard
    cpu = states.cpu_optim + (param_shard if offload_param == "cpu" else 0)
    delayed = offload_update in DELAYED_UPDATES  # overlapped adds nothing unclipped: exact mode's staging
    if delayed and offload_optimizer != "none":
        cpu += 2 * (4 + PARAM_BYTES[dtype]) * host  # two buffers of each, taken in turn (zero/delayed_update.py)
    if offload_update == "overlapped" and clipped and offload_optimizer == "cpu":  # the rollback arena: master + moments
        cpu += math.ceil(SPECULATED_SHARE * host) * (BF16_OFFLOAD_K if state_dtype == "bf16" else OFFLOAD_K)
    swapped = round(nvme_ratio * host) if offload_optimizer == "nvme" else 0
    if offload_param == "cpu" and not delayed and master == PARAM_BYTES[dtype]:
        cpu -= master * (host - swapped)  # the host's weights are the master of the part in CPU memory (shard_part.py)
    nvme = read = written = 0
    if offload_optimizer == "nvme" and state_dtype == "int8":  # an fp32 master file and the 8-bit moments' file
        in_memory = host - swapped
        cpu += 4 * in_memory + int8_moment_bytes(in_memory) + 3 * 4 * min(PIECE_NUMEL, swapped)
        nvme = read = written = 4 * swapped + int8_moment_bytes(swapped)
    elif offload_optimizer == "nvme":  # master and moments per element: fp32 12 bytes, bf16 states 6
        k = BF16_OFFLOAD_K if state_dtype == "bf16" else OFFLOAD_K
        cpu += k * (host - swapped) + 3 * k * min(PIECE_NUMEL, swapped)
        # Muon: no exp_avg_sq at the matrices in CPU memory (by elements, as estimate.py splits it); the swap file keeps
        # the chunk layout whole, and its streamed step's pieces (zero/muon.py) stay inside the three slots counted
        muon_shard = -(-muon_params // world_size)
        cpu -= round(MUON_SAVED * muon_shard * (host - swapped) / shard) if shard else 0
        nvme = read = written = k * swapped
        read += round(4 * muon_shard * swapped / shard) if shard else 0  # the matrices' master is read twice
    if offload_param == "nvme":
        nvme += param_shard
        read += 2 * grad_accum_steps * param_shard  # every unit is read at its forward and its backward gather
        written += param_shard                      # the step writes the new weights once
    return TierBytes(offload_optimizer, offload_param, params + states.grads + optim, cpu, nvme, read, written)


def input_tiers(inp: EstimateInput, *, num_params: int | None = None, offload_ratio: float | None = None) -> TierBytes:
    """Bytes per tier of the input's own offload combination, for `num_params` (default the model's) and
    `offload_ratio` (default the input's)."""
    return estimate_tiers(inp.num_params if num_params is None else num_params, stage=inp.stage,
                          world_size=inp.world_size, dtype=inp.dtype, offload_optimizer=inp.offload_optimizer,
                          offload_param=inp.offload_param,
                          offload_ratio=inp.offload_ratio if offload_ratio is None else offload_ratio,
                          nvme_ratio=inp.nvme_ratio, grad_accum_steps=inp.grad_accum_steps,
                          muon_params=inp.muon_params, state_dtype=inp.state_dtype,
                          offload_update=inp.offload_update, grad_dtype=inp.grad_dtype, clipped=inp.clipped)


def tier_rows(num_params: int, *, stage: int, world_size: int, dtype: str, offload_ratio: float = 1.0,
              nvme_ratio: float = 1.0, grad_accum_steps: int = 1, state_dtype: str = "fp32",
              grad_dtype: str = "fp32") -> list[TierBytes]:
    """Every offload combination the stage allows (stage 0: none; stages 1-2: the optimizer's three), with the
    given optimizer state and gradient shard dtypes (every tier is built for each)."""
    optimizers = TIERS if stage >= 1 else ("none",)
    params = TIERS if stage == 3 else ("none",)
    return [estimate_tiers(num_params, stage=stage, world_size=world_size, dtype=dtype, offload_optimizer=o,
                           offload_param=p, offload_ratio=offload_ratio, nvme_ratio=nvme_ratio,
                           grad_accum_steps=grad_accum_steps, state_dtype=state_dtype, grad_dtype=grad_dtype)
            for p in params for o in optimizers]


def format_tiers(rows: list[TierBytes], *, stage: int, activations: int, mark: tuple[str, str] | None = None) -> list[str]:
    """The tier table's lines; `mark` (optimizer, param) gets `<- recipe`."""
    # NOTE: rows start with the optimizer tier, never with a digit or '*', so the stage table's
    # readers (tests, scripts) that pick rows by their first cell keep finding exactly those.
    lines = [f"where the model states live at stage {stage} (per rank; activations, {format_bytes(activations)}, "
             f"are on the GPU in every row):"]
    header = ["optimizer", "params", "gpu", "gpu+activ.", "cpu", "nvme", "swap read/step", "swap write/step", ""]
    table = [header]
    for r in rows:
        table.append([r.offload_optimizer, r.offload_param, format_bytes(r.gpu), format_bytes(r.gpu + activations),
                      format_bytes(r.cpu) if r.cpu else "-", format_bytes(r.nvme) if r.nvme else "-",
                      format_bytes(r.read) if r.read else "-", format_bytes(r.written) if r.written else "-",
                      "<- recipe" if mark == (r.offload_optimizer, r.offload_param) else ""])
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    for row in table:
        lines.append("  ".join(row[c].ljust(widths[c]) if c < 2 else row[c].rjust(widths[c])
                               for c in range(len(header) - 1)).rstrip() + ("  " + row[-1] if row[-1] else ""))
    lines.append("swap reads count each unit's parameters twice per micro-step (forward and backward gathers; the "
                 "root unit is read once, so a bound); nvme optimizer rows' cpu is the bound on the step's three buffer slots")
    return lines


def format_tier_estimate(inp: EstimateInput) -> str:
    """The tier table `toolkit estimate` prints below format_estimate's: the input's stage (stage 3 when it is
    0), its row marked."""
    tier_stage = inp.stage or 3
    probe = inp.memory(tier_stage)
    activations = probe.activations.checkpointed if inp.model.activation_checkpointing else probe.activations.full
    # NOTE: the gradient shard's dtype only exists at stages 1-3 (the table's stage 3 stands in for a stage-0 recipe)
    rows = tier_rows(inp.num_params, stage=tier_stage, world_size=inp.world_size, dtype=inp.dtype,
                     offload_ratio=inp.offload_ratio, nvme_ratio=inp.nvme_ratio,
                     grad_accum_steps=inp.grad_accum_steps, state_dtype=inp.state_dtype, grad_dtype=inp.grad_dtype)
    mark = (inp.offload_optimizer, inp.offload_param) if inp.stage == tier_stage else None
    if mark is not None:  # the recipe's row as the recipe holds it: Muon's single moment, its delayed-update buffers
        rows = [input_tiers(inp) if (r.offload_optimizer, r.offload_param) == mark else r for r in rows]
    return "\n".join(format_tiers(rows, stage=tier_stage, activations=activations, mark=mark))
