"""A read-only mount faked for tests, which may run as root (where chmod stops no write):
below a folder, every call that would create, write, rename or remove a file fails
with an OSError (EROFS unless told), while reads go through."""
from __future__ import annotations

import builtins
import errno
import io
import os
from pathlib import Path

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def make_read_only(monkeypatch, folder: Path, code: int = errno.EROFS) -> None:
    """From now on (for this test) nothing below `folder` can be written; `code` is the errno writes get."""
    folder = Path(folder).resolve()

    def below(path) -> bool:
        return isinstance(path, (str, os.PathLike)) and Path(os.path.abspath(path)).is_relative_to(folder)

    def refuse(path):
        raise OSError(code, os.strerror(code), str(path))

    def guard(real, is_write):
        def call(path, *args, **kwargs):
            if below(path) and is_write(*args, **kwargs):
                refuse(path)
            return real(path, *args, **kwargs)
        return call

    def open_mode_writes(mode="r", *args, **kwargs):
        return any(c in mode for c in "wax+")

    def os_open_writes(flags, *args, **kwargs):
        return bool(flags & _WRITE_FLAGS)

    def always(*args, **kwargs):
        return True

    monkeypatch.setattr(builtins, "open", guard(builtins.open, open_mode_writes))
    monkeypatch.setattr(io, "open", guard(io.open, open_mode_writes))  # pathlib opens through io.open
    monkeypatch.setattr(os, "open", guard(os.open, os_open_writes))
    for name in ("mkdir", "rmdir", "unlink", "remove"):
        monkeypatch.setattr(os, name, guard(getattr(os, name), always))
    for name in ("rename", "replace"):
        monkeypatch.setattr(os, name, _guard_move(getattr(os, name), below, refuse))


def _guard_move(real, below, refuse):
    def move(src, dst, *args, **kwargs):
        for path in (src, dst):
            if below(path):
                refuse(path)
        return real(src, dst, *args, **kwargs)
    return move
