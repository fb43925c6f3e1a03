"""The tiny quickstart runs the checkpoint tests share: its overrides, the recipe, and the losses a run's
metrics.jsonl recorded."""
import json

from toolkit.recipe.load import load_recipe

TINY = ["data.num_samples=128", "data.seq_len=32", "data.eval_samples=16", "batch.micro_batch_per_rank=8",
        "scheduler.warmup_num_steps=1", "scheduler.total_num_steps=8", "training.eval_batches=1",
        "training.log_interval=1", "logging.console=false", "model.dropout=0.1"]


def tiny(*overrides):
    return load_recipe("quickstart", [*TINY, *overrides])


def train_losses(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(m["step"], m["loss"]) for m in lines if "loss" in m]
