"""The dry run: one rank of an N-rank data-parallel job, built in this process on torch's fake
process group, trains a few steps, and its measured model-state bytes and bytes on the wire are
held against the estimate (toolkit/observe/estimate.py, tiers.py) and the ZeRO traffic formulas
(toolkit/observe/comm_ledger.py). `toolkit estimate RECIPE --world-size N --dry-run` prints its report.

The fake process group's collectives return at once with shape-correct outputs and no data from
other ranks: the engine runs its real code paths (buckets, shards, hooks, the counted collectives),
but the losses and weights are meaningless. What this proves and what it does not:
docs/zero-and-offload.md, "The dry run".

NOTE: the engine builds the whole model on this rank before it shards it, so the dry run needs
the full model to fit once in host (or GPU) memory, whatever N is.
What does not live here: the engine (toolkit/runtime/), the formulas (toolkit/observe/).
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from toolkit.errors import UserError
from toolkit.observe.comm_ledger import KINDS, format_wire_bytes, wire_bytes
from toolkit.observe.estimate import format_bytes
from toolkit.observe.estimate_input import EstimateInput
from toolkit.observe.peak import predict_peak
from toolkit.observe.tiers import input_tiers
from toolkit.specs import Recipe

STATE_ROWS = ("params", "grads", "optim", "host")  # optim: master weights + moments on the device
# The few floats a step all-reduces besides the model states: the loss and the gradient norm (8 bytes
# each, float64) and fp16's overflow flag (4): a bound, in bytes of buffer.
SCALAR_BUFFER_BYTES = 8 + 8 + 4
# NOTE: the calibrated peak (toolkit/observe/peak.py) is fitted on one-rank runs (at N = 8 on the H200 it
# held 1.04x), so a peak outside the tolerance is flagged, not enforced.
PEAK_TOLERANCE = 0.10


@dataclass(frozen=True)
class DryRunReport:
    """What one rank of an N-rank job held and sent, beside what the estimate and formulas say."""

    label: str
    world_size: int
    rank: int
    stage: int
    dtype: str
    steps: int
    device: str
    num_params: int        # the engine's model
    padded_numel: int      # the same, padded as the engine lays it out (Ψ of the formulas)
    groups: int            # flat groups (buckets or units) each padded to a multiple of N
    measured: dict         # STATE_ROWS -> bytes, counted from this rank's live tensors
    estimated: dict        # STATE_ROWS -> bytes, the estimate at the model's parameter count
    estimated_padded: dict  # STATE_ROWS -> bytes, the estimate at the engine's layout (_engine_layout_estimate)
    step_counter_bytes: int  # stage 0: torch AdamW's step counters, in estimated_padded's optim
    comm_steps: list       # per step that updated the weights: kind -> bytes this rank sent
    comm_expected: dict    # kind -> bytes per step, the formula at the engine's Ψ
    skipped_steps: int
    peak: int | None       # CUDA max allocated over the steps; None on the CPU
    peak_estimate: int
    build_s: float
    steps_s: float

    @property
    def comm_measured(self) -> dict:
        """The last step's bytes by kind, the few scalar all-reduces (up to their bound) taken out."""
        last = dict(self.comm_steps[-1]) if self.comm_steps else {}
        if "all_reduce" in last:
            last["all_reduce"] -= min(max(0, self.scalar_bytes(last)), self.scalar_limit)
        return {k: v for k, v in last.items() if v}

    @property
    def scalar_limit(self) -> int:
        """Bytes on the wire of the scalar all-reduces at most (SCALAR_BUFFER_BYTES)."""
        return wire_bytes("all_reduce", SCALAR_BUFFER_BYTES, self.world_size)

    def scalar_bytes(self, step: dict) -> int:
        """Bytes of a step's all_reduce beyond the formula's (the loss, grad norm, overflow flag)."""
        return step.get("all_reduce", 0) - self.comm_expected.get("all_reduce", 0)

    def mismatches(self) -> list[str]:
        """One line per claim the measurement breaks (empty: every check holds)."""
        bad = []
        for row in STATE_ROWS:
            got, want = self.measured[row], self.estimated_padded[row]
            if got != want:
                bad.append(f"model states {row}: measured {got:,} B, the estimate at the engine's layout "
                           f"says {want:,} B")
        bound = self.groups * (self.world_size - 1)  # elements of padding the engine may add
        if self.padded_numel - self.num_params > bound:
            bad.append(f"padding: {self.padded_numel - self.num_params:,} elements, more than {self.groups} "
                       f"group(s) x (N-1) = {bound:,}")
        scalar_limit = self.scalar_limit
        if not self.comm_steps:
            bad.append(f"comm: every one of the {self.steps} step(s) was skipped; nothing to check (more --steps)")
        for i, step in enumerate(self.comm_steps, 1):
            beyond = {k: v for k, v in step.items() if k != "all_reduce" and v}
            want = {k: v for k, v in self.comm_expected.items() if k != "all_reduce"}
            if beyond != want or not 0 <= self.scalar_bytes(step) <= scalar_limit:
                bad.append(f"comm step {i}: sent {step}, the formula says {self.comm_expected} "
                           f"(+ at most {scalar_limit} B of scalar all-reduces)")
        if self.peak is not None and abs(self.peak / max(1, self.peak_estimate) - 1) > PEAK_TOLERANCE:
            bad.append(f"peak: measured {format_bytes(self.peak)}, estimated {format_bytes(self.peak_estimate)} "
                       f"(beyond ±{PEAK_TOLERANCE:.0%}; the memory model's calibration, not the dry run's check)")
        return bad

    def format(self) -> str:
        """The report `toolkit estimate --dry-run` prints: measured, estimate and ratio per row."""
        lines = [f"dry run: rank {self.rank} of {self.world_size} on torch's fake process group (collectives are "
                 f"no-ops: losses meaningless), {self.label}, zero stage {self.stage}, {self.dtype}, {self.device}; "
                 f"built in {self.build_s:.1f} s, {self.steps} step(s) in {self.steps_s:.1f} s",
                 f"parameters {self.num_params:,}; the engine's layout {self.padded_numel:,} " +
                 (f"({self.groups} group(s) padded to a multiple of {self.world_size})" if self.groups
                  else f"(stage 0: whole parameters, unpadded; torch AdamW's step counters "
                       f"{self.step_counter_bytes} B)")]
        table = [["", "measured", "estimate", "ratio", "exact at the engine's layout"]]
        names = {"params": "params", "grads": "grads", "optim": "master+moments", "host": "host (offload)"}
        for row in STATE_ROWS:
            got, est, pad = self.measured[row], self.estimated[row], self.estimated_padded[row]
            if row == "host" and not (got or est):
                continue
            table.append([names[row], format_bytes(got), format_bytes(est), _ratio(got, est),
                          "yes" if got == pad else f"NO ({format_bytes(pad)})"])
        total_got, total_est = sum(self.measured.values()), sum(self.estimated.values())
        table.append(["model states", format_bytes(total_got), format_bytes(total_est), _ratio(total_got, total_est),
                      "yes" if total_got == sum(self.estimated_padded.values()) else "NO"])
        measured = self.comm_measured
        for kind in KINDS:
            got, want = measured.get(kind, 0), self.comm_expected.get(kind, 0)
            if got or want:
                table.append([f"{kind.replace('_', '-')}/step", format_wire_bytes(got), format_wire_bytes(want),
                              _ratio(got, want), "yes" if got == want else "NO"])
        if self.comm_steps:
            table.append(["scalars/step", format_wire_bytes(self.scalar_bytes(self.comm_steps[-1])), "-", "-",
                          "loss, grad norm, overflow flag"])
        if self.peak is not None:
            table.append(["peak allocated", format_bytes(self.peak), format_bytes(self.peak_estimate),
                          _ratio(self.peak, self.peak_estimate), f"calibration ±{PEAK_TOLERANCE:.0%}"])
        widths = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
        for r in table:
            lines.append("  ".join(r[c].ljust(widths[c]) if c in (0, 4) else r[c].rjust(widths[c])
                                   for c in range(len(r))).rstrip())
        lines.append("estimate: toolkit estimate's model-state formulas at the model's parameter count; 'exact': "
                     "the same formulas at the engine's layout (padded element count, offloaded share in whole "
                     "groups, stage 0's AdamW step counters), which the measurement must equal; comm: the ZeRO "
                     "traffic formulas (docs/communication.md) at that count, per step")
        if self.skipped_steps:
            lines.append(f"note: {self.skipped_steps} step(s) skipped by the fp16 loss scaler (meaningless gradients); "
                         "their traffic is left out of the comm check")
        if self.peak is None:
            lines.append("peak: not measured on the CPU (one process's resident set is mostly the runtime); "
                         "the model-state bytes are the claim")
        return "\n".join(lines)


