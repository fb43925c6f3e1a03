"""One rank's memory peak during training, predicted from a recipe: the number the run's memory line
will show (on CUDA the allocator's max allocated and max reserved bytes; on the CPU the process's
peak resident set). `toolkit estimate`, the pre-flight check, `toolkit tune` and the tutorials all
read it from here; estimate.py keeps the papers' formulas it starts from.

The peak is the moment backward starts (without checkpointing) or the loss's backward (with it):
  model states where the engine keeps them (tiers.py: exact, counted the engine's way)
  + the autocast weight cache (stage 0 under bf16/fp16: a 16-bit copy of every matmul weight,
    kept for backward)
  - the gradients, where they do not exist yet at that moment (stage 0, no accumulation: torch
    allocates them during backward, after the peak)
  + the saved activations of every block (or, checkpointed, each block's input)
  + the logits and what the loss keeps of them
  + on the CPU, the process itself (Python, torch, transformers) and the synthetic token buffers.

NOTE: the activation coefficients below are bytes per token per unit of width, EMPIRICAL: fitted
to the H200 and CPU calibration tables (benchmarks/memory_calibration/*.jsonl) with the structure
fixed by which tensors autograd saves (Korthikanti et al. 2022, estimate.py), and checked on rows
that were not part of the fit. tests/observe/test_memory_calibration.py holds every committed row
within CALIBRATION_TOLERANCE. Torch-free, like estimate.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from toolkit import cuda_allocator
from toolkit.observe.estimate import PARAM_BYTES
from toolkit.observe.estimate_input import EstimateInput
from toolkit.observe.tiers import input_tiers
from toolkit.specs import ModelSpec, Recipe

CALIBRATION_TOLERANCE = 0.10  # |predicted / measured - 1| allowed for each calibration row (allocated peak)
RESERVED_TOLERANCE = 0.25     # the same for the allocator's reserved peak (fragmentation varies more)
EXPANDABLE_RESERVED_TOLERANCE = 0.15  # with expandable segments (held-out rows 0.87-1.02 of measured: the
#                                      unfused kernels' many small buffers)

# Saved activations per block, bytes per token, for 16-bit compute (fp32 doubles them), with the
# fused norms, bias+GELU and cross-entropy of toolkit/ops on a GPU. h width, i MLP width, r the
# share of key/value heads (GQA).
#   gpt2:  16 h + 4 i   (fit: 32.1 h at i = 4h; bias+GELU keeps its input and output, 2 x 2 i)
#   llama: 12.4 h + 6.3 r h + 8 i   (SwiGLU keeps gate, SiLU(gate), up and their product, 4 x 2 i)
BLOCK_H = {"gpt2": 16.0, "llama": 12.4}
BLOCK_RH = {"gpt2": 0.0, "llama": 6.3}
BLOCK_I = {"gpt2": 4.0, "llama": 8.0}
# Stage 0 under autocast keeps fp32 weights, so the residual stream is fp32: each block's two norm
# inputs take 4 bytes instead of 2 (fit: gpt2 4.3 h, llama 3.5 h).
FP32_RESIDUAL_H = {"gpt2": 4.3, "llama": 3.5}
# Outside the blocks: embeddings' output, the final norm (fit, gpt2 26.6 h; llama's is within its
# block fit).
OUTSIDE_H = {"gpt2": 26.6, "llama": 0.0}
# The logits (padded to 128 columns on CUDA) and the fused loss: the 16-bit logits and, at the
# loss's backward, their gradient (fit 3.7 bytes per logit; twice that in fp32).
FUSED_LOGIT_BYTES = 3.7
# Activation checkpointing: every block's 16-bit input (2 h, fit 2.35 h per layer) and, at the loss's
# backward, the logits and their gradient (fit 4.0 bytes per logit); or, where larger, one block
# recomputed in backward: its activations and the gradients flowing through its MLP (three i-wide).
CKPT_LAYER_H = 2.35
# At stage 0 under autocast that input is the fp32 residual stream: 2 more bytes per element (counted, not
# fitted; without it the H100 grids' stage-0 checkpointed rows measured up to 1.21x the prediction, growing
# with the micro batch, where stages 1-3 held within 0.96-1.02; benchmarks/RESULTS.md).
CKPT_FP32_INPUT_H = 2.0
CKPT_LOGIT_BYTES = 4.0
CKPT_BACKWARD_I = 6.0
# Without the fused kernels (the CPU, or `kernels.* off`): torch's cross-entropy on an fp32 copy keeps
# the fp32 log-probabilities, and at backward their gradient and the logits' (12 bytes per logit);
# transformers' GELU keeps its tanh, 0.5x and 1 + tanh (3 more tensors of i per token); a norm under
# autocast keeps an fp32 copy of a 16-bit input (layernorm +2 h, rmsnorm +4 h: also its normalized fp32
# tensor), and at stage 0 llama's fp32 norm output is cast once per consuming matmul (+6 h).
# NOTE: gpt2 keeps more than those counts say: 22.6 h per block besides its GELU's, fitted to one row
# (124M, micro 16, stage 0) and matching two more measured afterwards (the H200 dry run at 8 ranks,
# stages 1 and 3: 0.96x); which tensors they are is not yet understood.
UNFUSED_LOGIT_BYTES = 12
UNFUSED_GELU_I = 6.0
UNFUSED_NORM_H = {"gpt2": 22.6, "llama": 2 * 4.0}
UNFUSED_STAGE0_H = {"gpt2": 22.6, "llama": 2 * 4.0 + 6.0}
# The CPU in fp32: every block's saved tensors COUNTED (not fitted) with saved-tensor hooks on torch 2.13, in
# bytes per token, 16-bit units like the coefficients above. Both families keep each block's input, each norm's
# output (llama's rmsnorm also its normalized fp32 tensor before the weight), the attention's query, output and
# key/value (CPU's flash attention keeps them and the log-sum-exp, never the probabilities), the residual between
# attention and MLP, and the MLP's tensors: llama's gate, up, SiLU(gate) and their product (4 i); gpt2's qkv as
# one 3 h tensor and GELU's input, tanh, 1 + tanh, 0.5x(...) and output (5 i). Outside the blocks: the final
# norm's input and outputs (llama 3 x 2 h, gpt2 2 x 2 h). Per token, also one fp32 number per head (the
# log-sum-exp) and per norm (rmsnorm's 1 / rms; layernorm's mean and 1 / std).
CPU_FP32_NORM_STATS = {"gpt2": 4, "llama": 2}
CPU_FP32_BLOCK_H = {"gpt2": 16.0, "llama": 16.0}
CPU_FP32_BLOCK_RH = {"gpt2": 0.0, "llama": 4.0}
CPU_FP32_BLOCK_I = {"gpt2": 10.0, "llama": 8.0}
CPU_FP32_OUTSIDE_H = {"gpt2": 4.0, "llama": 6.0}
CPU_FP32_CKPT_LAYER_H = 2.0  # checkpointed: each block's input alone (fp32, 4 h bytes)
# The CPU: a training process's own resident set (Python, torch, transformers, the toolkit; measured
# on the 2-core VM with torch 2.13: 0.37 GiB with a tiny model). Its peak RSS also holds what glibc's
# heap keeps of freed tensors, which these terms do not model: there the prediction is a lower bound,
# and the calibration holds measured within CPU_RSS_BAND of it.
CPU_RUNTIME_BYTES = int(0.37 * 2**30)
CPU_RSS_BAND = (0.95, 2.0)
# The allocator's reserved peak (EMPIRICAL). torch's default segments (H200 rows): at stages 0-2 its allocated
# peak times the median ratio (1.12; measured 1.01-1.35); at stage 3 the allocated peak plus what the cache keeps
# of the gathered units it frees and gathers again, about 5 bytes per parameter (124M, 1.5B, 3.2B rows).
# Expandable segments (the command line's default, toolkit/cuda_allocator.py; H100 rows): the allocated peak
# times the GPU matrix's median ratio at every stage (1.014; measured 1.002-1.060).
RESERVED_FACTOR = 1.12
EXPANDABLE_RESERVED_FACTOR = 1.014
# optimizer.state_dtype bf16 on the device: its step holds six fp32 temporaries of the piece it updates at once, at
# most a window (toolkit/runtime/low_precision_adamw.py STEP_WINDOW, 2^25 elements: a test holds the two equal),
# after the activations are gone: the peak only where they are smaller (bf16_step_temporary_bytes; counted on the
# CPU, and 6 x 1,894 MiB segments of a llama-1b shard on an H100 before the window).
BF16_STEP_WINDOW = 1 << 25
BF16_STEP_TEMPORARY_BYTES = 6 * 4
STAGE3_RESERVED_PER_PARAM = 5.0
PADDED_VOCAB = 128  # toolkit/ops/fused_modules.py pad_lm_head's multiple (CUDA only)
# Attention without a fused kernel (fp32 with grouped key/value heads: flash attention needs 16 bits
# and the memory-efficient kernel has no GQA): the fp32 probabilities, a*s*s per sequence per block,
# and their gradient and scores at the last block's backward.
MATH_ATTENTION_BYTES = 4


@dataclass(frozen=True)
class PeakPrediction:
    """One rank's predicted peak, with the terms it is made of (bytes)."""

    states: int          # model states on the training device at the peak moment
    weight_cache: int    # autocast's 16-bit weight copies (fp32 weights under bf16/fp16: stage 0 but bf16 states)
    activations: int     # saved activations: blocks, outside them, attention probabilities
    logits: int          # the logits and what the loss keeps of them
    runtime: int         # CPU: the process's own resident set and the token buffers; 0 on CUDA
    allocated: int       # CUDA: max allocated; CPU: peak resident set (every term, host included)
    reserved: int        # CUDA: max reserved; CPU: = allocated
    host: int            # offloaded optimizer and parameters, in CPU memory
    step_temporaries: int = 0  # the bf16 step's fp32 temporaries where the optimizer step is the peak moment (then
    #                            activations and logits are 0: they are gone by then)


