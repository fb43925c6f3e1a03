"""Tuning sweep (not a test): launch shapes of the norm kernels, timed side by side on one GPU.

kernels/fused_norm_backward.cu takes its launch shape from macros: TOOLKIT_NORM_BWD_PER
(elements per thread), _ROWS (rows a row group takes per iteration), _BLOCK (threads per
block), _MIN_BLOCKS (__launch_bounds__'s blocks per SM, which caps registers) and _PREFETCH
(load the next rows while reducing these); set together they replace the shipped shape of
both norms (each shape covers rows of up to P * B columns). Optional name=N tails set the
other knobs (EXTRAS): x, the forward's 4-element packs per thread at most (which sets its warps
per row); fm, the forward's blocks per SM for __launch_bounds__; fp, the forward's persistent
grid (1; 2 with w and b in registers); fs and s, the forward's and the backward's cache hints
(a bit mask: 1 streaming loads, 2 streaming stores, 4 loads that skip L1); w=0, the backward
reads w per row; b, the backward's stages of rows bulk-copied into shared memory; c, the column
sums' columns per block (8, 16, 32). This builds the norm extension once per shape
(in parallel, each in its own folder), checks each against a float64 reference, and times
its forward and its backward (GPU ms from the profiler) on the benchmark's shapes, beside
torch.compile's (its backward: forward+backward minus forward).

    python -m benchmarks.norm_tune [--shapes P,R,B,M,F[,name=N...];...] [--no-compile] [--rounds N]
        [--cold-l2] [--markdown FILE]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from statistics import median

import torch
import torch.nn.functional as F

from benchmarks.kernels import TOKENS, backward_after_flush, gpu_ms, kernel_us, table
from toolkit.ops import loader

MACROS = ("PER", "ROWS", "BLOCK", "MIN_BLOCKS", "PREFETCH")
# Optional name=value tails, each setting macros (the per-norm ones for both norms).
EXTRAS = {"x": ("TOOLKIT_NORM_FWD_MAX_PACKS",), "fm": ("TOOLKIT_NORM_FWD_MIN_BLOCKS",),
          "fs": ("TOOLKIT_NORM_FWD_STREAM_LN", "TOOLKIT_NORM_FWD_STREAM_RMS"), "fp": ("TOOLKIT_NORM_FWD_PERSISTENT",),
          "s": ("TOOLKIT_NORM_BWD_STREAM_LN", "TOOLKIT_NORM_BWD_STREAM_RMS"),
          "w": ("TOOLKIT_NORM_BWD_W_REGS_LN", "TOOLKIT_NORM_BWD_W_REGS_RMS"),
          "b": ("TOOLKIT_NORM_BWD_BULK_LN", "TOOLKIT_NORM_BWD_BULK_RMS"), "c": ("TOOLKIT_COLUMN_SUM_TILE",)}
# (P, R, B, M, F); "8,1,32,1,0" sends every benchmark row to the wide shape (8 per thread,
# 512-thread row-group blocks, 1024 launch bound): the layout before the narrow shape existed.
SHAPES = ("8,1,32,1,0", "8,1,512,1,0", "8,1,512,2,0", "4,1,512,2,0", "4,1,512,2,1", "4,2,512,2,0",
          "4,1,256,4,1", "2,2,512,2,1", "4,2,256,4,0")
COLD_L2 = False  # --cold-l2
CASES = (("LayerNorm 768", 768, False), ("LayerNorm 1600", 1600, False), ("RMSNorm 2048", 2048, True))


def build(shape: str):
    """Build (or find built) the norm extension for one shape; returns (name, directory, flags, error)."""
    from torch.utils.cpp_extension import load

    plan = loader.build_plan("norm")
    values = shape.split(",")
    defines = [f"-DTOOLKIT_NORM_BWD_{m}={v}" for m, v in zip(MACROS, values)]
    for extra in values[len(MACROS):]:
        key, value = extra.split("=")
        defines += [f"-D{macro}={value}" for macro in EXTRAS[key]]
    name = "toolkit_norm_tune_" + "_".join(v.replace("=", "") for v in values)
    directory = loader.cache_root() / "tune" / name
    directory.mkdir(parents=True, exist_ok=True)
    flags = [*plan.cuda_flags, *defines]
    try:
        load(name=name, sources=[str(s) for s in plan.sources], extra_cflags=list(loader.CXX_FLAGS),
             extra_cuda_cflags=flags, extra_include_paths=[str(plan.sources[0].parent)],
             build_directory=str(directory), verbose=False)
    except Exception as exc:  # one shape that does not build must not hide the others
        return name, str(directory), flags, f"{type(exc).__name__}: {str(exc)[-300:]}"
    return name, str(directory), flags, None


def load_built(name: str, directory: str, flags: list[str]):
    from torch.utils.cpp_extension import load

    plan = loader.build_plan("norm")
    return load(name=name, sources=[str(s) for s in plan.sources], extra_cflags=list(loader.CXX_FLAGS),
                extra_cuda_cflags=flags, extra_include_paths=[str(plan.sources[0].parent)],
                build_directory=directory, verbose=False)


# Odd row counts and a row width that is no multiple of a pack: correctness only.
ODD_CASES = ((1037, 771, False), (1037, 768, False), (333, 1600, False), (1037, 2048, True), (5, 96, True))


def inputs(cols: int, rms: bool, rows: int = TOKENS):
    torch.manual_seed(0)
    x = torch.randn(rows, cols, device="cuda")
    w = torch.rand(cols, device="cuda") + 0.5
    b = torch.randn(cols, device="cuda")
    dy = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    return x, w, (None if rms else b), dy


def reference(x, w, b, dy, rms: bool, eps: float):
    """dx, dw, (db,) and y in float64 (autograd through the textbook formula)."""
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    b64 = (torch.zeros_like(w64) if rms else b.double()).requires_grad_(not rms)
    if rms:
        y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64
    else:
        y = F.layer_norm(x64, (x.shape[-1],), w64, b64, eps)
    grads = torch.autograd.grad(y, [x64, w64] + ([] if rms else [b64]), dy.double())
    return (*grads, y.detach())


def relative_error(got, want) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def forward_and_error(module, x, w, b, dy, eps: float, rms: bool, ref):
    """(mean, rstd) from the module's forward; its backward's largest relative error against ref
    (fp32 out: bound 1e-5), and its forward's (bf16 out: bound 1e-2)."""
    y, mean, rstd = module.norm_fwd(x, w, b, eps, rms, 1)  # 1: bf16 out (toolkit.ops.custom_ops codes)
    dx, dw, db = module.norm_bwd(dy, x, w, mean, rstd, rms)
    error = max(relative_error(dx, ref[0]), relative_error(dw, ref[1]), 0.0 if rms else relative_error(db, ref[2]))
    return mean, rstd, error, relative_error(y, ref[-1])


