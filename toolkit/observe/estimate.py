"""Memory per rank, before a run: the analytic estimator (model states from the ZeRO
paper's formulas, activations from Korthikanti et al. 2022, a device table and a
fits verdict; what `toolkit estimate` prints). What is measured during a run (model
states counted from tensors, peaks per log window, memory.png) is the runtime
monitor in toolkit/observe/memory_monitor.py, which reuses `format_bytes` from here.

The estimators' input, built from a recipe in one place, is estimate_input.py's `EstimateInput`.

This module imports no torch: `toolkit estimate` answers in well under a second.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from toolkit.errors import UserError
from toolkit.specs import ModelSpec

# ===========================================================================
# Estimator: analytic bytes per rank before a run (torch-free).
# ===========================================================================

GB = 10**9  # the ZeRO paper's unit ("120 GB" for 7.5B parameters is 120e9 bytes)
GiB = 2**30  # what GPUs and the table below are measured in

# Adam's optimizer-state bytes per parameter, the ZeRO paper's K (Rajbhandari et al. 2019, section 3.1).
# Mixed precision: fp32 master weights, momentum and variance, 4 + 4 + 4. fp32 training: the
# parameters are already the master copy, so only momentum and variance, 4 + 4.
ADAM_K = {"fp16": 12, "bf16": 12, "fp32": 8}
BF16_STATE_K = 4  # optimizer.state_dtype bf16: two bf16 moments (the bf16 weights are the master)
BF16_OFFLOAD_K = 6  # ... offloaded: a bf16 master and two bf16 moments in CPU memory
OFFLOAD_K = 12  # offloaded fp32 states: the master is a separate fp32 copy whatever the precision, 4 + 4 + 4
INT8_BLOCK = 256  # optimizer.state_dtype int8: elements per fp32 absmax scale (toolkit/runtime/int8_moments.py BLOCK)


def int8_moment_bytes(elements: int) -> int:
    """Bytes of the two 8-bit blockwise moments of `elements` consecutive elements: a 1-byte code each per element,
    an fp32 absmax each per INT8_BLOCK of them (2 + 8 / 256 bytes per element)."""
    return 2 * elements + 8 * _ceil_div(elements, INT8_BLOCK)
MUON_SAVED = 4  # bytes per matrix element optimizer.type muon does not keep: one fp32 momentum, not two moments
PARAM_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}  # parameters and gradients as the model holds them

# NOTE: nominal capacities (nvidia-smi shows them within 1%); a rank fits when its estimate is under
# USABLE_FRACTION of that, leaving room for the CUDA context, the allocator's fragmentation and
# communication buckets, none of which the formulas count.
DEVICE_MEMORY = {
    "T4-16GB": 16 * GiB,
    "V100-16GB": 16 * GiB,
    "V100-32GB": 32 * GiB,
    "A10-24GB": 24 * GiB,
    "L4-24GB": 24 * GiB,
    "RTX3090-24GB": 24 * GiB,
    "RTX4090-24GB": 24 * GiB,
    "RTX5090-32GB": 32 * GiB,
    "A6000-48GB": 48 * GiB,
    "L40S-48GB": 48 * GiB,
    "A100-40GB": 40 * GiB,
    "A100-80GB": 80 * GiB,
    "H100-80GB": 80 * GiB,
    "H200-141GB": 141 * GiB,
    "MI300X-192GB": 192 * GiB,
}
USABLE_FRACTION = 0.9


@dataclass(frozen=True)
class ModelStateBytes:
    """Model-state bytes held by one rank; optimizer states include the fp32 master weights."""

    params: int
    grads: int
    optim: int  # on the GPU; 0 when offloaded
    cpu_optim: int  # in CPU memory when offload_optimizer is cpu

    @property
    def gpu(self) -> int:
        return self.params + self.grads + self.optim


@dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes of one micro batch; both variants include the logits."""

    full: int  # every layer's saved activations
    checkpointed: int  # full activation checkpointing: layer inputs plus one layer recomputed
    logits: int


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's memory for one ZeRO stage and offload choice."""

    stage: int
    offload: str
    states: ModelStateBytes
    activations: ActivationBytes

    @property
    def total(self) -> int:
        return self.states.gpu + self.activations.full

    @property
    def total_checkpointed(self) -> int:
        return self.states.gpu + self.activations.checkpointed


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def estimate_model_state_bytes(num_params: int, *, stage: int, world_size: int, dtype: str = "fp16",
                               offload: str = "none", offload_ratio: float = 1.0,
                               layout: str = "toolkit", muon_params: int = 0,
                               state_dtype: str = "fp32", grad_dtype: str = "fp32") -> ModelStateBytes:
    """Per-rank parameter, gradient and optimizer-state bytes.

    layout "paper": the ZeRO paper's accounting (sections 3 and 5); "toolkit": what the toolkit's
    engine holds (toolkit/runtime/zero/), which differs only in mixed precision: stage 0 keeps fp32
    weights under autocast (4P + 4P + 8P, the same 16P in total), and stages 1-3 reduce gradients
    into an fp32 shard (4P/N) rather than a 16-bit one. With offload, `offload_ratio` of the
    optimizer shard sits in CPU memory (the toolkit rounds it to whole groups). `muon_params` of the
    parameters step with Muon (optimizer.type muon): one fp32 momentum, MUON_SAVED bytes fewer each.
    `state_dtype` bf16 (bf16 precision: recipe checks): the bf16 weights are the master and the
    two moments are bf16, BF16_STATE_K bytes per element of the optimizer's share on the device; stage 0's gradients
    are bf16 too (2 + 2 + 4 bytes per parameter; toolkit/runtime/low_precision_adamw.py, zero/adamw.py); offloaded,
    a bf16 master and two bf16 moments in CPU memory (BF16_OFFLOAD_K bytes per element, kernels/cpu_adam_bf16.cpp).
    `state_dtype` int8: the master as under fp32 (stage 0's fp32 weights; at stages 1-3 a separate fp32
    master under 16-bit weights) and `int8_moment_bytes` of the optimizer's share instead of 8 bytes per element.
    `grad_dtype` bf16 (zero.grad_dtype, stages 1-3): the reduced gradient shard in 2 bytes per element, not 4 (stage 1
    under bf16 weights: the full bf16 gradient buffer's own chunk, no separate shard).
    """
    # Mixed precision with Adam, P parameters, N ranks (K = 12), as the paper counts:
    #   stage 0: 2P + 2P + KP        stage 1: 2P + 2P + KP/N
    #   stage 2: 2P + (2 + K)P/N     stage 3: (2 + 2 + K)P/N
    # fp32 is the same shape with 4-byte parameters and gradients and K = 8.
    # Offload moves the K part (master weights and Adam states) to CPU memory; the master is then
    # always a separate fp32 copy, so fp32 runs hold 12 bytes there too (toolkit/runtime/zero/offload.py).
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage} is not one of 0, 1, 2, 3")
    if offload not in ("none", "cpu", "nvme") or (offload != "none" and stage == 0):
        raise ValueError(f"offload {offload!r} with stage {stage}: offload needs stage >= 1")
    if layout not in ("paper", "toolkit"):
        raise ValueError(f"layout {layout!r} is not 'paper' or 'toolkit'")
    if state_dtype == "bf16" and dtype != "bf16":
        raise ValueError(f"state_dtype bf16 is built for precision bf16, not {dtype}")
    if state_dtype == "bf16" and stage == 0:
        return ModelStateBytes(2 * num_params, 2 * num_params, BF16_STATE_K * num_params, 0)
    n = world_size
    shard = _ceil_div(num_params, n)  # NOTE: ZeRO pads each partition to an equal size, hence ceil
    per_param = PARAM_BYTES[dtype]
    params = per_param * (shard if stage >= 3 else num_params)
    grads = per_param * (shard if stage >= 2 else num_params)
    optim = ADAM_K[dtype] * (shard if stage >= 1 else num_params)
    if layout == "toolkit" and per_param == 2:
        if stage == 0:  # fp32 weights and gradients, the weights are the master
            params, grads, optim = 4 * num_params, 4 * num_params, 8 * num_params
        else:  # the reduced fp32 shard (stage 1 also keeps its full 16-bit gradient buffer)
            grads = 4 * shard + (2 * num_params if stage == 1 else 0)
            if grad_dtype == "bf16":  # zero.grad_dtype bf16: a bf16 shard (stage 1: a chunk of its full buffer)
                grads = 2 * num_params if stage == 1 else 2 * shard
    optim -= MUON_SAVED * (_ceil_div(muon_params, n) if stage >= 1 else muon_params)
    if state_dtype == "bf16":  # stages 1-3: the bf16 weights' chunk is the master; two bf16 moments per element
        optim = BF16_STATE_K * shard
    if state_dtype == "int8":  # 8-bit moments (stage 0: the fp32 weights are the master, 8 bytes were moments)
        share = shard if stage >= 1 else num_params
        optim += int8_moment_bytes(share) - 8 * share
    if offload in ("cpu", "nvme"):  # nvme: the same bytes in swap files, streamed through bounded buffers
        host = round(offload_ratio * shard)
        # NOTE: under nvme the OFFLOAD_K * host bytes sit in swap files, in neither column (swap.py checks the disk)
        if state_dtype == "bf16":
            return ModelStateBytes(params, grads, BF16_STATE_K * (shard - host),
                                   BF16_OFFLOAD_K * host if offload == "cpu" else 0)
        if state_dtype == "int8":  # an fp32 master and 8-bit moments, on each side of the split
            device_part = ADAM_K[dtype] * (shard - host) - 8 * (shard - host) + int8_moment_bytes(shard - host)
            return ModelStateBytes(params, grads, device_part, 4 * host + int8_moment_bytes(host) if offload == "cpu"
                                   else 0)
        # NOTE: Muon's matrices split between the tiers as the elements do (an approximation below offload_ratio 1:
        # the offloaded groups are the last ones, where the matrices are; the two columns' sum is exact)
        muon_saved = MUON_SAVED * _ceil_div(muon_params, n)
        host_saved = round(muon_saved * host / shard) if shard else 0
        return ModelStateBytes(params, grads, ADAM_K[dtype] * (shard - host) - (muon_saved - host_saved),
                               OFFLOAD_K * host - host_saved if offload == "cpu" else 0)
    return ModelStateBytes(params, grads, optim, 0)


