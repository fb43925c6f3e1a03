"""GPT-2's dense layers with cuBLASLt epilogues (kernels/fused_dense.cpp) against today's ops, on the GPU (issue 33).

For GPT-2 124M and 1.5B shapes, bf16: each epilogue's error against an fp32 reference beside the error of the ops it
replaces, then GPU time of an MLP's forward + backward and of a Conv1D's backward, both ways:

    python -m benchmarks.gemm_epilogues [--markdown out.md]

Today's MLP: the matmul, the fused bias + GELU kernel (its torch reference where the extension is not built), torch's
addmm for c_proj, autograd's bias-gradient sum. The epilogue MLP: toolkit.ops.dense_ops.gelu_mlp.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from toolkit.ops import dense_ops, loader, toolchain
from toolkit.resources import shipped_dir

SHAPES = {"gpt2-124m micro 32": (32 * 1024, 768), "gpt2-1.5b micro 16": (16 * 1024, 1600)}


def build_dense():
    from torch.utils.cpp_extension import load

    paths = toolchain.cublaslt_paths()
    if paths is None:
        sys.exit("no cuBLASLt headers and library found")
    include, lib, name = paths
    kernels = shipped_dir("kernels")
    start = time.perf_counter()
    module = load(name="toolkit_dense_bench", sources=[str(kernels / "fused_dense.cpp")],
                  extra_include_paths=[str(kernels), include], extra_ldflags=[f"-L{lib}", f"-l:{name}"],
                  extra_cflags=["-O3"], with_cuda=True, verbose=False)
    print(f"built fused_dense.cpp against {include} / {lib}/{name} in {time.perf_counter() - start:.1f} s")
    return module


def gelu_tanh(u):
    return F.gelu(u, approximate="tanh")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def accuracy(module, rows, width):
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, width, generator=g, **bf)
    w = (torch.randn(width, 4 * width, generator=g, **bf) * width ** -0.5).to(torch.bfloat16)
    b = torch.randn(4 * width, generator=g, **bf) * 0.1
    dy = torch.randn(rows, width, generator=g, **bf)
    pre32 = x.float() @ w.float() + b.float()
    out, pre = module.gelu_dense_fwd(x, w, b)
    today_h = x @ w  # the unfused path: the product rounded, then bias + GELU in fp32
    today = gelu_tanh(today_h.float() + b.float())
    rows_out = {"forward: GELU output": (rel(out, gelu_tanh(pre32)), rel(today.bfloat16(), gelu_tanh(pre32))),
                "forward: GELU input (aux)": (rel(pre, pre32), rel((today_h.float() + b.float()).bfloat16(), pre32))}
    a = out
    dw_t, dbp = module.wgrad_bgrad(a, dy)
    dw32 = a.float().t() @ dy.float()
    rows_out["backward: weight gradient (BGRADB GEMM)"] = (rel(dw_t.t(), dw32), rel(a.t() @ dy, dw32))
    rows_out["backward: bias gradient (BGRADB)"] = (rel(dbp, dy.float().sum(0)), rel(dy.sum(0), dy.float().sum(0)))
    return rows_out


def gpu_ms(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def timings(module, rows, width):
    g = torch.Generator(device="cuda").manual_seed(1)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, width, generator=g, **bf).requires_grad_()
    w_fc = (torch.randn(width, 4 * width, generator=g, **bf) * width ** -0.5).requires_grad_()
    b_fc = torch.zeros(4 * width, **bf).requires_grad_()
    w_proj = (torch.randn(4 * width, width, generator=g, **bf) * (4 * width) ** -0.5).requires_grad_()
    b_proj = torch.zeros(width, **bf).requires_grad_()
    dy = torch.randn(rows, width, generator=g, **bf)
    from toolkit.ops import custom_ops
    bias_gelu_ext = loader.load_extension("bias_gelu")

    def today():
        h = x @ w_fc
        a = custom_ops.bias_gelu(h, b_fc.float()) if bias_gelu_ext is not None else gelu_tanh(h + b_fc)
        torch.addmm(b_proj, a, w_proj).backward(dy)

    def fused():
        dense_ops.gelu_mlp(x, w_fc, b_fc, w_proj, b_proj, module).backward(dy)

    w_attn = (torch.randn(width, 3 * width, generator=g, **bf) * width ** -0.5).requires_grad_()
    b_attn = torch.zeros(3 * width, **bf).requires_grad_()
    dq = torch.randn(rows, 3 * width, generator=g, **bf)

    def conv_today():
        torch.addmm(b_attn, x, w_attn).backward(dq)

    def conv_fused():
        dense_ops.conv1d(x, w_attn, b_attn, module).backward(dq)

    parts = {}
    if bias_gelu_ext is not None:  # each epilogue against the ops it replaces, no autograd
        with torch.no_grad():
            xd, wd, w2d, bd = x.detach(), w_fc.detach(), w_proj.detach(), b_fc.detach()
            b32, zero32 = bd.float(), torch.zeros_like(bd, dtype=torch.float32)
            _, pre = module.gelu_dense_fwd(xd, wd, bd)
            a = bias_gelu_ext.bias_gelu_fwd(xd @ wd, b32)
            parts = {
                "GEMM alone (x @ w_fc)": (gpu_ms(lambda: xd @ wd), None),
                "forward: GEMM + bias_gelu kernel / GELU_AUX_BIAS": (
                    gpu_ms(lambda: bias_gelu_ext.bias_gelu_fwd(xd @ wd, b32)),
                    gpu_ms(lambda: module.gelu_dense_fwd(xd, wd, bd))),
                "weight gradient: GEMM + sum / BGRADB": (
                    gpu_ms(lambda: (a.t() @ dy, dy.sum(0))), gpu_ms(lambda: module.wgrad_bgrad(a, dy))),
            }
    return {**parts, "MLP forward + backward": (gpu_ms(today), gpu_ms(fused)),
            "c_attn Conv1D forward + backward": (gpu_ms(conv_today), gpu_ms(conv_fused)),
            "bias_gelu kernel": bias_gelu_ext is not None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown")
    args = parser.parse_args(argv)
    module = build_dense()
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}", "",
             "| shape | quantity | epilogue rel. error | today's rel. error |", "| --- | --- | --- | --- |"]
    for label, (rows, width) in SHAPES.items():
        for what, (new, old) in accuracy(module, rows, width).items():
            lines.append(f"| {label} | {what} | {new:.2e} | {old:.2e} |")
    lines += ["", "| shape | GPU ms, median of 20 | today | epilogues | speed-up |", "| --- | --- | --- | --- | --- |"]
    for label, (rows, width) in SHAPES.items():
        result = timings(module, rows, width)
        for what, value in result.items():
            if isinstance(value, tuple) and value[1] is None:
                lines.append(f"| {label} | {what} | {value[0]:.3f} | | |")
            elif isinstance(value, tuple):
                lines.append(f"| {label} | {what} | {value[0]:.3f} | {value[1]:.3f} | {value[0] / value[1]:.2f}x |")
        today = "the fused kernel" if result["bias_gelu kernel"] else "torch"
        lines.append(f"| {label} | (today's bias + GELU: {today}) | | | |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
