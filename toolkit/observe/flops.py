"""Model FLOPs utilisation (MFU): training FLOPs per token of a transformer, and
the peak FLOP/s of the device it runs on, from a small table of vendor specs.

MFU = (tokens/s x FLOPs per token) / (peak FLOP/s per device x devices). What does
not live here: measuring tokens/s (toolkit/train/loop.py) or memory (toolkit/observe/memory_monitor.py).
No torch import at module level: the start-up table and tests use it freely.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

TFLOPS = 10**12


# ---------------------------------------------------------------------------
# FLOPs per token

def matmul_parameters(model) -> int:
    """N for the 6N term: every parameter that takes part in a matmul per token (see flops_per_token)."""
    from torch import nn

    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    output_weight = id(output.weight) if output is not None else None
    # Embedding tables are gathered from, not multiplied: no FLOPs. A tied table that is
    # also the output head (GPT-2's wte / lm_head) does a V x d matmul per token and counts.
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} - {output_weight}
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) in seen or id(p) in lookups:
            continue
        seen.add(id(p))
        n += p.numel()
    return n


def flops_per_token(n_params: int, n_layer: int, n_embd: int, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token: 6N + 12 * n_layer * n_embd * seq_len."""
    # PaLM (Chowdhery et al. 2022), appendix B, and nanoGPT's `estimate_mfu`:
    #   6N: each parameter does one multiply-add (2 FLOPs) per token forward and two
    #       (4 FLOPs) backward (gradients w.r.t. inputs and w.r.t. weights).
    #   12 * L * H * Q * T: attention's two matmuls (Q K^T and scores x V) have no weights;
    #       per token per layer they cost 2 * 2 * d * T forward (d = H * Q = n_embd, the
    #       query width, also under GQA), times 3 for forward + backward.
    # NOTE: which N. Not "all parameters": an embedding lookup is a gather and costs no
    # FLOPs, so the token table (when not tied to the head) and GPT-2's position table
    # are left out. Not Kaplan's "non-embedding" either: the output head is a real
    # V x n_embd matmul per token (the largest one in a small model), so it counts, tied
    # or not. This is nanoGPT's choice (wpe out, the tied wte in) made general: for
    # GPT-2 124M, N = 124.44M - 0.79M (wpe) = 123.65M, nanoGPT's count. See `matmul_parameters`.
    # NOTE: MFU, not HFU: the causal mask's skipped half of attention still counts (the
    # convention), and activation checkpointing's recomputed forward does not.
    return 6 * n_params + 12 * n_layer * n_embd * seq_len


# ---------------------------------------------------------------------------
# Peak FLOP/s per device and dtype

# Dense tensor-core peaks in TFLOP/s, no sparsity, from the vendors' datasheets. Where a
# datasheet prints only the 2:4-sparsity figure (marked with *), the dense one is half.
# "fp32" is plain FP32 (CUDA cores): torch's default for fp32 matmuls; "tf32" applies
# when torch.backends.cuda.matmul.allow_tf32 (float32_matmul_precision "high"/"medium").
# bf16 and fp16 are with fp32 accumulation, as torch's GEMMs run them.
PEAK_TFLOPS = {
    # NVIDIA H100 Tensor Core GPU datasheet: SXM5 and PCIe columns.
    "H100 SXM": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0},
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    # NVIDIA H200 Tensor Core GPU datasheet: H200 SXM (same compute as H100 SXM) and H200 NVL.
    "H200": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
    "H200 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    # NVIDIA A100 Tensor Core GPU datasheet (40 GB and 80 GB, SXM and PCIe share the peaks).
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    # NVIDIA A10 datasheet.
    "A10": {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
    # NVIDIA L4 datasheet (FP32 30.3; TF32 120*, BF16/FP16 242*).
    "L4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
    # NVIDIA L40S datasheet (TF32 183, BF16/FP16 362.05 dense).
    "L40S": {"fp32": 91.6, "tf32": 183.0, "bf16": 362.0, "fp16": 362.0},
    # NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090 (FP16/BF16 with FP32 accumulate).
    "RTX 4090": {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2},
    # NVIDIA V100 datasheet, SXM2 (no bf16 tensor cores: bf16 is left out, so no MFU for it).
    "V100": {"fp32": 15.7, "fp16": 125.0},
    # NVIDIA T4 datasheet (FP16 mixed precision 65; no bf16 tensor cores).
    "T4": {"fp32": 8.1, "fp16": 65.0},
    # AMD Instinct MI300X datasheet (matrix peaks, dense).
    "MI300X": {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4},
}

