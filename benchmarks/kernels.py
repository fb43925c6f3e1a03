"""Benchmark (not a test): the fused CUDA kernels against torch, on one GPU.

Sections (each a table; `--only` picks some):
  copy      device-to-device copy of 2 GiB: the bandwidth ceiling (bytes read + written)
  adamw     one AdamW step over GPT-2 124M and 1.5B parameter sets (transformers' shapes,
            wte tied), fp32 states: toolkit adamw_step (one call), FusedAdamW.step(),
            torch AdamW fused=True and foreach=True; ms per step (median of repeats of
            a timed loop, so host overhead counts), GB/s at 28 bytes per parameter, and
            that as a share of the copy bandwidth
  layers    LayerNorm (GPT-2 124M / 1.5B rows), RMSNorm (Llama 1B), bias + GELU (GPT-2
            MLP), cross-entropy (GPT-2 vocab, bf16 logits) at micro batch 16 x 1024
            tokens, forward and forward+backward: toolkit op vs torch eager vs
            torch.compile of the same eager code; GB/s from the bytes each must move

    python -m benchmarks.kernels [--only copy,adamw,layers] [--markdown FILE]

Timing: wall = CUDA events around a loop of calls, after warm-up (and compilation),
median of 5 repeats (host overhead counts where the host is the limit); GPU = the
kernels' own durations from torch.profiler. Inputs are random, never zeros.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from toolkit.ops import custom_ops, loader
from toolkit.ops.fused_adamw import FusedAdamW, adamw_step

TOKENS = 16 * 1024  # micro batch 16 x sequence 1024
LR, BETAS, EPS, WD = 6e-4, (0.9, 0.95), 1e-8, 0.1


def time_ms(fn, iters: int = 20, repeats: int = 5, warmup: int = 3) -> float:
    """Median over repeats of (elapsed of `iters` back-to-back calls) / iters, in ms."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def _profiled_us(fn, iters: int) -> dict[str, float]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / iters for e in prof.key_averages() if e.device_type == DeviceType.CUDA}


_L2 = {"buffer": None, "on": False, "flushes": 0}


def _overwrite_l2() -> None:
    if _L2["buffer"] is None:
        _L2["buffer"] = torch.empty(2**26, dtype=torch.float32, device="cuda")
    _L2["buffer"].zero_()


def flush_l2() -> None:
    """Overwrite 256 MB (5x an H200's L2), as triton.testing.do_bench does before each call; a no-op
    except inside kernel_us(..., cold_l2=True), so a timed call may flush between its own steps."""
    if _L2["on"]:
        _overwrite_l2()
        _L2["flushes"] += 1


def backward_after_flush(out: torch.Tensor) -> torch.Tensor:
    """out, with the L2 overwritten right before its backward starts (a hook on its grad_fn): what a
    training step's backward finds, other layers having run between a layer's forward and backward."""
    out.grad_fn.register_prehook(lambda grad_outputs: flush_l2())
    return out


def kernel_us(fn, iters: int = 10, cold_l2: bool = False) -> dict[str, float]:
    """GPU microseconds per call of each kernel (and copy) `fn` launches, from the profiler.

    cold_l2: the L2 cache overwritten before each call, and wherever fn calls flush_l2 (the flushes'
    own time taken out), so no call reads what the one before left in L2. Back to back, a call can:
    torch.compile's RMSNorm backward measured 83 us after its forward, 91 under Nsight Compute, which
    flushes the caches before each kernel (and locks the clocks); ours 91 and 92.
    """
    warm = _profiled_us(fn, iters)  # flush_l2 is off: which kernels fn launches itself
    if not cold_l2:
        return warm
    _L2["on"] = True
    try:
        flush = _profiled_us(_overwrite_l2, iters)
        calls = [0]

        def flushed():
            calls[0] += 1
            flush_l2()
            fn()

        _L2["flushes"] = 0
        cold = _profiled_us(flushed, iters)
        per_call = _L2["flushes"] / calls[0]
    finally:
        _L2["on"] = False
    # Only the kernels fn launches itself count: the flush's kernel is dropped by name, so its
    # run-to-run noise stays out of the total, and subtracted only where fn launches it too (a fill).
    return {key: cold.get(key, 0.0) - per_call * flush.get(key, 0.0) for key in warm}


def gpu_ms(fn, iters: int = 10, cold_l2: bool = False) -> float:
    """GPU time of one call: the sum of its kernels' (and copies') durations from the profiler, in ms
    (cold_l2: as kernel_us's).

    NOTE: the wall figure of time_ms includes host overhead when the host, not the GPU, is the limit
    (custom ops, compiled-function guards at these sizes); this one is the kernels alone.
    """
    return sum(kernel_us(fn, iters, cold_l2).values()) / 1e3


def table(title: str, header: list[str], rows: list[list]) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# copy

