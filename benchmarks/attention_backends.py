"""Benchmark (not a test): torch's attention backends at the shipped recipes' shapes, on one GPU.

`scaled_dot_product_attention` picks a backend by a fixed priority (flash first; newer torch prefers cuDNN on
some GPUs). This times forward + backward of causal bf16 attention for the default choice and for each backend
forced (`torch.nn.attention.sdpa_kernel`), names the kernel the default ran (the profiler's largest attention
kernel), and checks each backend's output and input gradients against float32 math attention.

    python -m benchmarks.attention_backends [--markdown FILE] [--rounds N]
"""
from __future__ import annotations

import argparse
from pathlib import Path
from statistics import median

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# (name, batch, heads, sequence, head dim): the shipped recipes' micro batches
SHAPES = (("gpt2-124m, micro 32", 32, 12, 1024, 64), ("gpt2-124m, micro 64", 64, 12, 1024, 64),
          ("gpt2-1.5b-h200, micro 16", 16, 25, 1024, 64), ("llama-1b, micro 16", 16, 32, 1024, 64),
          ("llama-3b, micro 4 x 2048", 4, 24, 2048, 128))
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _inputs(b, h, s, d, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = [torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)]
    q, k, v, grad = make
    return [t.requires_grad_() for t in (q, k, v)], grad


def _step(q, k, v, grad, backend):
    for t in (q, k, v):
        t.grad = None
    if backend is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(grad)
    return out


def _time_ms(fn, rounds: int) -> float:
    """Median GPU ms of forward + backward over `rounds` timed calls (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return median(times)


def _default_kernel(q, k, v, grad) -> str:
    """The forward kernel the default choice ran: the profiler's attention-looking kernel with the most GPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(q, k, v, grad, None)
        torch.cuda.synchronize()
    names = [(e.device_time_total, e.key) for e in prof.key_averages()
             if any(word in e.key.lower() for word in ("flash", "fmha", "sdpa", "attention", "cudnn"))]
    return max(names)[1][:90] if names else "?"


def _errors(q, k, v, grad, backend):
    """Max abs error of the output and of dq, dk, dv against float32 math attention."""
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.MATH]):
        ref_out = F.scaled_dot_product_attention(*ref, is_causal=True)
    ref_out.backward(grad.float())
    out = _step(q, k, v, grad, backend)
    errs = [(out.float() - ref_out).abs().max().item()]
    errs += [(t.grad.float() - r.grad).abs().max().item() for t, r in zip((q, k, v), ref)]
    return max(errs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    lines = [f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}; "
             f"causal bf16 attention, forward + backward, median GPU ms of {args.rounds}; error: max abs of the "
             "output and dq/dk/dv against float32 math", "",
             "| shape | default (its kernel) | default ms | " + " | ".join(f"{n} ms (error)" for n in BACKENDS) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in BACKENDS) + " |"]
    for name, b, h, s, d in SHAPES:
        (q, k, v), grad = _inputs(b, h, s, d)
        cells = []
        for label, backend in BACKENDS.items():
            try:
                ms = _time_ms(lambda: _step(q, k, v, grad, backend), args.rounds)
                cells.append(f"{ms:.3f} ({_errors(q, k, v, grad, backend):.1e})")
            except RuntimeError as exc:  # a backend that cannot serve this shape
                cells.append(f"- ({str(exc).splitlines()[0][:50]})")
        default_ms = _time_ms(lambda: _step(q, k, v, grad, None), args.rounds)
        row = f"| {name} | {_default_kernel(q, k, v, grad)} | {default_ms:.3f} | " + " | ".join(cells) + " |"
        print(row, flush=True)
        lines.append(row)
        del q, k, v, grad
        torch.cuda.empty_cache()
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