BOUNDS = (1e-5, 1e-2)  # backward, forward


def check_variant(module, cases_data) -> tuple[list, tuple[float, float]]:
    """The (mean, rstd) its forward saves per case, and its largest (backward, forward) errors over
    the odd shapes and the benchmark's."""
    saved, errors = [], []
    for rows, cols, rms in ODD_CASES:
        x, w, b, dy = inputs(cols, rms, rows)
        eps = 1e-6 if rms else 1e-5
        errors.append(forward_and_error(module, x, w, b, dy, eps, rms, reference(x, w, b, dy, rms, eps))[2:])
    for (_, cols, rms), (x, w, b, dy, eps, ref) in zip(CASES, cases_data):
        mean, rstd, *error = forward_and_error(module, x, w, b, dy, eps, rms, ref)
        errors.append(tuple(error))
        saved.append((mean, rstd))
    return saved, (max(e[0] for e in errors), max(e[1] for e in errors))


def time_module(module, cases_data, saved) -> list[tuple[float, float]]:
    """(forward ms, backward ms) per case."""
    times = []
    for (_, cols, rms), (x, w, b, dy, eps, _), (mean, rstd) in zip(CASES, cases_data, saved):
        forward = gpu_ms(lambda: module.norm_fwd(x, w, b, eps, rms, 1), iters=20, cold_l2=COLD_L2)
        times.append((forward, gpu_ms(lambda: module.norm_bwd(dy, x, w, mean, rstd, rms), iters=20, cold_l2=COLD_L2)))
    return times


