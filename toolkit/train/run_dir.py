"""The run directory's guards: one run at a time (an advisory lock held for the
run's life), the checks made before training (the run directory and the
checkpoint directory are writable; room for a checkpoint where the pre-flight
could not size the model: toolkit/observe/disk_fit.py has the disk's sums). A
write that fails later is one line naming the file: toolkit/errors.py write_failure.

The lock is `fcntl.flock` on <run_dir>/.toolkit-run.lock: the kernel releases it
when the holder exits, however it exits, so a crash never leaves a stale lock.
Under `toolkit run --nproc` the launcher takes it before starting the ranks and
tells rank 0 through LOCK_HELD_ENV; under torchrun rank 0 takes it.

What does not live here: checkpoint files (toolkit/checkpoint/io.py names the
file a failed checkpoint write was writing), signals (toolkit/train/stop.py).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from datetime import datetime
from pathlib import Path

from toolkit.errors import UserError, describe_os_error
from toolkit.observe.disk_fit import checkpoint_bytes, checkpoint_room_line, nearest_existing

LOCK_FILE = ".toolkit-run.lock"
LOCK_HELD_ENV = "TOOLKIT_RUN_DIR_LOCKED"  # the run directory (resolved) whose lock the --nproc launcher holds


def default_run_dir(recipe) -> Path:
    """runs/<recipe-name>-<timestamp>."""
    return Path("runs") / f"{recipe.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


class RunDirLock:
    """An exclusive lock on a run directory, held until `release` (or the process's end)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._fd: int | None = None

    def acquire(self) -> "RunDirLock":
        """Create the directory and take the lock; a UserError when another run holds it."""
        path = self.run_dir / LOCK_FILE
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise _not_writable(self.run_dir, "the run directory", exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise UserError(f"{self.run_dir}: another toolkit run (pid {holder}) is writing this run directory; "
                            "wait for it to end or choose another --run-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        """Let the next run in (closing the file releases the lock; the file stays)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def claim_run_dir(run_dir: Path) -> RunDirLock | None:
    """Lock `run_dir` for this run, unless the --nproc launcher already holds it for us (then None)."""
    if os.environ.get(LOCK_HELD_ENV) == str(Path(run_dir).resolve()):
        return None
    return RunDirLock(run_dir).acquire()


def _not_writable(directory: Path, what: str, exc: OSError) -> UserError:
    return UserError(f"{directory}: {what} is not writable: {describe_os_error(exc)}; "
                     "make it writable or choose another --run-dir")


def _probe_writable(directory: Path, what: str) -> None:
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".tmp-probe-"):
            pass
    except OSError as exc:
        raise _not_writable(directory, what, exc) from None


def check_writable(run_dir: Path, checkpoint_dir: Path | None) -> None:
    """Before training: the run directory and the checkpoint directory (None: no saves) can take files."""
    _probe_writable(run_dir, "the run directory")
    if checkpoint_dir is None:
        return
    existing = nearest_existing(checkpoint_dir)
    if not existing.is_dir():
        inside = "" if existing == checkpoint_dir else f", and checkpoints go inside it to {checkpoint_dir}"
        raise UserError(f"{existing}: is a file, not a directory{inside} (recipe.checkpoint.dir); "
                        "move the file away or set checkpoint.dir to another name")
    if existing != run_dir:
        _probe_writable(existing, "the checkpoint directory")


def check_room_for_checkpoint(checkpoint_dir: Path, num_parameters: int) -> None:
    """Refuse when the disk cannot take one more checkpoint (the pre-flight's check, for a model the
    estimator could not size before it was built)."""
    free = shutil.disk_usage(nearest_existing(checkpoint_dir)).free
    if free < checkpoint_bytes(num_parameters):
        raise UserError(checkpoint_room_line(checkpoint_dir, num_parameters, free))