def _ratio(got: int, want: int) -> str:
    return f"{got / want:.4f}" if want else ("-" if not got else "inf")


def check_dry_run(recipe: Recipe, rank: int, steps: int) -> None:
    """A one-line UserError for what the dry run cannot do with this recipe and these arguments."""
    world = recipe.batch.world_size
    if world < 2:
        raise UserError(f"--dry-run: --world-size {world}: the dry run builds one rank of a job with several; "
                        "give --world-size 2 or more (one rank needs no dry run: `toolkit run` it)")
    if not 0 <= rank < world:
        raise UserError(f"--rank {rank}: not a rank of a {world}-rank job (0 to {world - 1})")
    if steps < 1:
        raise UserError(f"--steps {steps}: the dry run needs at least 1 step")
    if recipe.parallel.active:
        raise UserError("--dry-run: recipe.parallel (tensor/pipeline): not supported yet (DTensor and pipelining "
                        "issue their own collectives); set parallel.tensor and parallel.pipeline to 1")
    if recipe.optimizer.type == "onebit_adam":
        raise UserError("--dry-run: optimizer.type 'onebit_adam': not supported (its traffic formula holds only "
                        "after its freeze step); the dry run checks 'adamw' and 'adam'")
    if "nvme" in (recipe.zero.offload_optimizer, recipe.zero.offload_param):
        raise UserError("--dry-run: zero.offload_optimizer/offload_param nvme: not supported (the dry run writes "
                        "no swap files); use cpu or none")
    if dist.is_available() and dist.is_initialized():
        raise UserError("--dry-run: this process already belongs to a process group; run the dry run on its own")


