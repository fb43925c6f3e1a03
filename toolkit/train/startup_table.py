"""The start-up table a run prints before its first step: everything that matters about the run, computed
once (recipe hash, model size, batch arithmetic, precision, ZeRO, comm, kernels, device peak and CUDA
allocator, threads).

Each row asks the component that owns the fact to describe itself (precision: toolkit/runtime/precision.py,
the strategy, the kernels, the communicator, the MFU basis); what does not live here: the loop that prints it
(toolkit/train/loop.py).
"""
from __future__ import annotations

from toolkit import cuda_allocator
from toolkit.data.batches import Dataset
from toolkit.observe.comm_ledger import format_wire_bytes
from toolkit.observe.flops import MfuBasis, mfu_basis
from toolkit.train.recipe_threads import choose_cpu_threads
from toolkit.runtime.engine import Engine
from toolkit.runtime.precision import describe_precision
from toolkit.specs import Recipe

# NOTE: DTensor and torch.distributed.pipelining issue their own collectives, outside the Communicator.
MESH_NOT_COUNTED = ("tensor/pipeline parallelism: not counted yet (DTensor and torch.distributed.pipelining issue "
                    "their own collectives; only the engine's loss and norm all-reduces are)")


def startup_table(recipe: Recipe, engine: Engine, dataset: Dataset, mfu: MfuBasis | None = None) -> str:
    """Everything that matters about the run, computed once and printed at start."""
    b, m, d = recipe.batch, recipe.model, recipe.data
    tokens_per_step = b.global_batch * d.seq_len
    device = engine.device
    mfu = mfu or mfu_basis(engine.model, d.seq_len, recipe.precision.dtype, device, b.world_size,
                           recipe.training.peak_tflops)
    rows = [
        ("recipe", f"{recipe.name} (hash {recipe.hash})"),
        ("model", f"{m.label}: {engine.num_parameters / 1e6:.2f}M parameters, " + model_shape_text(m, engine.model)
                  + (", activation checkpointing" if m.activation_checkpointing else "")),
        ("data", dataset.describe()),
        ("batch", f"global {b.global_batch} = micro {b.micro_batch_per_rank} x accum {b.grad_accum_steps} "
                  f"x world {b.world_size}; {tokens_per_step:,} tokens per step"),
        ("steps", f"{recipe.training.max_steps} optimizer steps = {recipe.training.max_steps * tokens_per_step:,} tokens"),
        ("precision", describe_precision(recipe.precision, recipe.zero.stage, recipe.optimizer.state_dtype)),
        ("zero", engine.strategy.describe()),
        ("comm", comm_row(engine)),
        ("tiers", engine.strategy.describe_tiers()),
        ("kernels", engine.kernels.describe()),
        ("optimizer", f"{_muon_part(recipe.optimizer)}AdamW lr {recipe.optimizer.lr:g}, betas "
                      f"{list(recipe.optimizer.betas)}, wd {recipe.optimizer.weight_decay:g}; schedule {recipe.scheduler.type}"),
        ("device", f"{mfu.device_name} ({device}); {mfu.describe_peak()}"
                   + (f"; {cuda_allocator.describe()}" if device.type == "cuda" else "")),
        ("threads", choose_cpu_threads(recipe).describe()),
        ("flops", mfu.describe_flops()),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}} | {v}" for k, v in rows)


def model_shape_text(spec, model) -> str:
    """"4 layers, width 128, 4 heads": the recipe's shape, or a pretrained folder's (its loaded config's)."""
    config = getattr(model, "config", None) if spec.pretrained is not None else None
    shape = (getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None),
             getattr(config, "num_attention_heads", None))
    layers, width, heads = shape if None not in shape else (spec.n_layer, spec.n_embd, spec.n_head)
    return f"{layers} layers, width {width}, {heads} heads"


def comm_row(engine: Engine) -> str:
    """The start-up table's comm row: the formula's bytes per rank per step, and how collectives run."""
    if not engine.dist.active:
        return engine.comm.describe()
    if engine.recipe.parallel.active:
        return MESH_NOT_COUNTED
    expected = engine.strategy.expected_bytes_per_step(engine.grad_accum_steps)
    kinds = " + ".join(f"{k.replace('_', '-')} {format_wire_bytes(v)}" for k, v in expected.items())
    return (f"expected {format_wire_bytes(sum(expected.values()))} sent per rank per step ({kinds}; "
            f"docs/communication.md); {engine.comm.describe()}")


def _muon_part(o) -> str:
    """optimizer.type muon: its settings, before the AdamW's that steps the rest ('' otherwise)."""
    if o.type != "muon":
        return ""
    return (f"Muon lr {o.muon_lr:g} (momentum {o.muon_momentum:g}{', Nesterov' if o.muon_nesterov else ''}, "
            f"{o.muon_ns_steps} Newton-Schulz steps in {o.muon_ns_dtype}, wd {o.muon_weight_decay:g}, "
            f"lr rule {o.muon_adjust_lr}) on the hidden matrices; embeddings, head, norms, biases: ")