def parameter_count(model: ModelSpec, *, tied_embeddings: bool | None = None) -> int:
    """Parameters of the transformers model a spec builds, counted from its shape."""
    h, v, i, n = model.n_embd, model.vocab_size, model.intermediate_size, model.n_layer
    if model.family == "gpt2":
        # wte + wpe; per block ln_1, c_attn (3h, biased), attn c_proj, ln_2, c_fc, mlp c_proj; ln_f.
        tied = True if tied_embeddings is None else tied_embeddings
        block = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * i + i) + (i * h + h)
        return v * h + model.max_positions * h + n * block + 2 * h + (0 if tied else v * h)
    # llama: no biases, RoPE (no position table), RMSNorm weights only, SwiGLU, GQA.
    tied = False if tied_embeddings is None else tied_embeddings
    kv = model.n_kv_head * (h // model.n_head)
    block = (2 * h * h + 2 * h * kv) + 3 * h * i + 2 * h
    return v * h + n * block + h + (0 if tied else v * h)


def muon_parameter_count(model: ModelSpec) -> int:
    """Parameters optimizer.type muon orthogonalizes: the blocks' matrices (toolkit/runtime/muon.py's rule:
    2-D, not an embedding, not the head)."""
    h, i, n = model.n_embd, model.intermediate_size, model.n_layer
    if model.family == "gpt2":  # c_attn, attn c_proj, c_fc, mlp c_proj
        return n * (3 * h * h + h * h + 2 * h * i)
    kv = model.n_kv_head * (h // model.n_head)  # llama: q, k, v, o; gate, up, down
    return n * (2 * h * h + 2 * h * kv + 3 * h * i)


def estimate_activation_bytes(model: ModelSpec, *, micro_batch: int, seq_len: int, dtype: str,
                              attention: str = "sdpa") -> ActivationBytes:
    """Saved activations of one micro batch (Korthikanti et al. 2022, section 4, generalised).

    attention "eager": the paper's accounting (softmax scores and their dropout mask stored, masks
    always); "sdpa" (how the toolkit's transformers models run attention: flash / memory-efficient
    kernels): no a*s*s*b terms, a per-head log-sum-exp instead, and dropout masks only when
    model.dropout > 0.
    """
    # Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 1:
    # a GPT block saves s*b*h*(34 + 5*a*s/h) bytes in 16-bit (s sequence, b micro batch, h width,
    # a heads). Per block, in elements of the compute dtype (e bytes) plus 1-byte dropout masks:
    #   attention: QKV input sbh, Q sbh, K and V r*sbh each (r = kv_heads/heads, GQA), output-proj
    #              input sbh; softmax output a*s*s*b (and its dropout output, gpt2)
    #   MLP:       input sbh; gpt2 GELU input + down-proj input 2*sbi; llama SwiGLU gate, up,
    #              SiLU output and product 4*sbi  (i = MLP width)
    #   norms:     2 inputs, 2*sbh
    #   masks:     gpt2 only (llama has no dropout layers there): 2*sbh + a*s*s*b bytes
    # gpt2 with i = 4h, r = 1, e = 2 gives exactly 34*sbh + 5*a*s*s*b.
    # Full checkpointing keeps each block's input (sbh) and recomputes one block at a time.
    # Outside the blocks: final-norm and head inputs 2*sbh, and the logits s*b*V in the compute dtype
    # plus an fp32 copy for the loss and its saved log-softmax (transformers upcasts logits).
    # With flash attention (attention="sdpa") the a*s*s*b terms vanish and an fp32 log-sum-exp per
    # head and token is saved instead. Under autocast the norms and residual stream stay fp32, so
    # measured peaks run somewhat higher; the toolkit's fused cross-entropy keeps no fp32 logits, lower.
    if attention not in ("eager", "sdpa"):
        raise ValueError(f"attention {attention!r} is not 'eager' or 'sdpa'")
    s, b, h, a, i = seq_len, micro_batch, model.n_embd, model.n_head, model.intermediate_size
    e = PARAM_BYTES[dtype]
    sbh = s * b * h
    r = model.n_kv_head / model.n_head
    eager = attention == "eager"
    scores = a * s * s * b if eager else 0
    gpt2 = model.family == "gpt2"
    dropout = gpt2 and (eager or model.dropout > 0)
    attn = (3 + 2 * r) * sbh + (2 if gpt2 else 1) * scores
    mlp = sbh + (2 if gpt2 else 4) * s * b * i
    norms = 2 * sbh
    masks = (2 * sbh + scores) if dropout else 0
    lse = 0 if eager else 4 * a * s * b
    block = int(e * (attn + mlp + norms) + masks + lse)
    outside = e * 2 * sbh + (sbh if dropout else 0)  # + the embedding dropout mask
    logits = s * b * model.vocab_size * (e + (4 if e < 4 else 0) + 4)
    full = model.n_layer * block + outside + logits
    checkpointed = model.n_layer * e * sbh + block + outside + logits
    return ActivationBytes(full=full, checkpointed=checkpointed, logits=logits)


def estimate_memory(model: ModelSpec, *, micro_batch: int, seq_len: int, dtype: str, world_size: int,
                    stage: int, offload: str = "none", offload_ratio: float = 1.0, muon_params: int = 0,
                    state_dtype: str = "fp32", grad_dtype: str = "fp32") -> MemoryEstimate:
    """One rank's model states and activations for a model, batch, precision and ZeRO choice."""
    model, tied = resolve_model_shape(model)
    states = estimate_model_state_bytes(parameter_count(model, tied_embeddings=tied), stage=stage,
                                        world_size=world_size, dtype=dtype, offload=offload,
                                        offload_ratio=offload_ratio, muon_params=muon_params,
                                        state_dtype=state_dtype, grad_dtype=grad_dtype)
    activations = estimate_activation_bytes(model, micro_batch=micro_batch, seq_len=seq_len, dtype=dtype)
    return MemoryEstimate(stage, offload, states, activations)


def resolve_model_shape(model: ModelSpec) -> tuple[ModelSpec, bool | None]:
    """The spec with a pretrained folder's config.json shape (and its embedding tying), else as is."""
    if model.pretrained is None:
        return model, None
    path = model.pretrained / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"recipe.model.pretrained: {path}: cannot read: {exc}") from None
    kind = config.get("model_type")
    llama_keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    try:
        if kind == "gpt2":
            shape = dict(family="gpt2", n_layer=config["n_layer"], n_embd=config["n_embd"], n_head=config["n_head"],
                         n_kv_head=config["n_head"], intermediate_size=config.get("n_inner") or 4 * config["n_embd"],
                         max_positions=config["n_positions"], vocab_size=config["vocab_size"])
            return replace(model, **shape), config.get("tie_word_embeddings", True)
        # NOTE: Qwen2, Mistral and their kin are llama-shaped (gated MLP, RMSNorm, grouped KV heads): the
        # estimate counts them as llama (Qwen2's q/k/v biases are a rounding error).
        if kind == "llama" or all(isinstance(config.get(k), int) for k in llama_keys):
            heads = config["num_attention_heads"]
            shape = dict(family="llama", n_layer=config["num_hidden_layers"], n_embd=config["hidden_size"],
                         n_head=heads, n_kv_head=config.get("num_key_value_heads") or heads,
                         intermediate_size=config["intermediate_size"],
                         max_positions=config.get("max_position_embeddings") or model.max_positions,
                         vocab_size=config["vocab_size"])
            return replace(model, **shape), config.get("tie_word_embeddings", False)
    except KeyError as exc:
        raise UserError(f"recipe.model.pretrained: {path}: no {exc.args[0]!r} in this {kind} config") from None
    raise UserError(f"recipe.model.pretrained: {path}: model_type {kind!r} is not one the estimator knows "
                    f"(gpt2, llama)")


def find_device(name: str) -> str:
    """The DEVICE_MEMORY key for a name, case and punctuation aside (`h200`, `a100-80gb`)."""
    def squash(text: str) -> str:
        return "".join(ch for ch in text.lower() if ch.isalnum())

    wanted = squash(name)
    exact = [key for key in DEVICE_MEMORY if squash(key) == wanted]
    prefixed = [key for key in DEVICE_MEMORY if squash(key).startswith(wanted)] if wanted else []
    if exact or len(prefixed) == 1:
        return (exact or prefixed)[0]
    choices = ", ".join(prefixed if len(prefixed) > 1 else DEVICE_MEMORY)
    raise UserError(f"--device {name}: {'ambiguous' if prefixed else 'unknown device'}; one of: {choices}")


def fits(total_bytes: int, device: str) -> bool:
    """Whether a rank needing `total_bytes` fits the named device (within USABLE_FRACTION of it)."""
    return total_bytes <= USABLE_FRACTION * DEVICE_MEMORY[find_device(device)]


def format_bytes(n: float) -> str:
    """Bytes in binary units, one decimal (`1.9 GiB`)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def format_count(n: int) -> str:
    """A parameter count in K, M or B (`124.4M`)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'B' else 1}f}{unit}"
    return str(n)


