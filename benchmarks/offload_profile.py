"""Where ZeRO-Offload's step goes on one GPU (issue 36 item 1): a recipe's step split into the forward and
backward, the optimizer step's CPU seconds blocked on a piece's transfers and those in its CPU AdamW
(`OffloadedStep.last_seconds`), the CPU AdamW's seconds that ran during the backward (zero.offload_update
overlapped: `OffloadedStep.piece_spans`), and the GPU's copy time each way (torch.profiler's Memcpy rows, one step).

    python -m benchmarks.offload_profile [--recipe gpt2-1.5b-h200] [--steps 5] [--modes exact,overlapped]
                                         [--markdown FILE] [OVERRIDES ...]

Default overrides: ZeRO stage 2, zero.offload_optimizer cpu, micro 16 x 1024, accumulation 1 (the issue's setting).
--modes: zero.offload_update values, one engine after the other in this process (delayed ones delayed from the
second step unless zero.offload_update_warmup is given: their CPU AdamW columns are the thread's, the update of
the step before, which runs beside the forward and backward; `delayed/late-landing`: its weights copied into the
model in the optimizer step, not during the next backward, for comparison). Under the recipe's clipping
(training.grad_clip > 0) overlapped speculates on the clip coefficient (runtime/zero/speculation.py); the last
column counts what its guesses came to over the timed steps (stood, rolled back, waited).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

LATE = "/late-landing"  # a --modes suffix: a delayed update lands in the optimizer step (delayed_update.py)
DEFAULT = ["zero.stage=2", "zero.offload_optimizer=cpu", "batch.grad_accum_steps=1", "batch.global_batch=16",
           "checkpoint.save_final=false", "logging.tensorboard=false"]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_step(engine, stream) -> dict:
    """One optimizer step: wall seconds of the forward+backward and of the step (each ended by a sync)."""
    start = time.perf_counter()
    for batch in stream.next_step():
        engine.backward(engine(batch))
    sync()
    backward_end = time.perf_counter()
    engine.step()
    sync()
    end = time.perf_counter()
    delayed = [p.delayed for p in engine.strategy.parts if p.delayed is not None and p.delayed.cpu_spans]
    if delayed:  # the thread's update launched a step ago, which ran beside this forward and backward (the one this
        # step launched may have ended already on a fast machine: the last span that began before the backward's end)
        spans = [[(b, e) for b, e in d.cpu_spans if b < backward_end][-1:] for d in delayed]
        parts = [{"waited": 0.0, "stepped": sum(e - b for b, e in s)} for s in spans]
        under_backward = sum(max(0.0, min(e, backward_end) - max(b, start)) for s in spans for b, e in s)
    else:
        steps = [p.offloaded_step for p in engine.strategy.parts if p.offloaded_step is not None]
        parts = [step.last_seconds for step in steps]
        under_backward = sum(max(0.0, min(e, backward_end) - max(b, start))
                             for step in steps for b, e in step.piece_spans)
    joined = sum(e - max(b, backward_end) for d in delayed for b, e in d.wait_spans if e >= backward_end)
    return {"fwd_bwd": backward_end - start, "step": end - backward_end,
            "waited": sum(p["waited"] for p in parts), "stepped": sum(p["stepped"] for p in parts),
            "under_backward": under_backward, "joined": joined}


def copy_ms(engine, stream) -> dict:
    """GPU milliseconds of device-to-host and host-to-device copies in one profiled step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * torch.cuda.is_available()
    with profile(activities=activities) as prof:
        timed_step(engine, stream)
    totals = {"DtoH": 0.0, "HtoD": 0.0}
    for event in prof.key_averages():
        for way in totals:
            if "Memcpy" in event.key and way in event.key:
                device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
                totals[way] += device_us / 1e3
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="gpt2-1.5b-h200")
    parser.add_argument("--steps", type=int, default=5, help="timed steps, after 3 warm-up steps")
    parser.add_argument("--modes", type=lambda text: text.split(","), default=["exact"],
                        help="zero.offload_update values to profile, comma-separated")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    lines, device = [], None
    for mode in args.modes:
        extra = [f"zero.offload_update={mode.removesuffix(LATE)}"]
        if mode.startswith("delayed") and not any(o.startswith("zero.offload_update_warmup=") for o in args.overrides):
            extra.append("zero.offload_update_warmup=1")  # delayed from the second step: every timed step is
        row, tokens, device = profile_mode(args.recipe, [*args.overrides, *extra], args.steps,
                                           late_landing=mode.endswith(LATE))
        lines.append(f"| {mode} | {row}")
    lines = [f"{args.recipe} {' '.join(args.overrides)}: {tokens:,} tokens a step, {args.steps} steps (median ms); "
             f"{device}, torch {torch.__version__}", "",
             "| zero.offload_update | forward + backward | optimizer step | of which CPU blocked on transfers | "
             "CPU AdamW (all of it) | of it during the backward | step's wait for the delayed thread | D2H GPU ms (one "
             "step) | H2D GPU ms (one step) | tokens/s | clip guesses |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", *lines]
    print("\n".join(lines))
    if args.markdown:
        with args.markdown.open("a") as out:
            out.write("\n".join(lines) + "\n\n")
    return 0


def profile_mode(recipe_name: str, overrides: list[str], steps: int,
                 late_landing: bool = False) -> tuple[str, int, torch.device]:
    """(the table's cells after the mode, tokens a step, the device) of one engine of `recipe_name` (late_landing: a
    delayed update lands in the optimizer step, as weights in CPU memory do, for the comparison)."""
    from toolkit.data.batches import BatchStream, Dataset
    from toolkit.recipe.load import load_recipe
    from toolkit.runtime.engine import Engine

    recipe = load_recipe(recipe_name, [*DEFAULT, *overrides])
    engine = Engine(recipe)
    if late_landing:
        for part in engine.strategy.parts:
            if part.delayed is not None:
                part.delayed.early_landing, part.delayed.cpu_step.piece_done = False, None
    stream = BatchStream(Dataset(recipe.data).train, recipe.batch, rank=0, seed=recipe.training.seed)
    for _ in range(3):
        timed_step(engine, stream)
    rows = [timed_step(engine, stream) for _ in range(steps)]
    overlapped = engine.strategy.parts[-1].overlapped if hasattr(engine.strategy, "parts") else None
    speculation = overlapped.speculation if overlapped is not None else None
    guesses = (", ".join(f"{name} {list(speculation.outcomes)[-steps:].count(name)}"
                         for name in ("stood", "rolled back", "waited")) if speculation is not None else "-")
    copies = copy_ms(engine, stream)
    median = {key: 1e3 * statistics.median(r[key] for r in rows) for key in rows[0]}
    tokens = recipe.batch.global_batch * recipe.data.seq_len
    total = median["fwd_bwd"] + median["step"]
    device = engine.device
    engine.strategy.complete_pending_update()  # NOTE: a delayed update left in flight aborts the interpreter's exit
    del engine, stream
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the next mode's engine starts from an empty device
    return (f"{median['fwd_bwd']:.0f} | {median['step']:.0f} | {median['waited']:.0f} | {median['stepped']:.0f} | "
            f"{median['under_backward']:.0f} | {median['joined']:.0f} | {copies['DtoH']:.0f} | {copies['HtoD']:.0f} | {tokens / total * 1e3:,.0f} | "
            f"{guesses} |",
            tokens, device)


if __name__ == "__main__":
    sys.exit(main())