@contextmanager
def fake_process_group(rank: int, world_size: int):
    """This process as rank `rank` of `world_size` on torch's fake backend, for the duration of the block."""
    # NOTE: importing the module registers the "fake" backend (torch >= 2.1; 2.11 and 2.13 alike).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    hook = sys.excepthook  # NOTE: init_process_group wraps it with a "[rankR]:" prefix and never unwraps it
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def _estimated_states(inp: EstimateInput, numel: int, offload_ratio: float) -> dict:
    """STATE_ROWS from the estimator for `numel` parameters (estimate.py per kind, tiers.py for offload)."""
    states = inp.model_states(numel, offload_ratio)
    tiers = input_tiers(inp, num_params=numel, offload_ratio=offload_ratio)
    params = 0 if inp.offload_param != "none" else states.params
    return {"params": params, "grads": states.grads, "optim": tiers.gpu - params - states.grads, "host": tiers.cpu}


def _engine_layout_estimate(inp: EstimateInput, padded: int, share: float, step_counters: int) -> dict:
    """The estimate at the engine's layout: its padded element count, its offloaded share, stage 0's
    step counters; what the measured bytes must equal exactly."""
    states = _estimated_states(inp, padded, share)
    return {**states, "optim": states["optim"] + step_counters}


def _measured_states(engine) -> dict:
    """STATE_ROWS counted from this rank's live tensors (the strategy's own counters)."""
    m = engine.strategy.memory_bytes()
    return {"params": m["mem_params_bytes"], "grads": m["mem_grads_bytes"],
            "optim": m["mem_optim_bytes"] + m["mem_master_bytes"], "host": m["mem_offload_bytes"]}