def format_estimate(inp: "EstimateInput", device: str | None = None) -> str:  # estimate_input.py
    """A table of per-rank memory for ZeRO stages 0-3 and cpu offload (`inp.offload_ratio` of the optimizer
    in CPU memory); `*` marks the input's (stage, offload)."""
    device_key = find_device(device) if device is not None else None
    rows = [inp.memory(st, off) for off in ("none", "cpu") for st in range(4) if not (off == "cpu" and st == 0)]
    lines = [f"model {inp.model.label}: {format_count(inp.num_params)} parameters; "
             f"micro batch {inp.micro_batch} x {inp.seq_len} tokens; {inp.dtype} (Adam K={ADAM_K[inp.dtype]}"
             + (f"; bf16 optimizer states: K={BF16_STATE_K}, bf16 weights" if inp.state_dtype == "bf16"
                else f"; int8 blockwise moments: 2 + 8/{INT8_BLOCK} bytes, not 8" if inp.state_dtype == "int8" else "")
             + ("; bf16 gradient shard at stages 1-3 (zero.grad_dtype)" if inp.grad_dtype == "bf16" else "")
             + "); "
             f"world size {inp.world_size}; activation checkpointing "
             f"{'on' if inp.model.activation_checkpointing else 'off'}"]
    if device_key:
        capacity = DEVICE_MEMORY[device_key]
        lines.append(f"device {device_key}: {format_bytes(capacity)}; a rank fits under "
                     f"{USABLE_FRACTION:.0%} of it ({format_bytes(USABLE_FRACTION * capacity)})")
    header = ["", "stage", "offload", "params", "grads", "optim", "activ.", "activ.ckpt", "total", "total.ckpt",
              "cpu/rank"] + (["fits"] if device_key else [])
    table = [header]
    for row in rows:
        verdict = []
        if device_key:
            verdict = ["yes" if fits(row.total, device_key)
                       else "with ckpt" if fits(row.total_checkpointed, device_key) else "no"]
        s, a = row.states, row.activations
        table.append(["*" if (row.stage, row.offload) == (inp.stage, inp.offload_optimizer) else "", str(row.stage), row.offload,
                      format_bytes(s.params), format_bytes(s.grads), format_bytes(s.optim), format_bytes(a.full),
                      format_bytes(a.checkpointed), format_bytes(row.total), format_bytes(row.total_checkpointed),
                      format_bytes(s.cpu_optim) if s.cpu_optim else "-", *verdict])
    widths = [max(len(r[c]) for r in table) for c in range(len(header))]
    for r in table:
        cells = [r[c].ljust(widths[c]) if c < 3 else r[c].rjust(widths[c]) for c in range(len(r))]
        lines.append("  ".join(cells).rstrip())
    lines.append("per rank; model states: the ZeRO paper's formulas (Rajbhandari et al. 2019) as the toolkit holds "
                 "them (fp32 weights at stage 0, fp32 reduced gradients at stages 1-3)"
                 + (f", cpu rows with {inp.offload_ratio:.0%} of the optimizer offloaded" if inp.offload_ratio != 1
                    else "")
                 + "; activations: Korthikanti et al. 2022 with SDPA/flash attention (no s x s scores) incl. "
                 "logits; ckpt = full activation checkpointing")
    return "\n".join(lines)