# How torch.cuda.get_device_name spells them -> table key; first match wins, so the more
# specific names come first. A MIG slice has a fraction of the chip: never matched.
_NAME_PATTERNS = [
    (r"H100.*NVL", "H100 NVL"),
    (r"H100.*PCIE", "H100 PCIe"),
    (r"H100", "H100 SXM"),  # "NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 ..."
    (r"H200.*NVL", "H200 NVL"),
    (r"H200", "H200"),
    (r"A100", "A100"),
    (r"\bA10\b", "A10"),  # not the A10G (a different part with its own peaks)
    (r"L40S", "L40S"),
    (r"\bL4\b", "L4"),
    (r"RTX 4090", "RTX 4090"),
    (r"V100", "V100"),
    (r"\bT4\b", "T4"),
    (r"MI300X", "MI300X"),
]


def device_key(device_name: str) -> str | None:
    """The PEAK_TFLOPS key for a device name as torch reports it, or None when unknown."""
    if "MIG" in device_name.upper().split():
        return None
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return key
    return None


def matmul_dtype(dtype: str) -> str:
    """The table column a recipe precision runs its matmuls in (fp32 -> tf32 when torch allows it)."""
    if dtype != "fp32":
        return dtype
    import torch

    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of one device for a table dtype (fp32, tf32, bf16, fp16), or None when unknown."""
    key = device_key(device_name)
    if key is None or dtype not in PEAK_TFLOPS[key]:
        return None
    return PEAK_TFLOPS[key][dtype] * TFLOPS


_warned_peaks: set[tuple[str, str]] = set()  # (device, dtype) already warned about in this process


def unknown_peak_warning(basis: "MfuBasis") -> str | None:
    """The warning a run prints once per process and device when MFU cannot be computed honestly.

    None when the peak is known, on a CPU (no datasheet peak fits it: the start-up table says so
    and how to set one) and after the first time.
    """
    key = (basis.device_name, basis.dtype)
    if basis.peak_flops is not None or basis.device_name == "CPU" or key in _warned_peaks:
        return None
    _warned_peaks.add(key)
    return (f"warning: no peak FLOP/s for {basis.device_name!r} in {basis.dtype} in the toolkit's datasheet table: "
            f"MFU is not reported; set recipe.training.peak_tflops to the device's dense {basis.dtype} peak "
            "(TFLOP/s per device) to get it")


def mfu(tokens_per_s: float, flops_per_token: int, peak_flops_per_device: float, devices: int) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all devices."""
    return tokens_per_s * flops_per_token / (peak_flops_per_device * devices)


# ---------------------------------------------------------------------------
# What a run's MFU is computed from

def device_name(device) -> str:
    """The accelerator's marketing name as torch reports it ("NVIDIA H200"), or "CPU"."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


@dataclass(frozen=True)
class MfuBasis:
    """FLOPs per token and peak FLOP/s, fixed at start and printed in the start-up table."""

    device_name: str
    dtype: str  # the PEAK_TFLOPS column: fp32, tf32, bf16 or fp16
    n_params: int  # N of the 6N term (matmul_parameters)
    flops_per_token: int
    peak_flops: float | None  # per device; None: unknown, so no MFU
    devices: int
    peak_source: str = "vendor datasheet"  # or "recipe.training.peak_tflops"

    def mfu(self, tokens_per_s: float) -> float | None:
        """MFU for a measured global tokens/s, or None when the peak is unknown."""
        if self.peak_flops is None:
            return None
        return mfu(tokens_per_s, self.flops_per_token, self.peak_flops, self.devices)

    def describe_peak(self) -> str:
        """The start-up table's peak FLOP/s cell."""
        if self.peak_flops is None:
            return (f"peak FLOP/s unknown for {self.dtype} on this device: MFU not reported "
                    "(training.peak_tflops sets one)")
        return f"peak {self.peak_flops / TFLOPS:g} TFLOP/s {self.dtype} dense per device ({self.peak_source}) for MFU"

    def describe_flops(self) -> str:
        """The start-up table's FLOPs-per-token cell."""
        return (f"{self.flops_per_token / 1e6:.2f} MFLOPs per token = 6 x {self.n_params / 1e6:.2f}M matmul "
                f"parameters + attention 12 x layers x width x seq_len")


def mfu_basis(model, seq_len: int, precision_dtype: str, device, devices: int,
              peak_tflops: float | None = None) -> MfuBasis:
    """The MFU basis of a transformers model trained at `seq_len` in a recipe precision on `device`.

    peak_tflops (recipe.training.peak_tflops) replaces the datasheet table, and is the only peak on a CPU.
    """
    config = model.config  # transformers maps num_hidden_layers / hidden_size for every family
    n_params = matmul_parameters(model)
    name = device_name(device)
    dtype = matmul_dtype(precision_dtype) if device.type == "cuda" else precision_dtype
    if peak_tflops is not None:
        peak, source = peak_tflops * TFLOPS, "recipe.training.peak_tflops"
    else:
        peak, source = (peak_flops(name, dtype) if device.type == "cuda" else None), "vendor datasheet"
    return MfuBasis(device_name=name, dtype=dtype, n_params=n_params,
                    flops_per_token=flops_per_token(n_params, config.num_hidden_layers, config.hidden_size, seq_len),
                    peak_flops=peak, devices=devices, peak_source=source)
