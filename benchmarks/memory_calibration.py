"""Measure each rank's memory peak for a matrix of recipes and write it beside the estimator's prediction.

Every configuration is a real `toolkit run` (a fresh process, `max_steps` short steps, nothing saved) read
back from its metrics.jsonl: on CUDA the allocator's max allocated and max reserved bytes, on the CPU the
process's peak resident set; the model-state bytes counted from tensors come along. Configurations run
several at a time on one GPU when their predicted peaks fit together (a process's allocator peak is its
own), one at a time on the CPU.

    python -m benchmarks.memory_calibration --matrix gpu --out rows.jsonl        # on the H200
    python -m benchmarks.memory_calibration --matrix cpu --out rows.jsonl        # here
    python -m benchmarks.memory_calibration --report benchmarks/memory_calibration/*.jsonl

The committed tables (benchmarks/memory_calibration/<machine>.jsonl) hold the measured side; the
prediction is recomputed from the recipe by tests/observe/test_memory_calibration.py, which fails when a
row leaves the tolerance (toolkit/observe/peak.py CALIBRATION_TOLERANCE).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_KEYS = ["training.eval_batches=0", "training.eval_interval=0", "training.log_interval=1",
            "checkpoint.save_final=false", "checkpoint.interval=0", "checkpoint.resume=never",
            "logging.console=false", "logging.tensorboard=false", "logging.wandb.mode=disabled",
            "training.memory_check=off"]

LLAMA_3B = ["model.family=llama", "model.n_layer=26", "model.n_embd=3200", "model.n_head=32", "model.n_kv_head=32",
            "model.intermediate_size=8640", "model.max_positions=2048"]


def config(recipe: str, micro: int, *extra: str, accum: int = 2, seq: int | None = None) -> dict:
    """One matrix row: a shipped recipe, a micro batch, accumulation and overrides; the id names them."""
    overrides = [f"batch.micro_batch_per_rank={micro}", f"batch.grad_accum_steps={accum}",
                 f"batch.global_batch={micro * accum}", *extra]
    if seq is not None:
        overrides.append(f"data.seq_len={seq}")
    short = [o.split(".", 1)[1].replace("activation_checkpointing=true", "ckpt") for o in extra
             if (not o.startswith("model.") or "checkpointing" in o or o.startswith("model.size"))
             and not o.startswith("kernels.")]
    short += ["kernels off"] if any(o.startswith("kernels.") for o in extra) else []
    name = "llama-3b" if "model.n_embd=3200" in extra else recipe
    words = [name, f"m{micro}x{accum}", *(f"s{seq}" for _ in [seq] if seq), *short]
    return {"id": " ".join(words), "recipe": recipe, "overrides": overrides}


# NOTE: the GPU matrix spans each axis of issue 31 (family, size, stage, offload, checkpointing, micro batch,
# precision, compile, sequence) without its full product: 40 rows fit one 10-minute device call.
GPU_MATRIX = [
    config("gpt2-124m", 16, "zero.stage=0"),
    config("gpt2-124m", 64, "zero.stage=0"),
    config("gpt2-124m", 1, "zero.stage=0"),
    config("gpt2-124m", 16, "zero.stage=0", accum=1),
    config("gpt2-124m", 16, "zero.stage=1"),
    config("gpt2-124m", 32, "zero.stage=2", "model.activation_checkpointing=true"),
    config("gpt2-124m", 8, "zero.stage=3"),
    config("gpt2-124m", 8, "zero.stage=0", "precision.dtype=fp32"),
    config("gpt2-124m", 16, "zero.stage=0", "precision.dtype=fp16"),
    config("gpt2-124m", 16, "zero.stage=1", "training.compile=true"),
    config("gpt2-124m", 16, "zero.stage=2", "zero.offload_optimizer=cpu"),
    config("gpt2-medium-zero2", 16, "zero.stage=2"),
    config("gpt2-medium-zero2", 8, "zero.stage=0", "precision.dtype=bf16", "model.max_positions=2048", seq=2048),
    config("gpt2-medium-zero2", 32, "zero.stage=3", "model.activation_checkpointing=true", "precision.dtype=bf16"),
    config("gpt2-medium-zero2", 16, "zero.stage=1", "zero.offload_optimizer=cpu", "precision.dtype=bf16"),
    config("gpt2-1.5b-zero3", 16, "zero.stage=1", "zero.offload_optimizer=none", "model.activation_checkpointing=false"),
    config("gpt2-1.5b-zero3", 8, "zero.stage=3", "zero.offload_optimizer=none"),
    config("gpt2-1.5b-zero3", 16, "zero.stage=2", "model.activation_checkpointing=false"),
    config("gpt2-1.5b-zero3", 4, "zero.stage=0", "zero.offload_optimizer=none", "model.activation_checkpointing=false"),
    config("gpt2-1.5b-zero3", 8, "zero.stage=3", "zero.offload_param=cpu"),
    config("llama-1b", 4, "zero.stage=0"),
    config("llama-1b", 8, "zero.stage=1"),
    config("llama-1b", 16, "zero.stage=2", "model.activation_checkpointing=true"),
    config("llama-1b", 64, "zero.stage=2", "model.activation_checkpointing=true"),
    config("llama-1b", 64, "zero.stage=2", "model.activation_checkpointing=true", "zero.offload_optimizer=cpu"),
    config("llama-1b", 2, "zero.stage=0", "precision.dtype=fp32"),
    config("llama-1b", 4, "zero.stage=2", "training.compile=true"),  # (compile refuses stage 3)
    config("llama-1b", 4, "zero.stage=1", "precision.dtype=fp16", seq=1024),
    config("llama-1b", 32, "zero.stage=1", "training.compile=true", "model.activation_checkpointing=true"),
    config("llama-1b", 4, "zero.stage=0", accum=1),
    config("llama-1b", 4, *LLAMA_3B, "zero.stage=0"),
    config("llama-1b", 4, *LLAMA_3B, "zero.stage=1"),
    config("llama-1b", 16, *LLAMA_3B, "zero.stage=2", "model.activation_checkpointing=true"),
    config("llama-1b", 8, *LLAMA_3B, "zero.stage=1", "zero.offload_optimizer=cpu"),
    config("llama-1b", 32, "model.size=250m", "zero.stage=0", seq=1024),
    config("llama-1b", 64, "model.size=60m", "zero.stage=3", "precision.dtype=fp32", seq=1024),
    config("gpt2-124m", 48, "zero.stage=1", "model.activation_checkpointing=true", seq=512),
    config("gpt2-124m", 4, "model.size=774m", "zero.stage=2", "precision.dtype=fp16"),
]

# Stage 0 with activation checkpointing and no accumulation, which neither matrix above holds (tutorial 10's GPU
# variant ran that case on an H100: 66.4 GiB reported, 12.0 of it the gradients counted twice, so 1.02x the
# prediction; benchmarks/RESULTS.md); two beside their accumulation-2 twins.
STAGE0_CKPT_MATRIX = [
    config("gpt2-124m", 32, "zero.stage=0", "model.activation_checkpointing=true", accum=1),
    config("gpt2-124m", 32, "zero.stage=0", "model.activation_checkpointing=true"),
    config("llama-1b", 16, "zero.stage=0", "model.activation_checkpointing=true", accum=1),
    config("llama-1b", 16, "zero.stage=0", "model.activation_checkpointing=true"),
    config("gpt2-1.5b-zero3", 8, "zero.stage=0", "zero.offload_optimizer=none", "model.activation_checkpointing=true",
           accum=1),
]

# optimizer.state_dtype bf16 (the 16-bit layout): at stage 0 its bf16 weights are the master, so the model holds no
# autocast weight copies, fp32 residual stream or fp32 checkpointed inputs (peak.fp32_weights_under_autocast); stage 1
# beside it, whose layout was already counted that way.
BF16_STATES = ["optimizer.state_dtype=bf16"]
BF16_STATES_MATRIX = [
    config("gpt2-124m", 16, "zero.stage=0", *BF16_STATES),
    config("gpt2-124m", 32, "zero.stage=0", "model.activation_checkpointing=true", *BF16_STATES, accum=1),
    config("llama-1b", 4, "zero.stage=0", *BF16_STATES),
    config("llama-1b", 16, "zero.stage=0", "model.activation_checkpointing=true", *BF16_STATES),
    config("llama-1b", 4, "zero.stage=1", *BF16_STATES),
    config("gpt2-1.5b-zero3", 4, "zero.stage=0", "zero.offload_optimizer=none", "model.activation_checkpointing=false",
           *BF16_STATES),
]

GPT2_SMALL = ["model.n_layer=4", "model.n_embd=256", "model.n_head=4", "data.vocab_size=8192"]
# Rows measured after the model's coefficients were fitted to GPU_MATRIX: the check on cases it was not
# tuned on (other sizes, micro batches, sequences and combinations), and the unfused path (kernels off).
KERNELS_OFF = [f"kernels.{k}=off" for k in ("adamw", "layernorm", "rmsnorm", "bias_gelu", "cross_entropy")]
HOLDOUT_MATRIX = [
    config("gpt2-124m", 1, "zero.stage=0"),
    config("gpt2-124m", 8, "zero.stage=3"),
    config("gpt2-124m", 8, "zero.stage=0", "precision.dtype=fp32"),
    config("gpt2-124m", 16, "zero.stage=2", "zero.offload_optimizer=cpu"),
    config("gpt2-1.5b-zero3", 16, "zero.stage=2", "model.activation_checkpointing=false"),
    config("gpt2-1.5b-zero3", 8, "zero.stage=3", "zero.offload_param=cpu"),
    config("gpt2-124m", 8, "model.size=774m", "zero.stage=1", "model.activation_checkpointing=true"),
    config("gpt2-medium-zero2", 32, "zero.stage=0", "precision.dtype=bf16", accum=1),
    config("gpt2-1.5b-zero3", 4, "zero.stage=2", "zero.offload_optimizer=none", "model.activation_checkpointing=false",
           "model.max_positions=2048", seq=2048),
    config("llama-1b", 64, "model.size=250m", "zero.stage=2", "model.activation_checkpointing=true"),
    config("llama-1b", 8, "zero.stage=3", "precision.dtype=fp16"),
    config("llama-1b", 16, "zero.stage=1", seq=1024),
    config("llama-1b", 8, *LLAMA_3B, "zero.stage=3", "model.activation_checkpointing=true", "zero.offload_param=cpu"),
    config("llama-1b", 64, "model.size=60m", "zero.stage=0", "precision.dtype=bf16"),
    config("llama-1b", 2, "zero.stage=1", "precision.dtype=fp32", seq=1024),
    config("llama-1b", 4, "zero.stage=1", *KERNELS_OFF),
    config("gpt2-124m", 16, "zero.stage=0", *KERNELS_OFF),
    config("gpt2-124m", 16, "zero.stage=2", "model.activation_checkpointing=true", *KERNELS_OFF),
]

# The CPU matrix: tiny and small models in fp32 and bf16, every stage, a few micro batches (2-core VM).
CPU_MATRIX = [
    config("quickstart", 16, "zero.stage=0"),
    config("quickstart", 64, "zero.stage=0", *GPT2_SMALL, seq=256),
    config("quickstart", 16, "zero.stage=1", *GPT2_SMALL, seq=256),
    config("quickstart", 8, "zero.stage=2", *GPT2_SMALL, "precision.dtype=bf16", seq=256),
    config("quickstart", 32, "zero.stage=3", "model.family=llama", "model.size=60m", "data.vocab_size=8192", seq=256),
    config("quickstart", 16, "zero.stage=0", "model.family=llama", "model.size=60m", "data.vocab_size=8192",
           "model.activation_checkpointing=true", seq=512),
    config("quickstart", 8, "zero.stage=1", "model.size=124m", "data.vocab_size=50257", seq=256),
    config("quickstart", 4, "zero.stage=2", "model.family=llama", "model.size=250m", "data.vocab_size=32000",
           "zero.offload_optimizer=cpu", seq=256),
]


def _kv(overrides: list[str]) -> dict:
    return dict(o.split("=", 1) for o in overrides)


def run_config(cfg: dict, steps: int, python: str = sys.executable) -> dict:
    """One `toolkit run` of a configuration; its measured peaks and states (or why it failed)."""
    run_dir = Path(tempfile.mkdtemp(prefix="toolkit-calib-"))
    accum_micro = int(_kv(cfg["overrides"])["batch.global_batch"])
    cmd = [python, "-m", "toolkit", "run", cfg["recipe"], *cfg["overrides"], *RUN_KEYS,
           f"training.max_steps={steps}", f"data.num_samples={accum_micro * steps}", "data.eval_samples=0",
           "--run-dir", str(run_dir / "run")]
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
        row = {"wall_s": round(time.monotonic() - start, 1)}
        if done.returncode != 0:
            tail = [line for line in done.stderr.splitlines() if line.strip()][-3:]
            return {**row, "status": "failed", "why": " | ".join(tail)[-400:]}
        lines = [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()
                 if line.strip()]
        steps_lines = [line for line in lines if "mem_peak_bytes" in line]
        pick = {k: max(line.get(k, 0) for line in steps_lines)
                for k in ("mem_peak_bytes", "mem_reserved_peak_bytes", "mem_params_bytes", "mem_grads_bytes",
                          "mem_optim_bytes", "mem_master_bytes", "mem_offload_bytes", "rss_bytes")}
        per_step = [line["mem_peak_bytes"] for line in steps_lines]
        return {**row, "status": "ok", **pick, "peak_per_step": per_step}
    except subprocess.TimeoutExpired:
        return {"status": "failed", "why": "timeout"}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def predicted_peak(cfg: dict) -> int:
    """The estimator's allocated peak for a configuration (for scheduling runs side by side)."""
    sys.path.insert(0, str(ROOT))
    from toolkit.observe.peak import predict_peak
    from toolkit.recipe.load import load_recipe

    return predict_peak(load_recipe(cfg["recipe"], cfg["overrides"]), on_cuda=True).allocated


