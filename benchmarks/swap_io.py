"""Swap-file I/O for ZeRO-Infinity (toolkit/runtime/zero/swap.py): how fast a write and a read-back of
one file move through the paths the toolkit could use, on this machine's disk.

Compared, each writing then reading `--mib` MiB between a CPU tensor and a file under `--dir`:
  threads=N block=B   the toolkit's path: os.pwritev / os.preadv of B-byte blocks spread over N threads
  one call            one thread, the whole buffer in a single syscall loop (block = everything)
A `dd`-like baseline is the 1-thread 16 MiB row. Each figure is the median of `--rounds`; before each
read the file's pages are dropped from the page cache (posix_fadvise DONTNEED after fsync) so reads come
from the disk, and every write is fsync'ed inside its timing, so writes count the disk, not the cache.

    python -m benchmarks.swap_io --dir /tmp --mib 256 --rounds 3
Prints a markdown table (and writes it to --out when given).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from toolkit.runtime.zero import swap


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure(folder: Path, nbytes: int, threads: int, block: int, rounds: int) -> tuple[float, float]:
    """(write GB/s, read GB/s), medians over `rounds`, through swap.SwapFile with this pool and block size."""
    swap.IO_BLOCK, swap._pool = block, None
    swap.IO_THREADS = threads
    data = torch.randn(nbytes // 4)
    back = torch.empty_like(data)
    writes, reads = [], []
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        f = swap.SwapFile(Path(scratch) / "bench.bin", nbytes)
        for _ in range(rounds):
            t = time.perf_counter()
            f.write(data, 0)
            os.fsync(f.fd)
            writes.append(nbytes / (time.perf_counter() - t) / 1e9)
            _drop_cache(f.path)
            t = time.perf_counter()
            f.read(back, 0)
            reads.append(nbytes / (time.perf_counter() - t) / 1e9)
        f.close()
    if not torch.equal(back, data):
        raise SystemExit("read-back differs from what was written")
    return statistics.median(writes), statistics.median(reads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="folder on the disk to measure")
    ap.add_argument("--mib", type=int, default=256, help="file size")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="also write the table here")
    args = ap.parse_args()
    nbytes = args.mib << 20
    cases = [(1, nbytes, "one call, 1 thread"), (1, 16 << 20, "1 thread, 16 MiB blocks (dd-like)"),
             (4, 8 << 20, "4 threads, 8 MiB blocks"), (8, 1 << 20, "8 threads, 1 MiB blocks"),
             (8, 8 << 20, "8 threads, 8 MiB blocks (the toolkit's default)"), (8, 64 << 20, "8 threads, 64 MiB blocks")]
    lines = [f"swap I/O, {args.mib} MiB file under {args.dir}, median of {args.rounds}, page cache dropped "
             f"before reads, writes fsync'ed; {os.cpu_count()} CPUs", "",
             "| path | write GB/s | read GB/s |", "| --- | --- | --- |"]
    for threads, block, label in cases:
        w, r = measure(Path(args.dir), nbytes, threads, block, args.rounds)
        lines.append(f"| {label} | {w:.2f} | {r:.2f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