def errors_cell(errors: tuple[float, float]) -> list[str]:
    wrong = any(e >= bound for e, bound in zip(errors, BOUNDS))
    return [f"{errors[0]:.1e} / {errors[1]:.1e}", "WRONG" if wrong else ""]


def shipped_breakdown(module, cases_data) -> list[str]:
    lines = []
    for (label, _, rms), (x, w, b, dy, eps, _) in zip(CASES, cases_data):
        _, mean, rstd = module.norm_fwd(x, w, b, eps, rms, 1)
        kernels = kernel_us(lambda: module.norm_bwd(dy, x, w, mean, rstd, rms), iters=20)
        lines.append(f"- {label}: " + "; ".join(f"{name[:60]} {us:.1f}" for name, us in kernels.items() if us > 0))
    return lines


def cell(rounds: list[tuple[float, float]], reference: list[tuple[float, float]] | None) -> str:
    """Median forward / backward over the rounds; with a reference (torch.compile, timed in the
    same rounds) and several rounds, the median and range of reference / this forward+backward."""
    text = f"{median([r[0] for r in rounds]):.4f} / {median([r[1] for r in rounds]):.4f}"
    if reference is not None and len(rounds) > 1:
        ratios = [sum(ref) / sum(mine) for ref, mine in zip(reference, rounds)]
        text += f" ({median(ratios):.3f}x, {min(ratios):.3f}-{max(ratios):.3f})"
    return text


def compiled_cases(cases_data, cases=CASES) -> list:
    """torch.compile's forward and forward+backward per case, compiled and run once."""
    fns = []
    for (_, cols, rms), (x, w, b, dy, eps, _) in zip(cases, cases_data):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        bg = None if rms else b.clone().requires_grad_()
        # dynamic=False: the two LayerNorm cases share a lambda's code object, and the second would
        # otherwise get a shape-generic kernel
        if rms:
            fn = torch.compile(lambda x, w: (w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))
                               .to(torch.bfloat16), dynamic=False)
            args = (xg, wg)
        else:
            fn = torch.compile(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5).to(torch.bfloat16),
                               dynamic=False)
            args = (xg, wg, bg)
        leaves = [a for a in args if a is not None]

        def forward(fn=fn, args=args):
            with torch.no_grad():
                fn(*args)

        def both(fn=fn, args=args, leaves=leaves, dy=dy, flush_between=False):
            out = fn(*args)
            if flush_between:
                backward_after_flush(out)
            torch.autograd.grad(out, leaves, dy)

        forward()
        both()
        fns.append((forward, both))
    return fns


