"""Stopping a run cleanly: SIGTERM (how schedulers preempt) and SIGINT (Ctrl-C)
end the run at a step boundary with a checkpoint and one line saying how to
resume; a rank that lost its peer stops without a traceback of its own.

While the loop runs, a signal only sets a flag; at a step boundary the ranks agree
on it (an all-reduce of the signal number, so no rank is left waiting in a
collective; under several ranks only every training.log_interval steps, where the
loop waits for the GPU anyway), finish there, save a checkpoint together and raise `RunStopped`. The
process exits with 128 + the signal's number (143 for SIGTERM, 130 for SIGINT),
the shell's convention for "ended by that signal". Before the loop (start-up) a
signal stops the run at once: nothing is trained yet, nothing is saved. A second
signal while stopping aborts without a checkpoint (one process; under a launcher
the launcher escalates instead: it kills the ranks when its shutdown timeout ends).

SIGXFSZ (a file over the RLIMIT_FSIZE limit) is ignored, so the write fails with
an OSError (EFBIG) that becomes one line instead of killing the process.
"""
from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# `toolkit run --nproc` tells its ranks (toolkit/train/launch.py); here, so that a rank knows it before torch loads:
LAUNCHER_PID_ENV = "TOOLKIT_LAUNCHER_PID"  # a rank checks that its parent is still this process
NOTES_ENV = "TOOLKIT_LAUNCH_NOTES"  # the folder where ranks leave the lines the launcher prints
EXIT_PEER_LOST = 3  # a rank whose peer died first (the launcher reports the peer, not this rank)
_PEER_LOST_MARKERS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                      "Connection refused", "NCCL communicator was aborted")


class RunStopped(BaseException):
    """The run stopped on a signal: at `step`, saved as `checkpoint` (None: nothing saved, `why`).

    NOTE: a BaseException, like KeyboardInterrupt: a signal during start-up must not be swallowed by a
    handler that keeps going on any error (a kernel build falls back on `except Exception`)."""

    def __init__(self, signum: int, run_dir: Path, step: int | None, max_steps: int,
                 checkpoint: Path | None = None, why: str = ""):
        self.signum, self.run_dir, self.step, self.max_steps = signum, Path(run_dir), step, max_steps
        self.checkpoint, self.why = checkpoint, why
        super().__init__(self.describe())

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def describe(self) -> str:
        """One line: which signal, where the run stands, and how to resume."""
        name = signal.Signals(self.signum).name
        where = "during start-up" if self.step is None else f"at step {self.step} of {self.max_steps}"
        saved = f"checkpoint {self.checkpoint}" if self.checkpoint is not None else f"nothing saved ({self.why})"
        return (f"stopped by {name} {where}: {saved}; to resume, run the same command "
                f"with --run-dir {self.run_dir}")


class StopSignals:
    """SIGTERM/SIGINT handlers for one run: raise at once during start-up, defer to a step boundary in the loop."""

    def __init__(self, under_launcher: bool):
        self.under_launcher = under_launcher  # a launcher escalates; repeated signals are its forwarding
        self.signum = 0
        self.deferring = False
        self.run_dir: Path = Path(".")
        self.max_steps = 0
        self._previous: dict[int, object] = {}

    def install(self, run_dir: Path, max_steps: int) -> "StopSignals":
        """Take SIGTERM/SIGINT (and ignore SIGXFSZ) until `restore`; a no-op outside the main thread."""
        self.run_dir, self.max_steps = Path(run_dir), max_steps
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._previous[signal.SIGXFSZ] = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        return self

    def restore(self) -> None:
        """Put back the handlers that were there before `install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame) -> None:
        if not self.deferring:
            raise RunStopped(signum, self.run_dir, None, self.max_steps, why="no step was trained")
        if self.signum and not self.under_launcher:
            raise KeyboardInterrupt  # a second signal: abandon the step and the checkpoint
        self.signum = self.signum or signum

    def agreed(self, info, device) -> int:
        """At a step boundary: the signal any rank received (0: none), the same on every rank."""
        if not info.active:
            return self.signum
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.signum], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.signum = int(flag.item())
        return self.signum


def leave_note(code: int, lines: list[str]) -> bool:
    """Under `toolkit run --nproc`: leave this rank's exit code and lines for the launcher to print (a later note
    replaces an earlier one); False when there is no launcher or no room for the note (the caller prints)."""
    folder = os.environ.get(NOTES_ENV)
    if folder is None:
        return False
    rank = int(os.environ.get("RANK", "0"))
    note = Path(folder) / f"rank-{rank:05d}.json"
    partial = note.with_name(f"{note.name}.partial")
    try:  # whole or not at all: a rank killed while it rewrites its note keeps the earlier one
        partial.write_text(json.dumps({"rank": rank, "exit_code": code, "lines": lines}), encoding="utf-8")
        partial.replace(note)
    except OSError:
        return False
    return True


def under_elastic_launcher() -> bool:
    """True in a rank started by torchrun or `toolkit run --nproc` (its agent forwards signals)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def lost_peer(exc: BaseException) -> bool:
    """True for a collective's error that says another rank went away (collateral, not this rank's fault)."""
    if not isinstance(exc, RuntimeError) or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return False
    return any(marker in str(exc) for marker in _PEER_LOST_MARKERS)