def bench_copy() -> tuple[float, str]:
    src = torch.randn(2**29, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters=10)
    gbps = 2 * src.numel() * 4 / ms / 1e6
    del src, dst
    return gbps, table("Device-to-device copy (the bandwidth ceiling)", ["bytes moved", "ms", "GB/s"],
                       [[f"{2 * 2**31 / 1e9:.2f} GB", f"{ms:.3f}", f"{gbps:.0f}"]])


# ---------------------------------------------------------------------------
# AdamW

def gpt2_shapes(width: int, layers: int, vocab: int = 50257, positions: int = 1024) -> list[tuple[int, ...]]:
    """transformers GPT2LMHeadModel parameter shapes (wte tied to lm_head: counted once)."""
    shapes = [(vocab, width), (positions, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,),
                   (width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width), (width,)]
    return shapes + [(width,), (width,)]


def bench_adamw(copy_gbps: float) -> str:
    rows = []
    for label, shapes in (("GPT-2 124M", gpt2_shapes(768, 12)), ("GPT-2 1.5B", gpt2_shapes(1600, 48))):
        params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        n = sum(p.numel() for p in params)
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = lambda: [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]  # noqa: E731
        iters = 20 if n < 5e8 else 5
        variants = {}
        state = [torch.zeros_like(p) for p in params], [torch.rand_like(p) * 1e-6 for p in params]
        grads = [p.grad for p in params]
        if loader.loaded_extension("adamw") is not None:
            variants["toolkit adamw_step (one call)"] = lambda: adamw_step(
                params, grads, state[0], state[1], lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                weight_decay=WD, step=10)
            lowp = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
            variants["toolkit adamw_step + bf16 copy (30 B/param)"] = lambda: adamw_step(
                params, grads, state[0], state[1], lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                weight_decay=WD, step=10, lowp=lowp)
            fused = FusedAdamW(groups(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
            variants["toolkit FusedAdamW.step()"] = fused.step
        results, kernels = {}, {}
        for name, fn in variants.items():
            results[name] = time_ms(fn, iters=iters)
            kernels[name] = gpu_ms(fn, iters=3)
        del state, variants
        if "toolkit FusedAdamW.step()" in results:
            fused.state.clear()
        for name, kwargs in (("torch AdamW fused=True", {"fused": True}), ("torch AdamW foreach=True", {"foreach": True})):
            opt = torch.optim.AdamW(groups(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kwargs)
            results[name] = time_ms(opt.step, iters=iters)
            kernels[name] = gpu_ms(opt.step, iters=3)
            opt.state.clear()
            del opt
        torch.cuda.empty_cache()
        torch_fused = results["torch AdamW fused=True"]
        for name, ms in results.items():
            per_param = 30 if "bf16 copy" in name else 28
            gbps = n * per_param / ms / 1e6
            rows.append([label, name, f"{ms:.3f}", f"{kernels[name]:.3f}", f"{gbps:.0f}",
                         f"{100 * gbps / copy_gbps:.0f}%", f"{torch_fused / ms:.2f}x"])
        del params, grads
        torch.cuda.empty_cache()
    return table(f"AdamW step (fp32 params, grads, moments; 28 B/param; copy = {copy_gbps:.0f} GB/s)",
                 ["parameters", "implementation", "ms per step", "GPU ms", "GB/s (ms per step)", "of copy",
                  "vs torch fused"], rows)


# ---------------------------------------------------------------------------
# Layers: toolkit op vs eager vs torch.compile

def gelu_new(u):
    return 0.5 * u * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (u + 0.044715 * torch.pow(u, 3.0))))


def layer_cases():
    """(name, make_inputs, toolkit_fn, eager_fn, fwd_bytes, bwd_bytes, also torch.compile?)."""
    bf16 = torch.bfloat16
    cases = []
    for label, width in (("GPT-2 124M", 768), ("GPT-2 1.5B", 1600)):
        def make(width=width):
            x = torch.randn(TOKENS, width, device="cuda", requires_grad=True)
            w = (torch.rand(width, device="cuda") + 0.5).requires_grad_()
            b = torch.randn(width, device="cuda", requires_grad=True)
            return (x, w, b), torch.randn(TOKENS, width, device="cuda", dtype=bf16)
        n = TOKENS * width
        # NOTE: the autocast case: fp32 residual in, bf16 out (what the next matmul reads).
        cases.append((f"LayerNorm {label} [{TOKENS}x{width}] fp32->bf16", make,
                      lambda x, w, b: custom_ops.layer_norm(x, w, b, 1e-5, out_dtype=bf16),
                      lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5).to(bf16),
                      n * 6, n * 10, width == 768))

    def make_rms(width=2048):
        x = torch.randn(TOKENS, width, device="cuda", requires_grad=True)
        w = (torch.rand(width, device="cuda") + 0.5).requires_grad_()
        return (x, w), torch.randn(TOKENS, width, device="cuda", dtype=bf16)

    def hf_rms(x, w, eps=1e-6):
        variance = x.pow(2).mean(-1, keepdim=True)
        return (w * (x * torch.rsqrt(variance + eps))).to(bf16)

    cases.append((f"RMSNorm Llama 1B [{TOKENS}x2048] fp32->bf16", make_rms,
                  lambda x, w: custom_ops.rms_norm(x, w, 1e-6, out_dtype=bf16), hf_rms, TOKENS * 2048 * 6,
                  TOKENS * 2048 * 10, True))
    for label, width in (("GPT-2 124M", 3072), ("GPT-2 1.5B", 6400)):
        def make_gelu(width=width):
            h = torch.randn(TOKENS, width, device="cuda", dtype=bf16, requires_grad=True)
            b = torch.randn(width, device="cuda", requires_grad=True)
            return (h, b), torch.randn(TOKENS, width, device="cuda", dtype=bf16)
        n = TOKENS * width
        cases.append((f"bias+GELU {label} [{TOKENS}x{width}] bf16", make_gelu, custom_ops.bias_gelu,
                      lambda h, b: gelu_new(h + b.to(h.dtype)), n * 4, n * 6, width == 3072))

    def make_ce(vocab=50257):
        logits = (torch.randn(TOKENS, vocab, device="cuda") * 2).to(bf16).requires_grad_()
        targets = torch.randint(0, vocab, (TOKENS,), device="cuda")
        return (logits, targets), None

    n = TOKENS * 50257
    cases.append((f"cross-entropy GPT-2 [{TOKENS}x50257] bf16 logits", make_ce, custom_ops.cross_entropy,
                  lambda logits, t: F.cross_entropy(logits.float(), t), n * 2, n * 4, True))
    return cases