def time_compiled(fns) -> list[tuple[float, float]]:
    """torch.compile's forward and backward GPU ms per case (the backward: forward+backward minus forward;
    with --cold-l2 the L2 is overwritten between the two as well, so its backward finds no x its
    forward left there, as ours, timed alone, finds none)."""
    out = []
    for forward, both in fns:
        forward_ms = gpu_ms(forward, iters=20, cold_l2=COLD_L2)
        if COLD_L2:
            both_ms = gpu_ms(lambda: both(flush_between=True), iters=20, cold_l2=True)
        else:
            both_ms = gpu_ms(both, iters=20)
        out.append((forward_ms, both_ms - forward_ms))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.norm_tune", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=";".join(SHAPES), help="P,R,B,M,F[,name=N] shapes separated by ;")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile reference")
    parser.add_argument("--rounds", type=int, default=1, help="time every variant this many times, interleaved")
    parser.add_argument("--cold-l2", action="store_true",
                        help="overwrite the L2 cache before each timed call and between compile's forward and "
                             "backward (benchmarks.kernels.kernel_us's cold_l2)")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    global COLD_L2
    COLD_L2 = args.cold_l2
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to tune", file=sys.stderr)
        return 2
    shapes = [s for s in args.shapes.split(";") if s]
    started = time.perf_counter()
    os.environ.setdefault("MAX_JOBS", "3")
    built = []
    if shapes:  # --shapes ";" times the shipped kernels alone
        with ProcessPoolExecutor(max_workers=min(len(shapes), max(1, (os.cpu_count() or 4) // 2))) as pool:
            built = list(pool.map(build, shapes))
    print(f"built {len(shapes)} shapes in {time.perf_counter() - started:.0f}s", flush=True)
    cases_data = []
    for _, cols, rms in CASES:
        x, w, b, dy = inputs(cols, rms)
        eps = 1e-6 if rms else 1e-5
        cases_data.append((x, w, b, dy, eps, reference(x, w, b, dy, rms, eps)))
    # Every variant (and compile) is timed once per round, in a rotating order: the rounds show the
    # spread, and compile's time in the same round is each variant's reference.
    timers, rows, breakdown = [], [], []
    if not args.no_compile:
        fns = compiled_cases(cases_data)
        timers.append(("torch.compile", lambda: time_compiled(fns), ["", "reference"]))
    shipped = loader.load_extension("norm")
    if shipped is not None:
        saved, errors = check_variant(shipped, cases_data)
        timers.append(("shipped (source defaults)",
                       lambda m=shipped, s=saved: time_module(m, cases_data, s), errors_cell(errors)))
        breakdown = shipped_breakdown(shipped, cases_data)
    for shape, (name, directory, flags, error) in zip(shapes, built):
        if error is not None:
            rows.append([shape, "", "", "", "", f"build failed: {error[:120]}"])
            continue
        module = load_built(name, directory, flags)
        saved, errors = check_variant(module, cases_data)
        timers.append((shape, lambda m=module, s=saved: time_module(m, cases_data, s), errors_cell(errors)))
        print(f"  {shape}: errors {errors}", flush=True)
    times = {label: [] for label, _, _ in timers}
    for round_ in range(args.rounds):
        for i in range(len(timers)):
            label, timer, _ = timers[(i + round_) % len(timers)]
            times[label].append(timer())
    compiled = times.get("torch.compile")
    for label, _, notes in timers:
        per_case = list(zip(*times[label]))  # per case, its (fwd, bwd) of each round
        refs = list(zip(*compiled)) if compiled and label != "torch.compile" else [None] * len(CASES)
        rows.append([label, *(cell(list(c), None if r is None else list(r)) for c, r in zip(per_case, refs)),
                     *notes])
    cold = " (L2 overwritten before each call and between compile's forward and backward)" if COLD_L2 else ""
    text = (f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; x fp32, y bf16, dy bf16, "
            f"{TOKENS} rows; GPU ms = kernel time from the profiler"
            f"{cold}, the median of {args.rounds} "
            "interleaved round(s)" + (" (in brackets: torch.compile's forward+backward over the variant's, per "
                                      "round: median, range)" if args.rounds > 1 else "") + "\n\n"
            + table("Norm shapes, forward / backward GPU ms (backward: P elements/thread, R rows/iteration, "
                    "B block, M min blocks/SM, F prefetch; tails: EXTRAS)",
                    ["shape P,R,B,M,F[,name=N]", *[c[0] for c in CASES], "max rel err vs f64 (bwd / fwd)",
                     "note"], rows))
    if breakdown:
        text += "\nKernels of the shipped backward, GPU us per call:\n" + "\n".join(breakdown) + "\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
