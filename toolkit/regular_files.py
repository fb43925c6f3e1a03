"""The files a user names (a recipe and its `extends`, corpus files, a tokenizer's files):
whether a path is a regular file to read and, when it is not, why, in one place.

Only regular files are read: reading /dev/zero or a FIFO would never end. The
recipe loader and the corpus word the refusal their own way (their messages are
part of the CLI), so `regular_file_problem` says both what kind of problem it is
and the words for it. Which paths to look at (globs, ${variables}) lives in
toolkit/data/paths.py; how a recipe file is parsed, in toolkit/recipe/files.py.
"""
from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from typing import BinaryIO

from toolkit.errors import UserError

# NOTE: no symbolic link here: os.stat and os.fstat follow links, so a mode is never one.
_FILE_TYPES = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
               stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


@dataclass(frozen=True)
class FileProblem:
    """Why a path is no regular file to read: `kind` is missing (no file, or a dangling link), directory,
    special (a FIFO, device or socket) or unreadable (the look itself failed); `words` say it in full."""
    kind: str
    words: str

    def __str__(self) -> str:
        return self.words


def _not_regular(mode: int) -> str:
    return f"not a regular file ({_FILE_TYPES.get(stat.S_IFMT(mode), 'a special file')})"


def regular_file_problem(path: str | os.PathLike) -> FileProblem | None:
    """Why `path` (symbolic links followed) is no regular file to read, or None if it is; stats, never opens."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if not os.path.islink(path):
            return FileProblem("missing", "no such file")
        try:
            return FileProblem("missing", f"a dangling symbolic link (to {os.readlink(path)})")
        except OSError:
            return FileProblem("missing", "a dangling symbolic link")
    except OSError as exc:  # ELOOP (a link to itself), EACCES on a folder above, ENAMETOOLONG...
        if exc.errno == errno.ELOOP:
            return FileProblem("unreadable", "a symbolic link that loops")
        return FileProblem("unreadable", f"cannot read: {exc.strerror}")
    except ValueError as exc:  # a NUL byte in the name
        return FileProblem("unreadable", f"cannot read: {exc}")
    if stat.S_ISREG(mode):
        return None
    return FileProblem("directory" if stat.S_ISDIR(mode) else "special", _not_regular(mode))


def open_regular_file(path: str | os.PathLike) -> BinaryIO:
    """`path` opened for binary reading if it is a regular file, else a one-line UserError naming it.

    NOTE: opened non-blocking, then checked with fstat: a FIFO that replaced the file after
    it was listed is refused instead of blocking forever on its first read.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror}") from None
    except ValueError as exc:  # a NUL byte in the name
        raise UserError(f"{path}: cannot read: {exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UserError(f"{path}: {_not_regular(mode)}; only regular files are read")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")