def bench_layers(copy_gbps: float) -> str:
    rows = []
    for name, make, toolkit_fn, eager_fn, fwd_bytes, bwd_bytes, with_compile in layer_cases():
        inputs, dy = make()
        grads_of = [t for t in inputs if t.requires_grad]
        torch._dynamo.reset()
        started = time.perf_counter()
        impls = {"toolkit": toolkit_fn, "torch eager": eager_fn}
        if with_compile:  # NOTE: compiling costs ~20 s a case; the large cases show toolkit vs eager only
            impls["torch.compile"] = torch.compile(eager_fn)
        for impl, fn in impls.items():
            def forward(fn=fn):
                with torch.no_grad():
                    fn(*inputs)

            def forward_backward(fn=fn, flush_between=False):
                out = fn(*inputs)
                if flush_between:  # out of the wall timings: the hook is a Python call
                    backward_after_flush(out)
                torch.autograd.grad(out, grads_of, dy if dy is not None else None)

            fwd_ms, both_ms = time_ms(forward), time_ms(forward_backward)
            fwd_gpu, both_gpu = gpu_ms(forward), gpu_ms(forward_backward)
            both_cold = gpu_ms(lambda: forward_backward(flush_between=True), cold_l2=True)
            rows.append([name, impl, f"{fwd_ms:.3f}", f"{fwd_gpu:.3f}", f"{fwd_bytes / fwd_gpu / 1e6:.0f}",
                         f"{both_ms:.3f}", f"{both_gpu:.3f}", f"{(fwd_bytes + bwd_bytes) / both_gpu / 1e6:.0f}",
                         f"{100 * (fwd_bytes + bwd_bytes) / both_gpu / 1e6 / copy_gbps:.0f}%", f"{both_cold:.3f}"])
        print(f"  {name}: done in {time.perf_counter() - started:.0f}s (compile included)", flush=True)
        del inputs, dy, grads_of
        torch.cuda.empty_cache()
    return table(f"Layers, forward and forward+backward (wall ms per call; GPU ms = kernel time; GB/s from "
                 f"GPU ms and the bytes each must move; copy = {copy_gbps:.0f} GB/s; cold L2: GPU ms with the L2 "
                 f"overwritten before the forward and again before the backward)",
                 ["case", "implementation", "fwd wall ms", "fwd GPU ms", "fwd GB/s", "fwd+bwd wall ms",
                  "fwd+bwd GPU ms", "fwd+bwd GB/s", "of copy", "fwd+bwd GPU ms, cold L2"], rows)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="copy,adamw,layers")
    parser.add_argument("--markdown", default=None, help="also write the tables to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark", file=sys.stderr)
        return 2
    only = set(args.only.split(","))
    statuses = loader.build_all()
    header = (f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
              f"kernels: {', '.join(f'{s.name} {s.state}' for s in statuses)}\n")
    print(header, flush=True)
    out = [header]
    copy_gbps, text = bench_copy()
    out.append(text)
    print(text, flush=True)
    if "adamw" in only:
        text = bench_adamw(copy_gbps)
        out.append(text)
        print(text, flush=True)
    if "layers" in only:
        text = bench_layers(copy_gbps)
        out.append(text)
        print(text, flush=True)
    if args.markdown:
        Path(args.markdown).write_text("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