def measure(matrix: list[dict], *, steps: int, cuda: bool, parallel_gib: float, workers: int, log,
            out: Path | None = None) -> list[dict]:
    """Run every configuration; on CUDA several at once while their predicted peaks fit `parallel_gib`."""
    machine = _machine(cuda)
    rows: list[dict] = []
    lock = threading.Condition()
    in_use = [0.0]

    def one(cfg: dict) -> dict:
        need = min(parallel_gib, 1.5 * predicted_peak(cfg) / 2**30 + 3) if cuda else 0
        with lock:
            lock.wait_for(lambda: in_use[0] + need <= parallel_gib or in_use[0] == 0)
            in_use[0] += need
        try:
            result = run_config(cfg, steps)
        finally:
            with lock:
                in_use[0] -= need
                lock.notify_all()
        row = {**cfg, **machine, "steps": steps, **result}
        if out is not None:  # as each row ends: a call cut short keeps what it measured
            with lock, out.open("a") as f:
                f.write(json.dumps(row) + "\n")
        log(f"{row['id']}: {row['status']} " + (f"peak {row['mem_peak_bytes'] / 2**30:.2f} GiB"
                                                 if row["status"] == "ok" else row.get("why", "")))
        return row

    ordered = sorted(matrix, key=lambda c: -predicted_peak(c)) if cuda else matrix
    with ThreadPoolExecutor(max_workers=workers if cuda else 1) as pool:
        rows = list(pool.map(one, ordered))
    retry = [r for r in rows if r["status"] != "ok" and cuda]
    for r in retry:  # a neighbour may have taken its memory: once more, alone
        cfg = {k: r[k] for k in ("id", "recipe", "overrides")}
        rows[rows.index(r)] = {**cfg, **machine, "steps": steps, **run_config(cfg, steps), "alone": True}
    return rows


