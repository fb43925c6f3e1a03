"""`toolkit run --nproc N`: start N ranks on this machine through torch.distributed's
elastic launcher (what `torchrun --standalone --nproc_per_node N` runs), each
executing `python -m toolkit run ...` with RANK / WORLD_SIZE / MASTER_ADDR set.

The recipe is validated for N ranks before anything starts, so a user mistake is
one line and exit code 2 here, not N copies of it from the ranks. The launcher
holds the run directory's lock for the ranks (toolkit/train/run_dir.py) and speaks for
them: each rank leaves its last words (a user error, the stop line) in a notes
folder instead of printing them, and the launcher prints them once, or one line
naming the rank that failed first and why. The ranks die with the launcher
(`die_with_launcher`: PR_SET_PDEATHSIG), so killing it leaves no orphans.

Signals: SIGINT/SIGTERM to the launcher reach the ranks through torch elastic's
agent (it forwards the signal, waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT, default 30 s,
then kills); the ranks checkpoint together and stop (toolkit/train/stop.py).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path

from toolkit.errors import UserError
from toolkit.train.run_dir import LOCK_HELD_ENV, RunDirLock
from toolkit.train.stop import EXIT_PEER_LOST, LAUNCHER_PID_ENV, NOTES_ENV, RunStopped, leave_note, lost_peer

EXIT_USER_ERROR = 2
# Exit codes of ranks that ended because another one failed first: stopped by the launcher's
# SIGTERM (killed, or stopped cleanly), or lost their peer in a collective.
_COLLATERAL = {-signal.SIGTERM, 128 + signal.SIGTERM, EXIT_PEER_LOST}


def launch_ranks(nproc: int, toolkit_args: list[str], run_dir: Path) -> int:
    """Run `python -m toolkit *toolkit_args` as `nproc` ranks in `run_dir` (locked for them); the exit code."""
    if "WORLD_SIZE" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        raise UserError("--nproc inside a torchrun launch: give one or the other")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    lock = RunDirLock(run_dir).acquire()
    notes = Path(tempfile.mkdtemp(prefix="toolkit-launch-"))
    # NOTE: no OMP_NUM_THREADS here: each rank's training.cpu_threads 'auto' takes its share of the cores
    # it may use (LOCAL_WORLD_SIZE), or one thread for a small model (toolkit/runtime/cpu_threads.py).
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1)
    _quiet_elastic_logs()
    env = {LOCK_HELD_ENV: str(run_dir.resolve()), LAUNCHER_PID_ENV: str(os.getpid()), NOTES_ENV: str(notes)}
    try:
        with _environment(env), _own_signal_handlers():
            elastic_launch(config, sys.executable)("-m", "toolkit", *toolkit_args)
        return 0
    except ChildFailedError as exc:
        return _report_failure(exc.failures, nproc, _read_notes(notes), run_dir)
    except SignalException as exc:
        stopped = [line for code, lines in _read_notes(notes).values() if code == 128 + exc.sigval for line in lines]
        # no rank's line: they were killed (the shutdown timeout) or ended otherwise, so whether this stop
        # saved a checkpoint is unknown here; the resume takes the last complete one either way
        _print_once(stopped or [f"stopped by {signal.Signals(exc.sigval).name}; no rank said where it stopped; "
                                f"to resume from the last complete checkpoint, run the same command with "
                                f"--run-dir {run_dir}"])
        return 128 + exc.sigval
    finally:
        shutil.rmtree(notes, ignore_errors=True)
        lock.release()


def _report_failure(failures: dict, nproc: int, notes: dict, run_dir: Path) -> int:
    """Print the ranks' own lines, or one line naming the rank that failed first and why; the exit code."""
    order = list(failures)  # the launcher records the ranks it found failed first, first
    first = min(failures, key=lambda r: (failures[r].timestamp, failures[r].exitcode in _COLLATERAL,
                                         r not in notes, order.index(r)))
    code = failures[first].exitcode
    user_errors = [line for c, lines in notes.values() if c == EXIT_USER_ERROR for line in lines]
    if code == EXIT_USER_ERROR and user_errors:
        _print_once(user_errors)
        return EXIT_USER_ERROR
    if first in notes:
        _print_once(notes[first][1])
        return notes[first][0]
    others = sorted(r for r in failures if r != first)
    after = f"; rank(s) {', '.join(map(str, others))} stopped after it" if others else ""
    print(f"error: rank {first} of {nproc} failed first: {_cause(code)}{after}; the run resumes from its last "
          f"checkpoint with the same command and --run-dir {run_dir}", file=sys.stderr, flush=True)
    return 1