def fp32_weights_under_autocast(stage: int, state_dtype: str, dtype: str) -> bool:
    """Autocast casts fp32 weights for 16-bit compute: at stage 0 (where the weights are the master) under bf16/fp16,
    unless optimizer.state_dtype bf16 makes the bf16 weights the master. Stages 1-3 hold 16-bit weights. Then autocast
    keeps 16-bit weight copies, the residual stream is fp32, and unfused norms run in fp32."""
    return stage == 0 and state_dtype != "bf16" and dtype != "fp32"


def activation_peak_bytes(model: ModelSpec, *, micro_batch: int, seq_len: int, dtype: str, stage: int,
                          on_cuda: bool, fused: tuple[bool, bool, bool] = (True, True, True),
                          vocab_size: int | None = None, state_dtype: str = "fp32") -> tuple[int, int]:
    """(saved activations, logits and loss) of one micro batch at the peak moment; `fused`: whether the
    fused (norm, GELU, cross-entropy) kernels run (only ever on CUDA)."""
    fam = model.family
    t, h, i, n = seq_len * micro_batch, model.n_embd, model.intermediate_size, model.n_layer
    r = model.n_kv_head / model.n_head
    scale = PARAM_BYTES[dtype] / 2  # the coefficients are for 16-bit compute
    vocab = vocab_size or model.vocab_size
    padded = -(-vocab // PADDED_VOCAB) * PADDED_VOCAB if on_cuda else vocab
    norm, gelu, loss = (f and on_cuda for f in fused)
    counted = not on_cuda and dtype == "fp32"  # the CPU_FP32_* terms: counted tensors, not fitted ones
    fp32_residual = fp32_weights_under_autocast(stage, state_dtype, dtype)  # the residual stream is fp32
    if counted:
        block = CPU_FP32_BLOCK_H[fam] * h + CPU_FP32_BLOCK_RH[fam] * r * h + CPU_FP32_BLOCK_I[fam] * i
        block += 2 * (model.n_head + CPU_FP32_NORM_STATS[fam])  # 4-byte numbers in 16-bit units
    else:
        block = BLOCK_H[fam] * h + BLOCK_RH[fam] * r * h + BLOCK_I[fam] * i
        if not gelu and fam == "gpt2":
            block += UNFUSED_GELU_I * i
    if not norm and dtype != "fp32":
        block += (UNFUSED_STAGE0_H[fam] if fp32_residual else UNFUSED_NORM_H[fam]) * h
    logit_bytes = (CKPT_LOGIT_BYTES if model.activation_checkpointing else FUSED_LOGIT_BYTES) * scale
    logits = t * padded * logit_bytes if loss else t * vocab * UNFUSED_LOGIT_BYTES
    probs = 0  # NOTE: no fused attention kernel on CUDA (see MATH_ATTENTION_BYTES); the CPU's flash kernel takes fp32
    if on_cuda and dtype == "fp32" and model.n_kv_head < model.n_head:
        probs = model.n_head * seq_len * seq_len * micro_batch * MATH_ATTENTION_BYTES
    if model.activation_checkpointing:
        acts = (CPU_FP32_CKPT_LAYER_H if counted else CKPT_LAYER_H) * n * t * h * scale
        if fp32_residual:
            acts += CKPT_FP32_INPUT_H * n * t * h
        return int(acts), int(max(logits, (block + CKPT_BACKWARD_I * i) * t * scale + 2 * probs))
    acts = n * t * block * scale + (CPU_FP32_OUTSIDE_H if counted else OUTSIDE_H)[fam] * t * h * scale
    if fp32_residual:
        acts += n * t * FP32_RESIDUAL_H[fam] * h
    acts += n * probs + 2 * probs
    return int(acts), int(logits)


def _matmul_params(model: ModelSpec, n_params: int) -> int:
    """Parameters autocast casts for a matmul: all but the embedding tables the lookups read
    (gpt2's tied wte is also the head's weight, so only its position table stays out)."""
    if model.family == "gpt2":
        return n_params - model.max_positions * model.n_embd
    return n_params - model.vocab_size * model.n_embd


def bf16_step_temporary_bytes(inp: EstimateInput, n_params: int) -> int:
    """The fp32 temporaries of the optimizer step with optimizer.state_dtype bf16 on the device (0 otherwise): six
    of the piece it updates at once, at stage 0 one parameter (BF16AdamW steps each; the largest is the embedding, an
    MLP or gpt2's qkv matrix), at stages 1-3 a segment of the rank's flat shard (up to all of it); at most the
    window."""
    if inp.state_dtype != "bf16" or inp.offload_optimizer != "none":
        return 0
    m = inp.shape
    if inp.stage == 0:
        piece = max(m.vocab_size * m.n_embd, m.n_embd * m.intermediate_size, 3 * m.n_embd * m.n_embd)
    else:
        piece = -(-n_params // inp.world_size)
    return BF16_STEP_TEMPORARY_BYTES * min(BF16_STEP_WINDOW, piece)


def reserved_bytes(allocated: int, stage: int, n_params: int, expandable: bool) -> int:
    """The CUDA allocator's reserved peak for an allocated peak (see RESERVED_FACTOR)."""
    if expandable:
        return int(EXPANDABLE_RESERVED_FACTOR * allocated)
    return int(allocated + STAGE3_RESERVED_PER_PARAM * n_params if stage == 3 else RESERVED_FACTOR * allocated)


def predict_peak(recipe: Recipe, *, on_cuda: bool, expandable_segments: bool | None = None) -> PeakPrediction:
    """The predicted peak of one rank of `recipe` on a CUDA device (`on_cuda`) or the CPU; `expandable_segments`:
    the CUDA allocator's setting (default: the one in effect, toolkit/cuda_allocator.py)."""
    inp = EstimateInput.from_recipe(recipe)
    n_params = inp.num_params
    tiers = input_tiers(inp)
    states = tiers.gpu
    if inp.stage == 0 and inp.grad_accum_steps == 1:  # the gradients appear during backward, after the peak
        states -= inp.model_states(n_params).grads  # fp32 ones, or bf16 with optimizer.state_dtype bf16
    cache = 2 * _matmul_params(inp.shape, n_params) if fp32_weights_under_autocast(inp.stage, inp.state_dtype,
                                                                                    inp.dtype) else 0
    acts, logits = activation_peak_bytes(inp.shape, micro_batch=inp.micro_batch, seq_len=inp.seq_len,
                                         dtype=inp.dtype, stage=inp.stage, on_cuda=on_cuda, fused=inp.fused,
                                         vocab_size=inp.vocab_size, state_dtype=inp.state_dtype)
    step = bf16_step_temporary_bytes(inp, n_params)
    if step and tiers.gpu + step > states + cache + acts + logits:  # the optimizer step is the peak moment
        states, cache, acts, logits = tiers.gpu, 0, 0, 0
    else:
        step = 0
    device = states + cache + acts + logits + step
    if on_cuda:
        if expandable_segments is None:
            expandable_segments = cuda_allocator.expandable_segments()
        reserved = reserved_bytes(device, inp.stage, n_params, expandable_segments)
        return PeakPrediction(states, cache, acts, logits, 0, device, reserved, tiers.cpu, step)
    # NOTE: on the CPU everything lives in the one process: offloaded states and the token buffers too
    runtime = CPU_RUNTIME_BYTES + inp.token_buffer_bytes
    total = device + runtime + tiers.cpu
    return PeakPrediction(states, cache, acts, logits, runtime, total, total, tiers.cpu, step)


def compare_row(row: dict) -> dict:
    """A calibration row's measured peak beside the prediction for its recipe (and the ratio)."""
    from toolkit.recipe.load import load_recipe

    recipe = load_recipe(row["recipe"], row["overrides"])
    cuda = "cpu" not in row["device"]
    p = predict_peak(recipe, on_cuda=cuda, expandable_segments=cuda_allocator.expandable_segments(
        row.get("alloc_conf", "")))  # rows before the field: torch's default segments
    measured = row["mem_peak_bytes"]
    return {"measured": measured, "predicted": p.allocated, "ratio": p.allocated / measured,
            "measured_reserved": row.get("mem_reserved_peak_bytes") or 0, "predicted_reserved": p.reserved,
            "prediction": p}