def _machine(cuda: bool) -> dict:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    device = torch.cuda.get_device_name() if cuda else f"cpu ({os.cpu_count()} cores)"
    # the caching allocator's settings change the reserved peak (expandable segments: reserved ~ allocated)
    return {"device": device, "torch": torch.__version__, "date": date.today().isoformat(),
            "commit": commit.strip() or "unknown", "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}


def report(paths: list[Path]) -> str:
    """A markdown table of every row: measured and predicted side by side, the ratio, the worst rows."""
    sys.path.insert(0, str(ROOT))
    from toolkit.observe.peak import compare_row

    lines = ["| configuration | device | measured GiB | predicted GiB | pred/meas | reserved meas | reserved pred |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for path in paths:
        for row in (json.loads(line) for line in path.read_text().splitlines() if line.strip()):
            if row.get("status") != "ok":
                lines.append(f"| {row['id']} | {row.get('device', '')} | failed: {row.get('why', '')[:80]} | | | | |")
                continue
            c = compare_row(row)
            res = (f"{c['measured_reserved'] / 2**30:.2f} | {c['predicted_reserved'] / 2**30:.2f}"
                   if c["measured_reserved"] else " | ")
            lines.append(f"| {row['id']} | {row['device']} | {c['measured'] / 2**30:.3f} | "
                         f"{c['predicted'] / 2**30:.3f} | {c['ratio']:.3f} | {res} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--matrix", choices=("gpu", "holdout", "stage0ckpt", "bf16states", "cpu"))
    parser.add_argument("--only", default="", help="comma-separated substrings of row ids to run")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--parallel-gib", type=float, default=120.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--report", nargs="*", type=Path)
    args = parser.parse_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    # the `toolkit run`s below set the CLI's allocator default where the variables are unset: set it here too, so
    # each row's alloc_conf is what its run used
    sys.path.insert(0, str(ROOT))
    from toolkit.cuda_allocator import use_expandable_segments_by_default

    use_expandable_segments_by_default()
    matrices = {"gpu": GPU_MATRIX, "holdout": HOLDOUT_MATRIX, "stage0ckpt": STAGE0_CKPT_MATRIX,
                "bf16states": BF16_STATES_MATRIX, "cpu": CPU_MATRIX}
    matrix = matrices[args.matrix]
    if args.only:
        matrix = [c for c in matrix if any(s in c["id"] for s in args.only.split(","))]
    partial = args.out.with_suffix(".partial.jsonl") if args.out else None
    if partial:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        partial.unlink(missing_ok=True)
    rows = measure(matrix, steps=args.steps, cuda=args.matrix != "cpu", parallel_gib=args.parallel_gib,
                   workers=args.workers, log=lambda s: print(s, flush=True), out=partial)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