def _cause(exitcode: int) -> str:
    if exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else f"signal {-exitcode}"
        oom = " (the kernel's out-of-memory killer sends SIGKILL too)" if -exitcode == signal.SIGKILL else ""
        return f"killed by {name}{oom}"
    if exitcode > 128 and exitcode - 128 in signal.valid_signals():
        return f"stopped by {signal.Signals(exitcode - 128).name}"
    if exitcode == EXIT_USER_ERROR:
        return "a user error (its line is above)"
    return f"exit code {exitcode} (its traceback is above)"


def _print_once(lines: list[str]) -> None:
    for line in dict.fromkeys(lines):  # the same line from several ranks is said once
        print(line, file=sys.stderr, flush=True)


def _read_notes(folder: Path) -> dict[int, tuple[int, list[str]]]:
    notes = {}
    for path in sorted(folder.glob("rank-*.json")):
        try:
            note = json.loads(path.read_text(encoding="utf-8"))
            notes[int(note["rank"])] = (int(note["exit_code"]), [str(x) for x in note["lines"]])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a rank killed while writing its note: the exit code speaks for it
    return notes


def _quiet_elastic_logs() -> None:
    """torch elastic logs every shutdown and failure; the launcher says it in one line instead."""
    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


@contextmanager
def _environment(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def _own_signal_handlers():
    """torch elastic installs handlers that raise SignalException; put ours back when it is done."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------------------
# The rank's side

def die_with_launcher() -> None:
    """In a rank of `toolkit run --nproc`: ask the kernel for SIGKILL when the launcher dies, however it dies."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    # NOTE: PR_SET_PDEATHSIG fires when the parent (the thread that started us) ends; torch elastic
    # starts the ranks from the launcher's main thread (a numactl wrapper execs, keeping the pid).
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    if os.getppid() == int(launcher):
        return
    try:
        os.kill(int(launcher), 0)
    except ProcessLookupError:  # it died before we asked: nobody is left to report to
        os._exit(EXIT_PEER_LOST)


def end_rank(exc: BaseException) -> int:
    """How a `toolkit run` process ends on `exc`: its line (printed, or left for the --nproc launcher) and
    its exit code. A bug is re-raised and keeps its traceback."""
    rank = int(os.environ.get("RANK", "0"))
    if isinstance(exc, RunStopped):
        # NOTE: every rank leaves the same line (the launcher says it once): the checkpoint was saved together, so
        # any rank can tell it, and the line survives one rank ending otherwise (a lost peer on the way out).
        code, lines = exc.exit_code, [exc.describe()]
    elif isinstance(exc, UserError):
        code, lines = EXIT_USER_ERROR, [f"error: {line}" for line in exc.lines]
    elif lost_peer(exc):
        first = str(exc).strip().splitlines()[0]
        code, lines = EXIT_PEER_LOST, [f"error: rank {rank}: lost contact with another rank, which failed first "
                                       f"({first[-120:]})"]
    else:
        raise exc
    if os.environ.get(NOTES_ENV) is None:  # one process, or torchrun: a stop line from rank 0 only
        for line in lines if rank == 0 or not isinstance(exc, RunStopped) else []:
            print(line, file=sys.stderr, flush=True)
    elif code != EXIT_PEER_LOST and lines and not leave_note(code, lines):  # the launcher names the first failure
        for line in lines:  # no room for the note: say it here
            print(line, file=sys.stderr, flush=True)
    return code
