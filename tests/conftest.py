"""Shared test set-up: GPU tests carry the `cuda` marker and are skipped without CUDA."""
import os
import socket
import sys
from pathlib import Path

import pytest

from toolkit.cuda_allocator import ALLOC_CONF_VARIABLES, use_expandable_segments_by_default

REPO = Path(__file__).resolve().parent.parent

# NOTE: idle OpenMP threads sleep, as under the CLI (toolkit/runtime/cpu_threads.py says why). Set before any test
# module loads torch; the ranks and CLI runs the tests start inherit it. On the 2-core VM under `-n 2` a spinning
# torch thread starved the other worker (tutorial 10's cell 3: 138 s spinning, 28 s passive, 2026-12-07).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The CUDA allocator's settings as the CLI sets them by default (toolkit/cuda_allocator.py), whatever the shell
# set: the reserved bytes the tests predict and the words they check do not depend on it, nor on whether a test
# called the CLI's main in this process first.
for _name in ALLOC_CONF_VARIABLES:
    os.environ.pop(_name, None)
use_expandable_segments_by_default()


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


_PYTHONPATH_AT_START = os.environ.get("PYTHONPATH")


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300, fresh: bool = False):
    """Run the `toolkit ARGS` command; returns CompletedProcess (text).

    NOTE: in a forked child of the test process, which has torch, transformers and the toolkit imported already: a
    new `python -m toolkit` paid about 6.7 s of imports on the 2-core VM, some 80 times a suite. fresh=True (and a
    PYTHONPATH a test changed, as no_torch does) starts a new interpreter instead: for what happens at start-up,
    before torch is loaded, or with module state (warnings already shown, caches) this process may hold."""
    import subprocess

    if fresh or os.environ.get("PYTHONPATH") != _PYTHONPATH_AT_START:
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        return subprocess.run([sys.executable, "-m", "toolkit", *args], cwd=cwd or REPO, env=env,
                              capture_output=True, text=True, timeout=timeout)
    return _forked_cli(list(args), cwd or REPO, timeout)


def _forked_cli(args: list[str], cwd: Path, timeout: float):
    """`toolkit ARGS` as `python -m toolkit` runs it, in a forked child; its stdout and stderr from files."""
    import atexit
    import subprocess
    import tempfile
    import time
    import traceback
    import warnings

    import toolkit.cli.main  # imported here, in the parent, once: the child only calls it

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                atexit._clear()  # the test process's handlers are not this command's
                warnings.resetwarnings()  # as in a new interpreter: "once" warnings shown again
                warnings.simplefilter("default")
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout = open(1, "w", closefd=False, buffering=1)
                sys.stderr = open(2, "w", closefd=False, buffering=1)
                sys.stdin = open(os.devnull)
                os.chdir(cwd)
                sys.argv = [str(REPO / "toolkit" / "__main__.py"), *args]
                code = toolkit.cli.main.main(args)
                distributed = sys.modules.get("toolkit.distributed")
                if distributed is not None and distributed._joined_group:
                    distributed.exit_process(code)  # leaves the group, runs the handlers, os._exit
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if not isinstance(exc.code, (int, type(None))):
                    print(exc.code, file=sys.stderr)
            except BaseException:  # noqa: BLE001 - a traceback, as the interpreter would print it
                traceback.print_exc()
            finally:
                try:
                    atexit._run_exitfuncs()
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code if isinstance(code, int) else 0)  # sys.exit(None)'s 0; never back into pytest
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(["toolkit", *args], timeout)
            time.sleep(0.02)
        out.seek(0)
        err.seek(0)
        code = os.waitstatus_to_exitcode(status)
        return subprocess.CompletedProcess(["toolkit", *args], code, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


@pytest.fixture
def no_torch(tmp_path, monkeypatch):
    """Later run_cli calls cannot import torch: what they do happens before torch is loaded."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    monkeypatch.setenv("PYTHONPATH", str(site))


def wait_for_step(out_file: Path, step: int, proc, timeout: float = 180) -> None:
    """Wait until a run's console output (`out_file`) shows `step`; fails if `proc` ends first."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        if f"step {step:>6}/" in out_file.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"no step {step} within {timeout}s")


def free_port() -> int:
    """A free TCP port on localhost (a process group's rendezvous, a server a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leave_rank() -> None:
    """The end of a spawned test rank, once its results are saved: leave the group, then the process without the
    interpreter's teardown, where gloo's threads may abort it (toolkit.distributed.exit_process says why)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def become_rank(rank: int, world: int, port: int, **env: str) -> None:
    """In a test's rank process: the environment torch.distributed reads, warnings off, one torch thread each
    (several ranks share the machine's cores)."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), **env)
    torch.set_num_threads(1)
