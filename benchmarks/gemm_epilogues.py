"""GPT-2's dense layers with cuBLASLt epilogues (benchmarks/gemm_epilogues.cpp) against the toolkit's ops, on the GPU.

Issue 33's lead for GPT-2 1.5B: fold the MLP's bias + GELU and the bias gradients into the GEMMs, as Transformer
Engine and apex's fused_dense do. For GPT-2 124M and 1.5B shapes, bf16: each epilogue's error against an fp32
reference beside the error of the ops it replaces, then GPU time of each epilogue against those ops, and of an MLP's
and a Conv1D's forward + backward both ways:

    python -m benchmarks.gemm_epilogues [--markdown out.md]

Measured and not adopted (benchmarks/RESULTS.md, "GEMM epilogues"): the forward's GELU_AUX_BIAS and the weight
gradients' BGRADB beat the ops they replace in isolation, but the MLP and the shipped recipes end to end did not move,
and DGELU_BGRAD (dropped from the .cpp) took twice the plain GEMM's time. The toolkit's MLP: the matmul, the fused
bias + GELU kernel, torch's addmm for c_proj, autograd's bias-gradient sum. The epilogue MLP: `gelu_mlp` below.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from toolkit.ops import custom_ops, loader, toolchain
from toolkit.resources import shipped_dir

SHAPES = {"gpt2-124m micro 32": (32 * 1024, 768), "gpt2-1.5b micro 16": (16 * 1024, 1600)}


def cublaslt_paths() -> tuple[str, str, str] | None:
    """(include folder, library folder, library file) of cuBLASLt: the CUDA toolkit's beside nvcc, else the pip
    wheel's that CUDA builds of torch depend on. The file is named in full: the wheels ship no unversioned link."""
    roots = []
    nvcc = toolchain.find_nvcc()
    if nvcc is not None:
        home = Path(nvcc).resolve().parent.parent
        roots += [(home / "include", home / "lib64"), (home / "include", home / "lib")]
    try:
        import nvidia  # the namespace package of NVIDIA's CUDA wheels
        roots += [(Path(base) / sub / "include", Path(base) / sub / "lib") for base in nvidia.__path__
                  for sub in ("cu13", "cu12", "cublas")]
    except ImportError:
        pass
    for include, lib in roots:
        names = sorted(p.name for p in lib.glob("libcublasLt.so*")) if lib.is_dir() else []
        if (include / "cublasLt.h").is_file() and names:
            return str(include), str(lib), names[0]  # the shortest name: the link, else the soname
    return None


def build_dense():
    from torch.utils.cpp_extension import load

    paths = cublaslt_paths()
    if paths is None:
        sys.exit("no cuBLASLt headers and library found")
    include, lib, name = paths
    start = time.perf_counter()
    module = load(name="toolkit_gemm_epilogues", sources=[str(Path(__file__).with_suffix(".cpp"))],
                  extra_include_paths=[str(shipped_dir("kernels")), include], extra_ldflags=[f"-L{lib}", f"-l:{name}"],
                  extra_cflags=["-O3"], with_cuda=True, verbose=False)
    print(f"built gemm_epilogues.cpp against {include} / {lib}/{name} in {time.perf_counter() - start:.1f} s")
    return module


# ---------------------------------------------------------------------------
# The epilogue MLP and Conv1D (transformers' Conv1D: y = x @ W + b, W [in, out])

def _rows(x):
    return x.reshape(-1, x.shape[-1]).contiguous()


def _gelu_backward(da, pre):
    """(da * gelu'(pre), its column sums): the bias + GELU op's backward with a zero bias (its kernel where loaded)."""
    dh, dbias = custom_ops.bias_gelu_bwd(da, pre, torch.zeros(pre.shape[-1], dtype=torch.float32, device=pre.device))
    return dh, dbias.to(pre.dtype)


class _GeluMLP(torch.autograd.Function):
    """c_proj(gelu_new(c_fc(x))): GELU_AUX_BIAS forward, BGRADB for c_proj's weight gradient."""

    @staticmethod
    def forward(ctx, x, w_fc, b_fc, w_proj, b_proj, module):
        x2 = _rows(x)
        a, pre = module.gelu_dense_fwd(x2, w_fc.contiguous(), b_fc.contiguous())
        y = torch.addmm(b_proj, a, w_proj)
        ctx.save_for_backward(x2, w_fc, a, pre, w_proj)
        ctx.module, ctx.shape = module, x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, w_fc, a, pre, w_proj = ctx.saved_tensors
        dy2 = _rows(dy)
        dw_proj_t, db_proj = ctx.module.wgrad_bgrad(a, dy2)
        dh, db_fc = _gelu_backward(dy2 @ w_proj.t(), pre)
        return (dh @ w_fc.t()).view(ctx.shape), x2.t() @ dh, db_fc, dw_proj_t.t(), db_proj, None


class _Conv1D(torch.autograd.Function):
    """x @ w + b, the bias gradient summed by the weight gradient's GEMM (BGRADB)."""

    @staticmethod
    def forward(ctx, x, w, b, module):
        x2 = _rows(x)
        y = torch.addmm(b, x2, w)
        ctx.save_for_backward(x2, w)
        ctx.module, ctx.shape = module, x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        dy2 = _rows(dy)
        dw_t, db = ctx.module.wgrad_bgrad(x2, dy2)
        return (dy2 @ w.t()).view(ctx.shape), dw_t.t(), db, None


# ---------------------------------------------------------------------------
# Measurements

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
    today_h = x @ w  # the toolkit's path: the product rounded, then bias + GELU in fp32
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
    for _ in range(3):  # also the first call's timing of cuBLASLt's candidate algorithms
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
    bias_gelu_ext = loader.load_extension("bias_gelu")

    def today():
        h = x @ w_fc
        a = custom_ops.bias_gelu(h, b_fc.float()) if bias_gelu_ext is not None else gelu_tanh(h + b_fc)
        torch.addmm(b_proj, a, w_proj).backward(dy)

    def fused():
        _GeluMLP.apply(x, w_fc, b_fc, w_proj, b_proj, module).backward(dy)

    w_attn = (torch.randn(width, 3 * width, generator=g, **bf) * width ** -0.5).requires_grad_()
    b_attn = torch.zeros(3 * width, **bf).requires_grad_()
    dq = torch.randn(rows, 3 * width, generator=g, **bf)

    def conv_today():
        torch.addmm(b_attn, x, w_attn).backward(dq)

    def conv_fused():
        _Conv1D.apply(x, w_attn, b_attn, module).backward(dq)

    parts = {}
    if bias_gelu_ext is not None:  # each epilogue against the ops it replaces, no autograd
        with torch.no_grad():
            xd, wd, bd = x.detach(), w_fc.detach(), b_fc.detach()
            b32 = bd.float()
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
