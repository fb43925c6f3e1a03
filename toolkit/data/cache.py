"""The token cache's entries on disk (toolkit/data/batches.py decides what goes in them):
keys, the per-entry file lock that lets ranks started together build an entry once,
publishing a finished temp dir by rename, and reading an entry back with its
meta.json checked against its token files; a damaged entry (hand-edited, cut short
by a full disk) is set aside with a warning and built again.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from toolkit.errors import UserError, describe_os_error, warn_once
from toolkit.specs import DataSpec

CACHE_FORMAT = 1


def cache_key(obj: dict) -> str:
    """16 hex digits of sha256 over `obj` as sorted JSON: an entry's name."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def publish_entry(tmp: Path, final: Path) -> None:
    """Rename a finished temp dir into place; another process that got there first wins."""
    try:
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.is_dir():
            raise


@contextmanager
def build_lock(final: Path) -> Iterator[None]:
    """Held while checking for and building one cache entry: ranks that start together build it once; not
    taken for an entry that exists in a folder this process cannot write."""
    try:
        import fcntl
    except ImportError:  # not POSIX: concurrent builders are still safe (publish_entry), only wasteful
        yield
        return
    try:
        lock = open(final.parent / f".lock-{final.name}", "w")
    except OSError as exc:
        if final.exists():
            # NOTE: entries appear whole (publish_entry renames), so one that exists is only read: a complete
            # cache on a read-only mount needs no lock (a damaged one says so when it cannot be set aside).
            yield
            return
        raise UserError(f"recipe.data.cache_dir: {final.parent}: cannot write: {describe_os_error(exc)}; "
                        f"{final.name} is not cached there yet: point data.cache_dir at a folder you can "
                        "write") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cache_dir(spec: DataSpec) -> Path:
    """data.cache_dir, created if missing."""
    try:
        spec.cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"recipe.data.cache_dir: {spec.cache_dir}: cannot create: {exc.strerror}") from None
    return spec.cache_dir


def set_aside_damaged(entry: Path, why: str) -> None:
    """Move a damaged cache entry out of the way (then delete it), so that it is built again."""
    warn_once(f"{entry}: damaged cache entry ({why}); building it again")
    doomed = entry.with_name(f".tmp-damaged-{entry.name}-{os.getpid()}")
    try:
        os.rename(entry, doomed)
    except OSError as exc:
        raise UserError(f"recipe.data.cache_dir: {entry}: damaged and cannot be moved ({exc.strerror}); "
                        "delete it") from None
    shutil.rmtree(doomed, ignore_errors=True)


def cached_token_meta(entry: Path) -> dict | None:
    """meta.json of a complete token cache entry, checked against its token files; None: build it."""
    if not entry.exists():
        return None
    try:
        if not (entry / "meta.json").is_file():
            raise ValueError("no meta.json")
        meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
        counts = [meta[k] for k in ("train_tokens", "valid_tokens", "train_documents", "valid_documents",
                                    "eot_id", "vocab_size")]
        if meta["format"] != CACHE_FORMAT or meta["dtype"] not in ("uint16", "uint32") or not all(
                type(n) is int and n >= 0 for n in counts) or not isinstance(meta["unigram_entropy"], float):
            raise ValueError("meta.json has wrong types")
        for split in ("train", "valid"):
            size = (entry / f"{split}.bin").stat().st_size
            if size != meta[f"{split}_tokens"] * np.dtype(meta["dtype"]).itemsize:
                raise ValueError(f"{split}.bin has {size} bytes, not what meta.json says")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        set_aside_damaged(entry, str(exc) if not isinstance(exc, KeyError) else f"meta.json lacks {exc}")
        return None
    return meta


def read_tokens(path: Path, dtype: str, count: int) -> np.ndarray:
    """A token file memory-mapped read-only."""
    if count == 0:
        return np.zeros(0, dtype=dtype)  # np.memmap refuses an empty file
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))
