"""ZeRO-Infinity's swap files: where `zero.offload_optimizer nvme` keeps the fp32 master weights
and AdamW moments, and `zero.offload_param nvme` the rank's parameter shard, and how bytes move
between them and memory.

Each process makes one folder `nvme_path/toolkit-swap-<host>-<pid>-<random>/` and removes it at exit
(atexit, also when training raised; a process killed with SIGKILL leaves it, named so that it is
never mistaken for a checkpoint). A file is reserved whole with posix_fallocate when made, so a disk
that fills up fails at start, not mid-run, and its unwritten regions read as zeros (fresh moments).

I/O: os.preadv / os.pwritev straight into and out of tensor memory (pinned on CUDA), each transfer
cut into `IO_BLOCK` pieces spread over a thread pool of `IO_THREADS` (the GIL is released during
the syscalls). benchmarks/swap_io.py measured this against one thread and other block sizes
(benchmarks/RESULTS.md). What does not live here: the pipelined optimizer step over these files
(offload.py) and stage 3's parameter tiers (param_offload.py).
"""
from __future__ import annotations

import atexit
import ctypes
import os
import secrets
import shutil
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from toolkit.errors import UserError

# NOTE: half the cores, at most 8. The device's disk gave ~1.5 GB/s with one dd writer and ~1.9 GB/s with
# 8; on a loaded 2-core VM (benchmarks/swap_io.py, RESULTS.md) one thread beat 4 and 8 (1.3 vs 0.5 GB/s
# write), so a small machine gets one I/O thread, which still overlaps the I/O with the CPU step.
IO_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))
IO_BLOCK = 8 << 20      # bytes per syscall; benchmarks/swap_io.py compares 1, 8, 16 and 64 MiB and one call
SWAP_PREFIX = "toolkit-swap-"

_pool: ThreadPoolExecutor | None = None


def io_pool() -> ThreadPoolExecutor:
    """The process's I/O threads (made on first use)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="toolkit-swap")
    return _pool


def _forget_pool() -> None:
    global _pool
    _pool = None


# NOTE: a forked child inherits the pool but not its threads; work it submitted would wait forever.
os.register_at_fork(after_in_child=_forget_pool)


class SwapDir:
    """This process's scratch folder under nvme_path, removed at exit."""

    def __init__(self, nvme_path: Path):
        name = f"{SWAP_PREFIX}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.path = Path(nvme_path) / name
        try:
            self.path.mkdir()
        except OSError as exc:
            raise UserError(f"recipe.zero.nvme_path: {nvme_path}: cannot make the swap folder: {exc}") from None
        self.files: list[SwapFile] = []
        atexit.register(self.remove)

    def file(self, name: str, nbytes: int) -> "SwapFile":
        """A new swap file of `nbytes`, reserved on disk (reads as zeros until written)."""
        swap = SwapFile(self.path / name, nbytes)
        self.files.append(swap)
        return swap

    def disk_bytes(self) -> int:
        """Bytes the folder's files take on disk now (what `du` shows)."""
        return sum(f.stat().st_blocks * 512 for f in self.path.iterdir()) if self.path.exists() else 0

    def remove(self) -> None:
        """Close the files and delete the folder (idempotent)."""
        for swap in self.files:
            swap.close()
        shutil.rmtree(self.path, ignore_errors=True)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's memory as a writable byte buffer (no copy; the tensor must be contiguous on the CPU).

    NOTE: through ctypes, not tensor.numpy(): numpy's reference would make the storage non-resizable,
    and stage 3 resizes its gathered buffers to release them."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("swap I/O needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class SwapFile:
    """A fixed-size file read and written at byte offsets from and into CPU tensors, through the I/O pool."""

    def __init__(self, path: Path, nbytes: int):
        self.path, self.nbytes = path, nbytes
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if nbytes:
                os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as exc:
            os.close(self.fd)
            raise UserError(f"recipe.zero.nvme_path: {path.parent.parent}: cannot reserve "
                            f"{nbytes / 2**30:.2f} GiB for a swap file: {exc.strerror}") from None
        self.bytes_read = self.bytes_written = 0

    def _blocks(self, tensor: torch.Tensor, offset: int):
        buffer = _bytes_of(tensor)
        if offset < 0 or offset + len(buffer) > self.nbytes:
            raise ValueError(f"{self.path.name}: bytes {offset}..{offset + len(buffer)} outside {self.nbytes}")
        for a in range(0, len(buffer), IO_BLOCK):
            yield buffer[a:a + IO_BLOCK], offset + a

    def _read_block(self, view: memoryview, offset: int) -> None:
        while len(view):  # preadv may return short
            n = os.preadv(self.fd, [view], offset)
            if n <= 0:
                raise OSError(f"{self.path}: short read at byte {offset}")
            view, offset = view[n:], offset + n

    def _write_block(self, view: memoryview, offset: int) -> None:
        while len(view):
            n = os.pwritev(self.fd, [view], offset)
            view, offset = view[n:], offset + n

    def read_async(self, out: torch.Tensor, offset: int) -> list[Future]:
        """Start reading len(out) bytes at `offset` into `out` (contiguous, CPU); wait on the futures."""
        self.bytes_read += out.numel() * out.element_size()
        return [io_pool().submit(self._read_block, v, o) for v, o in self._blocks(out, offset)]

    def write_async(self, values: torch.Tensor, offset: int) -> list[Future]:
        """Start writing `values` (contiguous, CPU; keep it unchanged until the futures are done) at `offset`."""
        self.bytes_written += values.numel() * values.element_size()
        return [io_pool().submit(self._write_block, v, o) for v, o in self._blocks(values, offset)]

    def read(self, out: torch.Tensor, offset: int) -> torch.Tensor:
        """Read into `out` and wait."""
        wait(self.read_async(out, offset))
        return out

    def write(self, values: torch.Tensor, offset: int) -> None:
        """Write `values` and wait."""
        wait(self.write_async(values, offset))

    def close(self) -> None:
        """Close the file descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def wait(futures: list[Future]) -> None:
    """Wait for every transfer, raising the first error."""
    for future in futures:
        future.result()
