"""Where metrics go, behind one small interface (`log(metrics)`, `close()`):
metrics.jsonl (always), the console (start-up table, progress, summary),
TensorBoard event files and W&B runs (offline works with no network)."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from toolkit.optional_packages import require_package
from toolkit.specs import LoggingSpec


class JsonlTracker:
    """One JSON object per line in <run_dir>/metrics.jsonl, flushed at once."""

    def __init__(self, path: Path, append: bool):
        self.path = path
        self._file = open(path, "a" if append else "w", encoding="utf-8")
        self._failed = False  # a write failed (its line is still in the buffer)

    def log(self, metrics: dict) -> None:
        try:
            self._file.write(json.dumps(metrics) + "\n")
            self._file.flush()
        except OSError as exc:  # a write's error has no file name: give it ours
            self._failed = True
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:  # flushing the line that already failed: reported by `log`
            if not self._failed:
                raise


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class ConsoleTracker:
    """A progress line (rewritten in place on a terminal, one line per log otherwise)."""

    def __init__(self, total_steps: int, stream=None, steps_per_epoch: int | None = None):
        self.total_steps = total_steps
        self.steps_per_epoch = steps_per_epoch  # an epoch-based run shows `epoch 1.50/2.00`
        self.stream = stream or sys.stdout
        self.interactive = self.stream.isatty()
        self._start = time.perf_counter()
        self._skipped_seen = 0

    def log(self, metrics: dict) -> None:
        step = metrics["step"]
        if "eval_loss" in metrics:
            self._print(f"step {step:>6}/{self.total_steps} | eval loss {metrics['eval_loss']:.4f}", final=True)
            return
        elapsed = time.perf_counter() - self._start
        eta = elapsed / max(step, 1) * (self.total_steps - step) if step else float("nan")
        epoch = (f"epoch {step / self.steps_per_epoch:.2f}/{self.total_steps / self.steps_per_epoch:.2f} | "
                 if self.steps_per_epoch else "")
        line = (f"step {step:>6}/{self.total_steps} | {epoch}loss {metrics['loss']:.4f} | lr {metrics['lr']:.2e} | "
                f"{metrics['tokens_per_s'] / 1e3:8.1f}k tok/s | ETA {_fmt_duration(eta)}")
        if "mfu" in metrics:
            line += f" | MFU {metrics['mfu']:.1%}"
        skipped = metrics.get("skipped_steps", 0)
        if skipped > self._skipped_seen:  # fp16 overflow steps since the last line
            line += f" | {skipped - self._skipped_seen} skipped (overflow), scale {metrics.get('loss_scale', 0):g}"
            self._skipped_seen = skipped
        self._print(line, final=not self.interactive or step == self.total_steps)

    def _print(self, line: str, final: bool) -> None:
        if self.interactive:
            self.stream.write("\r\033[K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        pass


class TensorBoardTracker:
    """Scalars under <run_dir>/tensorboard, readable by a TensorBoard server."""

    def __init__(self, log_dir: Path):
        require_package("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict) -> None:
        step = metrics["step"]
        for key, value in metrics.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run in <run_dir>/wandb; `run_id` lets a resumed run continue the same one."""

    def __init__(self, run_dir: Path, project: str, name: str, mode: str, run_id: str | None, config: dict):
        require_package("wandb")
        import wandb

        self.run = wandb.init(project=project, name=name, mode=mode, dir=str(run_dir), id=run_id,
                              resume="allow", config=config, reinit="finish_previous")
        self.run_id = self.run.id

    def log(self, metrics: dict) -> None:
        self.run.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """Fan-out to every enabled backend."""

    def __init__(self, trackers: list):
        self.trackers = trackers

    def log(self, metrics: dict) -> None:
        for tracker in self.trackers:
            tracker.log(metrics)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()

    @property
    def wandb_run_id(self) -> str | None:
        """The W&B run id, stored in checkpoints so a resume continues the same run."""
        for tracker in self.trackers:
            if isinstance(tracker, WandbTracker):
                return tracker.run_id
        return None


def build_trackers(spec: LoggingSpec, run_dir: Path, total_steps: int, *, console: bool, append: bool,
                   wandb_run_id: str | None = None, config: dict | None = None,
                   steps_per_epoch: int | None = None) -> Trackers:
    """The trackers a recipe's logging section asks for (JSONL always)."""
    trackers = [JsonlTracker(run_dir / "metrics.jsonl", append=append)]
    if console:
        trackers.append(ConsoleTracker(total_steps, steps_per_epoch=steps_per_epoch))
    if spec.tensorboard:
        trackers.append(TensorBoardTracker(run_dir / "tensorboard"))
    if spec.wandb.mode != "disabled":
        trackers.append(WandbTracker(run_dir, spec.wandb.project, spec.wandb.run_name or run_dir.name,
                                     spec.wandb.mode, wandb_run_id, config or {}))
    return Trackers(trackers)