def _offloaded_share(strategy, recipe: Recipe) -> float:
    """The share of the optimizer shard the engine put in CPU memory (offload_ratio rounded to whole groups)."""
    if not strategy.offload:
        return recipe.zero.offload_ratio
    return sum(p.layout.numel for p in strategy.parts if p.offloaded) / max(1, strategy.layout.numel)


def _step_counter_bytes(strategy) -> int:
    """Stage 0: torch AdamW's per-tensor `step` counters (the estimate counts moments only)."""
    if strategy.stage != 0:
        return 0
    return sum(t.numel() * t.element_size() for state in strategy.optimizer.state.values()
               for key, t in state.items() if key == "step" and torch.is_tensor(t))


def _layout(strategy) -> tuple[int, int]:
    """(elements as the engine lays the model out, flat groups): padded to N per group at stages 1-3."""
    if strategy.stage == 0:
        return sum(p.numel() for p in strategy.params), 0
    return sum(g.padded_numel for g in strategy.groups), len(strategy.groups)


def dry_run(recipe: Recipe, *, rank: int = 0, steps: int = 3) -> DryRunReport:
    """Build rank `rank` of the recipe's data-parallel world (recipe.batch.world_size) on the fake process
    group, train `steps` steps on random tokens, and measure it beside the estimate and the formulas."""
    from toolkit.runtime.engine import Engine

    check_dry_run(recipe, rank, steps)
    world = recipe.batch.world_size
    inp = EstimateInput.from_recipe(recipe)
    analytic = inp.num_params  # before the engine is built: a pretrained folder it cannot size fails first
    start = time.perf_counter()
    with fake_process_group(rank, world):
        engine = Engine(recipe)
        cuda = engine.device.type == "cuda"
        built = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        generator = torch.Generator().manual_seed(recipe.training.seed + rank)
        micro = (recipe.batch.micro_batch_per_rank, recipe.data.seq_len + 1)
        comm_steps = []
        for _ in range(steps):
            batches = [torch.randint(0, recipe.model.vocab_size, micro, generator=generator)
                       for _ in range(engine.grad_accum_steps)]
            result = engine.train_batch(batches)
            if result.skipped:  # fp16 overflow: no update, so no weight all-gather; not the formula's step
                continue
            comm_steps.append({k[len("comm_bytes_"):]: v for k, v in result.comm.items()
                               if k.startswith("comm_bytes_")})
        if cuda:
            torch.cuda.synchronize()
        done = time.perf_counter()
        peak = torch.cuda.max_memory_allocated() if cuda else None
        padded, groups = _layout(engine.strategy)
        share, counters = _offloaded_share(engine.strategy, recipe), _step_counter_bytes(engine.strategy)
        expected = engine.strategy.expected_bytes_per_step(engine.grad_accum_steps)
        measured = _measured_states(engine)
        skipped = engine.skipped_steps
        num_params = engine.num_parameters
    return DryRunReport(
        label=recipe.model.label, world_size=world, rank=rank, stage=recipe.zero.stage,
        dtype=recipe.precision.dtype, steps=steps, device=str(engine.device), num_params=num_params,
        padded_numel=padded if groups else num_params, groups=groups, measured=measured,
        estimated=_estimated_states(inp, analytic, inp.offload_ratio),
        estimated_padded=_engine_layout_estimate(inp, padded, share, counters), step_counter_bytes=counters,
        comm_steps=comm_steps, comm_expected=expected, skipped_steps=skipped, peak=peak,
        peak_estimate=predict_peak(recipe, on_cuda=True).allocated, build_s=built - start, steps_s=done - built)



def dry_run_command(recipe: Recipe, *, rank: int, steps: int) -> int:
    """`toolkit estimate --dry-run`: print the report; exit 1 (a toolkit bug, not a user mistake) on a mismatch."""
    check_dry_run(recipe, rank, steps)  # before torch builds anything
    report = dry_run(recipe, rank=rank, steps=steps)
    print(report.format(), flush=True)
    bad = report.mismatches()
    for line in bad:
        print(f"MISMATCH: {line}", file=sys.stderr)
    return 1 if any(not line.startswith("peak:") for line in bad) else 0
